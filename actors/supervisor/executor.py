"""The recovery executor: carries out a ``RecoveringShards`` or ``RollingBack`` state.

Every step is idempotent (adopt-or-spawn under the reserved generation, load a chain, fence
newer checkpoints), so the controller simply runs the state again after a restart or after
the state grew (another shard died meanwhile). One rollback function serves full recovery,
the every-trainer-died fallback and ``--resume``. It knows nothing of fault injection: it
calls the run's hooks at named points.
"""

from __future__ import annotations

import time
from collections.abc import Callable
import ray

from actors.fleet import ShardFleet
from actors.supervisor.hooks import RunHooks
from actors.supervisor.machine import RecoveringShards, RollingBack
from actors.supervisor.outcome import ChainMismatch, Outcome, ShardsLost
from core.errors import CheckpointCorrupt, CheckpointNotFound
from core.records import CheckpointFallback, LoadResult

__all__ = ["RecoveryExecutor", "Outcome", "ShardsLost", "ChainMismatch"]


class RecoveryExecutor:
    def __init__(self, fleet: ShardFleet, restart_timeline: Callable[[int, list[int]], list[int]], uri: str,
                 timeout_s: float, hooks: RunHooks, wait=ray.wait, get=ray.get,
                 committed: Callable[[], int | None] = lambda: None,
                 read_dense: Callable[[int], object] = lambda step: None):
        self.read_dense = read_dense  # the dense state of a checkpoint (raises if it cannot be read)
        self._wait, self._get = wait, get  # Ray's, or a test's
        self.fleet = fleet
        self.restart_timeline = restart_timeline
        self.uri = uri
        self.timeout_s = timeout_s
        self.hooks = hooks
        self.committed = committed  # steps the trainers committed: a mirror lacking one is refused

    def run(self, state, committed: list) -> Outcome:
        if isinstance(state, RecoveringShards):
            return self.recover_shards(state)
        if isinstance(state, RollingBack):
            return self.rollback(state, committed)
        raise TypeError(f"nothing to execute in state {state!r}")

    def _respawn(self, targets: dict[int, int], spares: dict[int, str], causes: tuple,
                 committed: int | None = None) -> tuple[dict, float]:
        """The new actors of ``targets``; their predecessors' leases are waited out unless Ray
        saw every one of their processes exit (``causes``). A mirror promoted among them must
        hold ``committed`` steps (what the survivors confirmed; the books' count otherwise)."""
        t0 = time.time()
        exited = {c.shard for c in causes if c.exited}
        handles, lost = ({}, [])
        if targets:
            known = [c for c in (committed, self.committed()) if c is not None]
            handles, lost = self.fleet.adopt_or_spawn(targets, spares, predecessors_exited=set(targets) <= exited,
                                                      committed=max(known) if known else None)
        if lost:
            raise ShardsLost(lost)
        return handles, time.time() - t0

    def _load(self, handles: dict, chain: tuple[int, ...], why: str) -> tuple[dict[int, LoadResult], float]:
        """Loads ``chain`` into every handle. A shard that
        died or did not answer within the call timeout is killed (a slow call counts as a
        death, and a slow actor must not live on beside its replacement), and ShardsLost
        names every such shard. ``why`` goes to the audit log."""
        t0 = time.time()
        # An empty chain too: the shard itself says whether no checkpoint exists yet (its initial
        # rows, saying so) or a partial recovery finds a newer chain of its own files.
        refs = {k: h.load_checkpoint.remote(self.uri, list(chain), why) for k, h in handles.items()}
        self._wait(list(refs.values()), num_returns=len(refs), timeout=self.timeout_s)
        loaded, lost = {}, []
        for k, ref in refs.items():
            try:
                loaded[k] = self._get(ref, timeout=0.01)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                self.fleet.kill(handles[k])
                lost.append(k)
        if lost:
            raise ShardsLost(lost)
        return loaded, time.time() - t0

    def recover_shards(self, state: RecoveringShards) -> Outcome:
        """Partial recovery: only the dead shards are replaced (by warm spares where the state
        names one) and loaded, each from its own files of the chain (a shard may fall back
        past a corrupt file of its own: its failure record says which chain it used). A
        shard's mirror (``state.mirrors``) is promoted instead, with its rows: nothing is loaded."""
        handles, reschedule_s = self._respawn(state.targets, state.spares, state.causes, state.committed_steps)
        self.hooks.at_point("recovery.spawned")
        loading = {k: h for k, (h, _) in handles.items() if k not in state.mirrors}
        loaded, load_s = self._load(loading, state.chain, "recovery") if loading else ({}, 0.0)
        self.hooks.at_point("recovery.loaded")
        return Outcome(handles, loaded, reschedule_s, load_s)

    def _dense_readable(self, state: RollingBack) -> None:
        """The dense model follows a rollback: its state at the step must be readable before the
        rollback commits, or the checkpoint is refused like a shard's corrupt file."""
        if state.step == 0:
            return
        try:
            self.read_dense(state.step)
        except (CheckpointCorrupt, CheckpointNotFound) as err:
            raise ChainMismatch(f"rollback to step {state.step}: its dense state cannot be read ({err})",
                                (CheckpointFallback(state.step, f"dense state: {err}"[:300]),)) from None

    def rollback(self, state: RollingBack, committed: list) -> Outcome:
        """Every shard goes back to ``state.step`` (dead ones respawned first), exactly on
        ``state.chain``, and the checkpoints of the abandoned timeline are fenced."""
        ends_at = state.chain[-1] if state.chain else 0
        if ends_at != state.step:
            raise ChainMismatch(
                f"rollback to step {state.step} ({state.why}) has chain {list(state.chain)}, which ends at step "
                f"{ends_at}: the shards and the dense model would be at different steps"
            )
        handles, reschedule_s = self._respawn(state.targets, state.spares, state.causes)
        missing = [k for k, h in enumerate(committed) if h is None and k not in handles]
        if missing:
            raise ShardsLost(missing)
        self.hooks.at_point("rollback.spawned")
        everyone = {k: (handles[k][0] if k in handles else h) for k, h in enumerate(committed)}
        loaded, load_s = self._load(everyone, state.chain, "rollback")
        other = {k: list(r.chain) for k, r in loaded.items() if tuple(r.chain) != tuple(state.chain)}
        if other:
            fallbacks = tuple(fb for r in loaded.values() for fb in r.fallbacks)
            reasons = "; ".join(f"{fb.step}: {fb.reason}" for fb in fallbacks)
            raise ChainMismatch(
                f"rollback to step {state.step} ({state.why}): shards {sorted(other)} loaded chains "
                f"{list(other.values())} instead of {list(state.chain)} ({reasons or 'no reason given'})", fallbacks,
            )
        self._dense_readable(state)
        self.hooks.at_point("rollback.loaded")
        fenced = self.restart_timeline(state.step, list(state.chain))
        return Outcome(handles, loaded, reschedule_s, load_s, fenced)
