"""Nested timeouts: every blocking call on a failure path has a deadline, and an outer wait
is always longer than the longest inner one it contains.

    shard call            T = embeddings.call_timeout_s
    supervisor method     supervisor_wait_s = 4 T: waits for a recovery (respawn T, load T,
                          one retry) and probes shards within this, then answers or raises
    trainer -> supervisor trainer_wait_s = supervisor_wait_s + T
"""

from __future__ import annotations

import time
from dataclasses import dataclass

__all__ = ["Deadlines", "Deadline"]


@dataclass(frozen=True)
class Deadlines:
    shard_call_s: float

    @property
    def supervisor_wait_s(self) -> float:
        return 4 * self.shard_call_s

    @property
    def trainer_wait_s(self) -> float:
        return self.supervisor_wait_s + self.shard_call_s


class Deadline:
    """A point in time; ``remaining(cap)`` is what an inner wait may use of it."""

    def __init__(self, total_s: float):
        self.total_s = total_s
        self._end = time.monotonic() + total_s

    def remaining(self, cap: float | None = None) -> float:
        left = max(0.0, self._end - time.monotonic())
        return left if cap is None else min(left, cap)

    def expired(self) -> bool:
        return self.remaining() <= 0.0
