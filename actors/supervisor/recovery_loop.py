"""The recovery executor's thread: carries out each ``RecoveringShards`` or ``RollingBack``
state the controller decided (``executor.py`` does the work) and hands the outcome back as one
transition. What may fail for a while is retried within ``budgets.max_executor_errors``; a
replacement that does not answer is respawned under a new name; a rollback whose chain a shard
refused goes further back."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from actors.supervisor.events import EventLog
from actors.supervisor.machine import RECOVERING, NoChainForShard, RollingBack, State
from actors.supervisor.outcome import ChainMismatch, ShardsLost, refusal
from core.errors import NoValidChain
from core.records import CheckpointFallback
from policies import Budget

__all__ = ["RecoveryLoop"]

logger = logging.getLogger(__name__)


class RecoveryLoop:
    """``controller``: the RecoveryController; ``parts``: its Collaborators."""

    def __init__(self, controller, parts, events: EventLog):
        self._c, self._p, self._events = controller, parts, events

    def run(self) -> None:
        """The executor thread: carries out each recovering state as it comes."""
        attempts = 0
        while not self._c.stopped():
            self._p.hooks.at_point("thread.recovery-executor")
            self._c.wait_for_work(0.5)
            attempts = self.execute_once(attempts)

    def execute_once(self, attempts: int = 0) -> int:
        """One pass: carries out the state in flight, if any, and commits its outcome.
        ``attempts`` counts the failed attempts of this recovery so far
        (``budgets.max_executor_errors``); the new count is returned."""
        state, committed = self._c.in_flight()
        if not isinstance(state, RECOVERING):
            return 0
        try:
            outcome = self._p.executor.run(state, committed)
        except ShardsLost as lost:
            return attempts + self._on_lost(state, lost.shards, attempts)
        except ChainMismatch as err:
            self._refused(state, err)
            return attempts
        except NoValidChain as err:
            self._no_chain(state, err)
            return attempts
        except self._p.retried as err:
            attempts += 1
            self._events.record("recovery_error", state=state.name, error=repr(err)[:300], attempt=attempts)
            logger.warning("recovery attempt %d failed: %r", attempts, err)
            if not self._over_budget(attempts, f"{state.name}: {err!r}"[:300]):
                time.sleep(1.0)
                self._c.wake()
            return attempts
        self._c.work_done(state, outcome)
        return 0

    def _refused(self, state: State, err: ChainMismatch) -> None:
        """A shard refused a corrupt file of the rollback's chain: go further back (``refusal``)."""
        if isinstance(state, RollingBack) and err.fallbacks:
            self._p.refuse(err.fallbacks)
            further = refusal(err, self._p.full_upto)
            if self._transition_keeping(further, further.chain):
                return
        self._c.fail(f"invariant: {err}")

    def _transition_keeping(self, event, chain) -> bool:
        """``event``'s transition, its chain kept from retention from its choice on (the state
        it leads to keeps it from then on)."""
        self._p.protect("a rollback being decided", tuple(chain))
        try:
            return self._c.transition(event)
        finally:
            self._p.release("a rollback being decided")

    def _no_chain(self, state: State, err: NoValidChain) -> None:
        """A shard found no valid chain of its own files (each corrupt, unlisted or removed)
        though checkpoints exist: never its initial rows under a later model. A partial
        recovery becomes a rollback of everything to the newest consistent checkpoint; a
        rollback passes over the checkpoints it refused, like a corrupt file."""
        if isinstance(state, RollingBack):
            fallbacks = tuple(CheckpointFallback(s, r) for s, r in err.tried if s <= state.step)
            self._refused(state, ChainMismatch(str(err), fallbacks))
            return
        self._p.refuse(tuple(CheckpointFallback(s, r) for s, r in err.tried))
        chain = tuple(self._p.consistent_chain())
        if not self._transition_keeping(NoChainForShard(err.shard_id, chain[-1] if chain else 0, chain, str(err)[:300]),
                                        chain):
            self._c.fail(f"invariant: {err}")

    def _on_lost(self, state: State, lost: Sequence[int], attempts: int) -> int:
        """Shards the executor lost: a replacement that did not answer is respawned under a new
        generation (a failed attempt, within budget); a survivor that died is a new death."""
        retries = [k for k in lost if k in state.targets]
        if retries and self._over_budget(attempts + 1, f"shards {retries} did not answer after respawning"):
            return 1
        for k in lost:
            if k in state.targets:
                self._c.respawn_retry(k)
            else:
                self._c.lost_during_recovery(k)
        self._c.wake()
        return 1 if retries else 0

    def _over_budget(self, attempts: int, detail: str) -> bool:
        over = self._p.policy.exceeded(Budget.EXECUTOR_ERRORS, attempts, detail)
        if over is not None:
            self._c.fail(over)
        return over is not None
