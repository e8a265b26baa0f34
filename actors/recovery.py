"""The recovery executor: carries out a ``RecoveringShards`` or ``RollingBack`` state.

Every step is idempotent (adopt-or-spawn under the reserved generation, load a chain, fence
newer checkpoints), so the supervisor simply runs the state again after a restart or after
the state grew (another shard died meanwhile). One rollback function serves full recovery,
the every-trainer-died fallback and ``--resume``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import ray

from actors.machine import RecoveringShards, RollingBack

__all__ = ["RecoveryExecutor", "Outcome", "ShardsLost"]


class ShardsLost(Exception):
    """Shards died (or could not be adopted) while a recovery used them; ``shards`` lists them."""

    def __init__(self, shards: list[int]):
        super().__init__(shards)
        self.shards = shards


@dataclass
class Outcome:
    handles: dict = field(default_factory=dict)  # shard -> (actor handle, ready info), replaced ones
    loaded: dict = field(default_factory=dict)  # shard -> load result
    reschedule_s: float = 0.0
    load_s: float = 0.0
    fenced: list = field(default_factory=list)


class RecoveryExecutor:
    def __init__(self, fleet, coordinator, uri: str, timeout_s: float, at_point: Callable[[str], None]):
        self.fleet = fleet
        self.coordinator = coordinator
        self.uri = uri
        self.timeout_s = timeout_s
        self.at_point = at_point

    def run(self, state, committed: list) -> Outcome:
        if isinstance(state, RecoveringShards):
            return self.recover_shards(state)
        if isinstance(state, RollingBack):
            return self.rollback(state, committed)
        raise TypeError(f"nothing to execute in state {state!r}")

    def _respawn(self, targets: dict[int, int], spares: dict[int, str]) -> tuple[dict, float]:
        t0 = time.time()
        handles, lost = self.fleet.adopt_or_spawn(targets, spares) if targets else ({}, [])
        if lost:
            raise ShardsLost(lost)
        return handles, time.time() - t0

    def _load(self, handles: dict, chain: tuple[int, ...], why: str) -> tuple[dict, float]:
        """Loads ``chain`` into every handle (the initial rows without a chain); raises
        ShardsLost naming every shard that died meanwhile. ``why`` goes to the audit log."""
        t0 = time.time()
        refs = {
            k: (h.load_checkpoint.remote(self.uri, list(chain), why) if chain else h.reset_to_init.remote(why))
            for k, h in handles.items()
        }
        ray.wait(list(refs.values()), num_returns=len(refs), timeout=self.timeout_s)
        loaded, lost = {}, []
        for k, ref in refs.items():
            try:
                result = ray.get(ref, timeout=0.01)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                lost.append(k)
                continue
            loaded[k] = result if chain else {"rows": 0, "bytes": 0}
        if lost:
            raise ShardsLost(lost)
        return loaded, time.time() - t0

    def recover_shards(self, state: RecoveringShards) -> Outcome:
        """Partial recovery: only the dead shards are replaced (by warm spares where the state
        names one) and loaded, each from its own files of the chain."""
        handles, reschedule_s = self._respawn(state.targets, state.spares)
        self.at_point("recovery.spawned")
        loaded, load_s = self._load({k: h for k, (h, _) in handles.items()}, state.chain, "recovery")
        self.at_point("recovery.loaded")
        return Outcome(handles, loaded, reschedule_s, load_s)

    def rollback(self, state: RollingBack, committed: list) -> Outcome:
        """Every shard goes back to ``state.step`` (dead ones respawned first), and the
        checkpoints of the abandoned timeline are fenced."""
        handles, reschedule_s = self._respawn(state.targets, state.spares)
        missing = [k for k, h in enumerate(committed) if h is None and k not in handles]
        if missing:
            raise ShardsLost(missing)
        everyone = {k: (handles[k][0] if k in handles else h) for k, h in enumerate(committed)}
        loaded, load_s = self._load(everyone, state.chain, "rollback")
        self.at_point("rollback.loaded")
        fenced = self.coordinator.restart_timeline(state.step, list(state.chain))
        return Outcome(handles, loaded, reschedule_s, load_s, fenced)
