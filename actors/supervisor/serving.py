"""The committed fleet, as the recovery controller keeps it: which actor serves each shard
(handle, identity, generation, name), the generations reserved for new actors, and the first
step whose update each serving actor's rows hold. In memory, journaled with the controller's
section; every change happens inside one of the controller's transitions, under its lock.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from core.records import ShardInfo

__all__ = ["ServingFleet"]


class ServingFleet:
    """Its views take the supervisor's lock (``lock``); its changes are made by the controller,
    which holds it."""

    def __init__(self, num_shards: int, shard_name: Callable[[int, int], str], lock: threading.RLock):
        self.n, self._lock = num_shards, lock
        self.handles: list = [None] * num_shards
        self.infos: list[ShardInfo | None] = [None] * num_shards
        self.gens = [0] * num_shards  # generation of each shard in the live fleet
        self.next_gens = [0] * num_shards  # lowest generation never reserved, per shard
        # The first step whose update each serving actor's rows hold beyond what earlier
        # failures counted as lost: where a later partial recovery's lost samples start. A
        # promoted mirror keeps its primary's (its rows hold the primary's steps); a shard
        # loaded from a checkpoint has none until it applies a step (the trainers' redo step,
        # or its own answer in a recovery's round of questions).
        self.first_steps: list[int | None] = [0] * num_shards
        self.names = [shard_name(k, 0) for k in range(num_shards)]
        self.deaths: list[tuple] = []  # (node id, actor, detected at) of each shard death

    # ------------------------------------------------------------------ changes (under the controller's lock)

    def reserve(self, targets: dict[int, int]) -> None:
        for k, g in targets.items():
            self.next_gens[k] = max(self.next_gens[k], g + 1)

    def serve(self, k: int, generation: int, handle, info: ShardInfo, name: str, promoted: bool) -> None:
        """Shard ``k`` is served by a new actor: a promoted mirror keeps the first step of the
        actor it replaces; any other starts with none (known at its first applied step)."""
        self.handles[k], self.infos[k], self.gens[k], self.names[k] = handle, info, generation, name
        if not promoted:
            self.first_steps[k] = None

    # ------------------------------------------------------------------ views

    def targets(self) -> dict[int, tuple[int | None, str | None]]:
        """Shard -> (pid, node id) of the actor serving it (None while it is being replaced)."""
        with self._lock:
            return {k: (i.pid, i.node_id) if i is not None else (None, None) for k, i in enumerate(self.infos)}

    def shard_nodes(self, exclude=()) -> list:
        with self._lock:
            return [i.node_id if i else None for k, i in enumerate(self.infos) if k not in exclude]

    def shards_on(self, node_id: str, since: float) -> list[str]:
        """The shards a lost node held: still placed there, or whose death there was seen since ``since``."""
        with self._lock:
            return sorted({f"shard:{k}" for k, i in enumerate(self.infos) if i is not None and i.node_id == node_id}
                          | {a for n, a, t in self.deaths if n == node_id and t >= since})

    def serving(self, skip=()) -> dict[int, object]:
        """Shard -> the handle of the actor serving it, but those in ``skip``."""
        with self._lock:
            return {k: h for k, h in enumerate(self.handles) if h is not None and k not in skip}

    def primary(self, k: int) -> tuple[object, ShardInfo | None]:
        """Shard ``k``'s serving actor and its identity, (None, None) while it is being replaced."""
        with self._lock:
            return self.handles[k], self.infos[k]

    def infos_now(self) -> tuple[ShardInfo, ...]:
        """The serving shards' identities (those not being replaced)."""
        with self._lock:
            return tuple(i for i in self.infos if i is not None)

    # ------------------------------------------------------------------ journal

    def doc(self) -> dict:
        return {"gens": self.gens, "next_gens": self.next_gens, "live_since": self.first_steps, "names": self.names}

    def continue_from(self, doc: dict, shard_name: Callable[[int, int], str]) -> None:
        """``--resume``: the first fleet of a new attempt takes the generations after the last
        attempt's, so that no generation of a shard (its audit log, its actor's name) is used twice
        in a run directory. A resume on more shards than the last attempt's starts the new
        shards at generation 0; one on fewer keeps the counters of those it leaves out (beyond
        ``n``), so that a later resume on more shards again does not reuse their generations."""
        last = list(doc["next_gens"])
        self.gens = [last[k] if k < len(last) else 0 for k in range(self.n)]
        self.next_gens = self.gens + last[self.n:]
        self.names = [shard_name(k, g) for k, g in enumerate(self.gens)]

    def load(self, doc: dict) -> None:
        self.gens, self.next_gens = list(doc["gens"]), list(doc["next_gens"])
        self.first_steps, self.names = list(doc["live_since"]), list(doc["names"])
