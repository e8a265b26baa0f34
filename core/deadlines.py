"""Nested timeouts: every blocking call on a failure path has a deadline, and a caller always
waits longer than the longest wait inside the method it calls.

    shard call                T = embeddings.call_timeout_s
    a recovery                supervisor_wait_s = 4 T (a respawn T, a load T, one retry of each)
    the save in flight        save_drain_s = 2 T (its background write and commit)
    a supervisor method       inner_s(method): what it waits for, at most (the table below)
    its caller                caller_s(method) = inner_s(method) + 2 T (a supervisor that Ray
                              restarts meanwhile answers the retried call once rebuilt)

``SupervisorClient`` (``actors.client``) passes ``caller_s`` to every call; the supervisor's
methods bound their own waits by ``inner_s``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

__all__ = ["Deadlines", "Deadline", "BLOCKING", "STARTING"]

# How many shard-call timeouts (T) each blocking supervisor method may wait, at most. Any
# method not listed answers from memory at once (counted as one T for its caller: the
# supervisor may be busy restarting).
BLOCKING = {
    "start": 1,  # every shard answers ready()
    "restore": 4 + 1,  # a rollback (4 T), after verifying the checkpoint it goes to (1 T)
    "trainer_setup": 4,  # the shards start
    "await_shards": 4,  # a recovery in flight, then a probe of every shard
    "fallback_to_checkpoint": 4 + 1,  # a liveness probe of the trainers (1 T), a rollback (4 T)
    "save_checkpoint": 2 + 1,  # the previous save drains (2 T), every shard snapshots (1 T)
    "await_final": 2 + 4,  # the final save drains (2 T), then as await_shards (4 T)
    "record_eval": 2,  # the final save drains
    "summary": 2 + 1 + 1,  # the last save drains, lost samples are counted (1 T), shards answer (1 T)
    "shutdown": 2,  # the last save drains
}


# Methods that wait for new shard processes to start: at least embeddings.start_timeout_s.
STARTING = frozenset({"start", "trainer_setup"})


@dataclass(frozen=True)
class Deadlines:
    shard_call_s: float
    shard_start_s: float = 0.0  # a new shard process's start (embeddings.start_timeout_s)

    @classmethod
    def of(cls, cfg) -> "Deadlines":
        """The deadlines of a run config."""
        return cls(cfg.embeddings.call_timeout_s, cfg.embeddings.start_timeout_s)

    @property
    def supervisor_wait_s(self) -> float:
        """A recovery (respawn, load, one retry of each) as a waiter sees it."""
        return 4 * self.shard_call_s

    @property
    def survey_s(self) -> float:
        """A recovery's round of questions to the live processes (``actors.supervisor.survey``):
        each answers from memory; one that does not answer in half a shard call is slow, and
        the decision goes on without it."""
        return self.shard_call_s / 2

    @property
    def save_drain_s(self) -> float:
        """The save in flight: its shards' files, the dense state, the manifest."""
        return 2 * self.shard_call_s

    def inner_s(self, method: str) -> float:
        """The longest a supervisor method waits before it answers (0: it answers at once)."""
        inner = BLOCKING.get(method, 0) * self.shard_call_s
        return max(inner, self.shard_start_s) if method in STARTING else inner

    def caller_s(self, method: str) -> float:
        """How long a caller waits for ``method``: longer than anything inside it, with room for
        a supervisor restart (a new process, its journal read, its shards found by name)."""
        return self.inner_s(method) + 2 * self.shard_call_s


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
