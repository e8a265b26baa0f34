"""What trainers ask of the supervisor: where to start, which shards to use after a failed
step, the every-trainer-died fallback, saves, and the end of the run. Each answer is a typed
record; each wait has a deadline shorter than the caller's (``core.deadlines``). Reading
checkpoint files (a dense state, a chain's verification) happens outside the books' lock.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable

import ray

from actors.supervisor.checkpoints import CheckpointCoordinator
from actors.supervisor.controller import RecoveryController
from actors.supervisor.facts import Survey, decide_replacement
from actors.supervisor.machine import TERMINAL, DenseRefused, RollingBack, Running, TrainersAllDied, TrainersCause
from actors.supervisor.trainers import TrainerBook
from core.checkpoint import DataPosition
from core.deadlines import Deadline, Deadlines
from core.errors import CheckpointCorrupt, CheckpointNotFound, ShardUnavailable, TrainerConflict
from core.records import (
    CheckpointFallback, FinalView, FleetView, ResumePoint, Rollback, RunStatus, SaveRequest, SaveResult, TrainerSetup,
)
from policies import Budget, FailurePolicy

__all__ = ["TrainerDesk"]

logger = logging.getLogger(__name__)

_PROBE_ERRORS = (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError)
_REFUSED = object()  # a dense state that cannot be read (``TrainerDesk._dense``)


class TrainerDesk:
    def __init__(
        self,
        lock: threading.RLock,
        controller: RecoveryController,
        checkpoints: CheckpointCoordinator,
        trainers: TrainerBook,
        events,
        policy: FailurePolicy,
        deadlines: Deadlines,
        setup: TrainerSetup,
        position: Callable[[int], DataPosition],
        final_checkpoint: bool,
        run_id: str,
        first_mirrors: Callable[[float], bool] = lambda timeout_s: True,
        survey: Callable[[], Survey] = lambda: Survey({}, {}, {}),
    ):
        self._survey = survey  # the live trainers' answers (actors.supervisor.survey, trainers only)
        self._run_id = run_id
        self._lock = lock
        self._c = controller
        self._ckpt = checkpoints
        self._trainers = trainers
        self._events = events
        self._policy = policy
        self._deadlines = deadlines
        self._setup = setup  # the run's constant part of every trainer's setup
        self._position = position
        self._final_checkpoint = final_checkpoint
        self._fallback_lock = threading.Lock()
        self._first_mirrors = first_mirrors

    # ------------------------------------------------------------------ start

    def trainer_setup(self, rank: int) -> TrainerSetup:
        """Shard handles, the step to start from with its dense state, and when the next
        checkpoint is due. The driver starts Ray Train while the shards start: this waits for them."""
        wait_s = self._deadlines.inner_s("trainer_setup")
        started, error = self._c.wait_started(wait_s)
        if not started:
            raise ShardUnavailable(f"the embedding shards did not start within {wait_s:.0f}s")
        if error:
            return TrainerSetup(finished=True)  # the driver raises the error from start()
        if not self._trainers.has_started():  # recovery: replica: every step on a mirror from the first
            self._first_mirrors(wait_s / 2)
        start, dense = self._start(rank)
        generation, shards = self._c.fleet()
        with self._lock:
            return TrainerSetup(
                finished=isinstance(self._c.state_now(), TERMINAL), shards=shards, generation=generation,
                resume=ResumePoint(start, dense) if start is not None else None,
                training_started=self._trainers.has_started(), next_checkpoint_step=self._ckpt.next_due(),
                **{k: getattr(self._setup, k) for k in ("plan", "schedule", "train_cache", "eval_cache",
                                                         "audit_dir")},
            )

    def _start(self, rank: int) -> tuple[int | None, bytes | None]:
        """The start step and its dense state. A dense file damaged since it was verified is
        refused (marked corrupt, an event) and the trainer starts from the checkpoint before."""
        for _ in range(3):
            start = self._start_step(rank)
            if start is None:
                return None, None
            dense = self._dense(start)
            if dense is not _REFUSED:
                return start, dense
            self._c.wait_settled(self._deadlines.supervisor_wait_s)  # a rollback to it goes further back first
        raise ShardUnavailable(f"no checkpoint with a readable dense state for trainer {rank} to start from")

    def _dense(self, step: int, roll_back: bool = False):
        """The dense state of checkpoint ``step`` (None at step 0), or ``_REFUSED`` when its file
        cannot be read: the checkpoint is marked corrupt and, with ``roll_back`` (the shards are
        at that step already), everything goes further back (``DenseRefused``)."""
        try:
            return self._ckpt.read_dense(step)
        except (CheckpointCorrupt, CheckpointNotFound) as err:
            # A checkpoint removed since it was chosen (retention) is chosen again, not marked corrupt.
            reason, removed = str(err)[:300], isinstance(err, CheckpointNotFound)
            logger.warning("the dense state of checkpoint %d cannot be read: %s", step, reason)
            self._ckpt.refuse((CheckpointFallback(step, reason, removed),))
            self._events.record("checkpoint_fallback", step=step, reason=reason, file="dense", removed=removed)
            if roll_back:
                chain = self._ckpt.full_upto(step - 1)
                self._ckpt.targets.protect(f"dense of {step} refused", chain)  # until the rollback keeps it
                try:
                    self._c.transition(DenseRefused(step, chain[-1] if chain else 0, tuple(chain), reason))
                finally:
                    self._ckpt.targets.release(f"dense of {step} refused")
            return _REFUSED

    def _start_step(self, rank: int) -> int | None:
        """A replacement starts at the newest full checkpoint (or the step a rollback in flight
        goes to), kept from retention until it decides; the first trainers at the resume step."""
        with self._lock:
            state, started = self._c.state_now(), self._trainers.has_started()
            if not started:
                return self._c.resume_point()
            if isinstance(state, RollingBack):
                self._pin(rank, state.step)  # newer checkpoints are being fenced right now
                return state.step
        start = 0
        for _ in range(3):
            chain = self._ckpt.consistent_chain()  # verified outside the lock (once per step)
            start = chain[-1] if chain else 0
            self._pin(rank, start)
            if start == 0 or self._ckpt.full_checkpoint_of(start):
                return start  # pinned while it still existed: retention keeps it now
        return start

    def _pin(self, rank: int, step: int) -> None:
        """Kept from retention from now on, by a gc already deciding too (the store's keep_changing)."""
        store = self._ckpt.store
        with store.keep_changing() if store is not None else contextlib.nullcontext():
            self._trainers.pin(rank, step)

    def position(self, step: int) -> DataPosition:
        """Where the data stands after ``step`` committed steps (saved with each checkpoint)."""
        return self._position(step)

    def status(self) -> RunStatus:
        """Polled by trainers every step without blocking: stop, or when to save next."""
        with self._lock:
            state = self._c.state_now()
            return RunStatus(isinstance(state, TERMINAL), state.name, self._ckpt.next_due())

    # ------------------------------------------------------------------ failed steps

    def await_shards(self, known_generation: int, step: int) -> FleetView:
        """Called by a trainer after its step ``step`` failed. Returns the current shards,
        their generation and, after a full recovery, the step to roll back to with its dense
        state; ``stop`` once the run is over.

        It does not answer "nothing changed" while a shard is dead but not yet recovered: a
        trainer whose own calls succeeded could otherwise redo the step with stale state
        while the others roll back. So on an unchanged generation it probes the shards.
        """
        deadline = Deadline(self._deadlines.inner_s("await_shards"))
        while not deadline.expired():
            self._c.wait_settled(deadline.remaining())
            with self._lock:
                state, (generation, shards) = self._c.state_now(), self._c.fleet()
                view = FleetView(generation, shards, None, isinstance(state, TERMINAL), self._ckpt.next_due())
                rollback = self._c.rollback_after(known_generation)
            if view.stop:
                return view
            if isinstance(state, Running) and generation > known_generation:
                if rollback is not None:
                    dense = self._dense(rollback.step, roll_back=True)
                    if dense is _REFUSED:
                        continue  # everything goes further back: wait for that rollback
                    view = FleetView(generation, shards, Rollback(rollback.generation, rollback.step, dense), False,
                                     view.next_checkpoint)
                # A trainer that lagged (stalled, or slow to notice) may report an older step than
                # the one the others redo from: the work redone on the new fleet starts no earlier
                # than the step after the last committed one.
                last = self._trainers.last_step_committed()
                self._c.settle(known_generation, step if last is None else max(step, last + 1))
                return self._with_commits(view)
            if not isinstance(state, Running):
                continue
            try:
                ray.get([s.state.remote() for s in shards], timeout=deadline.remaining(self._deadlines.shard_call_s))
                return self._with_commits(view)
            except _PROBE_ERRORS:
                self._c.wait_generation_after(generation, deadline.remaining())
        raise ShardUnavailable(f"shards not recovered within {deadline.total_s:.0f}s "
                               "(4 x embeddings.call_timeout_s)")

    def _with_commits(self, view: FleetView) -> FleetView:
        """The view with the steps the run holds committed (the step ledger's, else the commit
        reports'): a trainer whose dense model holds other than these stalled while the others
        trained on, or was healed past a rollback (``Trainer.commit`` rejoins it)."""
        return dataclasses.replace(view, committed_steps=self._trainers.timeline_steps())

    def fallback_to_checkpoint(self, step: int, rank: int) -> FleetView:
        """Every trainer died and the new ones start at checkpoint ``step``: roll the shards
        back to it too (the one rollback path), so dense and embedding state agree.
        Idempotent (several trainers call it). Raises ``TrainerConflict`` when a live trainer
        is ahead of ``step`` (a quorum of replacements only); rolls nothing back when the live
        trainers are at ``step`` (``machine.replacement_at_checkpoint``)."""
        deadline = Deadline(self._deadlines.inner_s("fallback_to_checkpoint"))
        caught_up = self._final_state()
        if caught_up is not None:
            # The run committed its last step and saved it: the trainers that did may have ended
            # already (rank > 0 does not evaluate), so "nobody alive" says nothing about a death.
            self._trainers.unpin(rank)
            self._events.record("replacement_decided", rank=rank, step=step, action="final",
                                reason=f"every step is committed and checkpoint {caught_up.rollback.step} is "
                                       "the final state: nothing to roll back", answers={})
            return caught_up
        # Replacements can form a torchft quorum of their own before the survivors join it;
        # "nobody ahead in my quorum" then does not mean every trainer died. The live trainers
        # say where they are (one round of questions), not the books.
        survey = self._survey()
        decision = decide_replacement(step, rank, survey.trainers)
        self._events.record("replacement_decided", rank=rank, step=step, action=decision.action, reason=decision.reason,
                            answers={str(r): (None if f is None else [f.steps, f.established])
                                     for r, f in survey.trainers.items() if r != rank})
        if decision.action == "heal":
            raise TrainerConflict(f"{decision.reason}; replacement {rank} must heal from them")
        if decision.action == "join":
            # The live trainers' word that they are at ``step`` is checked against the shards:
            # a trainer that stalled while the others trained on, and healed from this very
            # replacement once they died, says ``step`` too, but the shards applied the steps
            # after it: nobody alive holds their dense state, and everything goes back to ``step``.
            ahead = self._probe_shards(deadline)[0]
            if ahead <= step:
                self._trainers.unpin(rank)
                self._events.record("replacement_joined", rank=rank, step=step, reason=decision.reason)
                generation, shards = self._c.fleet()
                return FleetView(generation, shards)
            self._events.record("replacement_decided", rank=rank, step=step, action="roll back",
                                reason=f"{decision.reason}, but the shards applied {ahead} steps: the live trainers "
                                       f"are behind them; roll back to step {step}", answers={})
        # The checkpoint it loaded stays kept from retention until the rollback to it is done.
        owner = f"fallback of trainer {rank} to step {step}"
        self._ckpt.targets.protect(owner, [step] if step else [])
        self._trainers.unpin(rank)
        try:
            with self._fallback_lock:
                return self._roll_back_to(step, rank, deadline)
        finally:
            self._ckpt.targets.release(owner)

    def _probe_shards(self, deadline: Deadline) -> tuple[int, int, tuple]:
        """The most steps any serving shard applied, with the fleet asked (its generation and
        shards), once no recovery is under way."""
        while True:
            if deadline.expired() or not self._c.wait_settled(deadline.remaining()):
                raise ShardUnavailable(f"shards not back within {deadline.total_s:.0f}s for the fallback")
            generation, shards = self._c.fleet()
            try:
                states = ray.get([s.state.remote() for s in shards], timeout=deadline.remaining(self._deadlines.shard_call_s))
                return max(st.applied_step + 1 for st in states), generation, shards
            except _PROBE_ERRORS:
                self._c.wait_generation_after(generation, deadline.remaining())

    def _roll_back_to(self, step: int, rank: int, deadline: Deadline) -> FleetView:
        ahead, generation, shards = self._probe_shards(deadline)
        if ahead <= step:
            return self._rolled_back_already(step, ahead, generation, shards)
        chain = self._ckpt.chain_upto(step)
        if (chain[-1] if chain else 0) != step:
            # The trainers restarted from checkpoint `step`; the shards cannot go there.
            self._c.fail(f"invariant: every trainer died and restarted from checkpoint step {step}, but the newest "
                         f"valid chain up to it is {list(chain)}: shards and dense state would disagree")
            return FleetView(generation, shards, stop=True)
        self._c.transition(TrainersAllDied(step, chain, TrainersCause(ahead, rank)))
        if not self._c.wait_settled(deadline.remaining()):
            raise ShardUnavailable(f"rollback to step {step} not done within {deadline.total_s:.0f}s")
        with self._lock:
            now_generation, shards = self._c.fleet()
            stop = isinstance(self._c.state_now(), TERMINAL)
            rollback = self._c.rollback_after(generation)
        if rollback is None or stop:
            return FleetView(now_generation, shards, stop=stop)
        # A shard refused a file of checkpoint `step`: the new trainers go further back too.
        dense = self._dense(rollback.step, roll_back=True)
        if dense is _REFUSED:
            raise ShardUnavailable(f"the dense state of checkpoint {rollback.step} cannot be read; rolling back further")
        return FleetView(now_generation, shards, Rollback(rollback.generation, rollback.step, dense))

    def _final_state(self) -> FleetView | None:
        """The live trainers committed every step and the final checkpoint: no quorum is left to
        heal a late replacement, which takes the final state from that checkpoint instead."""
        if self._setup.schedule is None:
            return None
        total, last = self._setup.schedule.total_steps, self._trainers.last_step_committed()
        if last is None or last + 1 < total or not self._ckpt.full_checkpoint_of(total):
            return None
        dense = self._dense(total)
        if dense is _REFUSED:
            return None
        generation, shards = self._c.fleet()
        return FleetView(generation, shards, Rollback(generation, total, dense))

    def _rolled_back_already(self, step: int, ahead: int, generation: int, shards: tuple) -> FleetView:
        """Nothing to roll back: another trainer of this incident did it already, or every
        trainer died right at a checkpoint (still an incident). Shards behind ``step`` were
        taken further back by a refused rollback of this incident: this trainer follows them."""
        rollback = self._c.rollback_after(-1)
        if ahead < step and rollback is not None and rollback.step == ahead:
            dense = self._dense(ahead, roll_back=True)
            if dense is _REFUSED:
                raise ShardUnavailable(f"the dense state of checkpoint {ahead} cannot be read; rolling back further")
            return FleetView(generation, shards, Rollback(rollback.generation, ahead, dense))
        with self._lock:
            if not self._same_fallback(step):
                # One journal write for both (trainers_restarted_at's): a supervisor killed in
                # between would have the event without the books it stands for.
                self._events.append("all_trainers_failed", fallback_step=step, steps_lost=0, fenced=[],
                                    rows_reloaded=0, load_s=0.0)
                self._c.trainers_restarted_at(step)
        return FleetView(generation, shards)

    def _same_fallback(self, step: int) -> bool:
        """Whether the last every-trainer fallback went to ``step`` and nothing was committed
        since: the caller belongs to that incident (read from the journaled events, so it
        holds across a supervisor restart)."""
        last = self._events.last("all_trainers_failed")
        return last is not None and last["fallback_step"] == step and not self._trainers.committed_since(step)

    # ------------------------------------------------------------------ saves and the end

    def save_checkpoint(self, request: SaveRequest) -> SaveResult:
        """Called by the first participating trainer right after it committed ``request.step``
        (and by every trainer when the final checkpoint is missing: only one save happens)."""
        with self._lock:
            if not isinstance(self._c.state_now(), Running):
                return SaveResult(False, request.step + 1)
            _, shards = self._c.fleet()
        return self._ckpt.save(request, list(shards), self._run_id, self._position(request.step))

    def await_final(self, known_generation: int, step: int) -> FinalView:
        """Called by each trainer once the last step committed: waits until the final
        checkpoint's save (if one is in flight) committed or failed, then answers like
        ``await_shards``, and says whether the final full checkpoint of ``step`` exists. A
        shard that died before is seen here (dead, or already recovered); after a full
        recovery the trainers redo the steps; without the final checkpoint they save it again
        (within ``budgets.max_step_redos`` attempts)."""
        self._ckpt.drain(self._deadlines.save_drain_s)
        view = self.await_shards(known_generation, step)
        saved = not self._final_checkpoint or self._ckpt.full_checkpoint_of(step)
        if not saved and not view.stop and view.generation == known_generation:
            attempts = self._ckpt.final_attempts(step)
            over = self._policy.exceeded(Budget.STEP_REDOS, attempts,
                                         f"the final checkpoint of step {step} was not saved after {attempts} attempts")
            if over is not None:
                self._c.fail(over)
                view = FleetView(view.generation, view.shards, None, True, view.next_checkpoint)
            else:
                # No step comes to back off in: the next try waits 0.1 s, doubling, at most a shard
                # call (before, a full disk spent every try and the failed-save budget in a second).
                failed = self._ckpt.failures.failed_in_a_row
                time.sleep(min(0.1 * 2 ** max(failed - 1, 0), self._deadlines.shard_call_s) if failed else 0.0)
        return FinalView(view, saved)
