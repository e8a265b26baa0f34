"""The recovery controller: owns the recovery state, the committed fleet of shard actors
(``serving.py``) and the generations reserved for new ones. Events go in through
``transition(event)``: it decides (``machine.transition``), every part computes its side of
the change in memory, the journal is written once, and only then do the effects run (the
executor thread woken, new actors watched, dropped mirrors killed). A shard's death is
decided from what the survivors confirm in one round of questions (``survey.py``,
``facts.py``), not from the books alone. No Ray here: the fleet, the executor, the survey and
the journal are collaborators it is given (fakes in tests).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from functools import partial

from actors.supervisor.events import EventLog
from actors.supervisor.collaborators import Collaborators
from actors.supervisor.deaths import ShardDeaths
from actors.supervisor.machine import (
    FULL_RECOVERY, RECOVERING, RESUME, TERMINAL, Fail, Failed, RecoveringShards, RespawnRetry,
    RollingBack, Running, ShardDied, State, WorkDone, state_from_dict, state_to_dict, transition,
)
from actors.supervisor.outcome import Outcome, failure_records, rollback_events
from actors.supervisor.recovery_loop import RecoveryLoop
from actors.supervisor.serving import ServingFleet
from core.codec import decode, encode
from core.records import Rollback, ShardInfo

__all__ = ["RecoveryController"]

logger = logging.getLogger(__name__)

Effect = Callable[[], None]
_IN_FLIGHT = "the recovery in flight"  # the owner of the chain of the state being carried out


class RecoveryController:
    def __init__(self, run_id: str, shard_name: Callable[[int, int], str], num_shards: int,
                 lock: threading.RLock, events: EventLog, persist: Callable[[], None], parts: Collaborators,
                 clock: Callable[[], float] = time.time):
        self.run_id, self._shard_name, self.n, self._lock = run_id, shard_name, num_shards, lock
        self.changed = threading.Condition(lock)
        self._events, self._persist, self._p, self._clock = events, persist, parts, clock
        self.state: State = Running()
        self._next: State | None = None  # a decided state being persisted (the journal shows it first)
        self.served = ServingFleet(num_shards, shard_name, lock)
        self.generation = 0  # bumped whenever the fleet or the timeline changes
        self.rollback: Rollback | None = None  # the last full recovery's rollback (without its dense state)
        self.resume_step: int | None = None
        self.started, self.start_error = False, None
        self._deaths = ShardDeaths(self, parts, events)
        self.loop = RecoveryLoop(self, parts, events)  # the executor thread's passes
        self._protected: set[str] = set()  # owners of the restore targets kept from retention until done
        self._work, self._stop = threading.Event(), threading.Event()

    # ------------------------------------------------------------------ transitions

    def transition(self, event, corrections: Effect | None = None, outcome: Outcome | None = None) -> bool:
        """The only place the state changes: decide; every part computes its side in memory
        (``corrections``: what a recovery's round of questions corrected in the books); the
        journal is written once; then the effects run. A part never writes the journal inside
        another's transition, so a supervisor killed at any point finds the whole change or none."""
        with self._lock:
            pending = len(self.state.targets) if isinstance(self.state, RECOVERING) else 0
            t = transition(self.state, event, self._p.ledger.count_this_attempt() + pending, self._p.policy)
            if t is None:
                return False
            previous, effects = self.state, []
            if corrections is not None:
                corrections()
            self.served.reserve(getattr(t.state, "targets", {}))  # names reserved before any spawn
            self._p.spares.take(getattr(t.state, "spares", {}).values())
            self._p.mirrors.take(getattr(t.state, "spares", {}).values())
            if isinstance(event, WorkDone):
                effects = self._commit_outcome(previous, outcome)
            self._events.append("state_changed", previous=previous.name, state=t.state.name, reason=t.reason)
            self._next = t.state
            try:
                self._persist()
            finally:
                self._next = None
            self.state = t.state
            if isinstance(t.state, RECOVERING) and t.state.chain:
                self._p.protect(_IN_FLIGHT, t.state.chain)  # whichever part chose it, until it is done
                self._protected.add(_IN_FLIGHT)
            self.changed.notify_all()
        logger.warning("supervisor: %s -> %s: %s", previous.name, t.state.name, t.reason)
        for effect in effects:
            effect()
        if isinstance(t.state, TERMINAL):
            self._release_restore_targets()
        self._work.set()
        return True

    def fail(self, reason: str) -> None:
        """Ends the run as Failed; if even that cannot be journaled, in memory all the same."""
        try:
            self.transition(Fail(reason))
        except Exception:  # noqa: BLE001 - the run stops either way; say so, then force it
            logger.exception("could not journal the failure %r; failing the run in memory", reason)
            with self._lock:
                if not isinstance(self.state, TERMINAL):
                    self.state = Failed(reason)
                    self.changed.notify_all()

    def stop(self) -> None:
        self._stop.set()
        self._work.set()

    # ------------------------------------------------------------------ deaths

    def on_shard_death(self, k: int, generation: int, cause: str, detected: float, exited: bool = False) -> None:
        """A watched shard actor is gone: ``deaths.ShardDeaths`` asks the survivors and decides."""
        self._deaths.on_death(k, generation, cause, detected, exited)

    def keep_restore_targets(self, owner: str) -> None:
        """``owner``'s chains stay kept from retention until this recovery is done."""
        with self._lock:
            self._protected.add(owner)

    def is_current(self, k: int, generation: int) -> bool:
        """Whether a death of shard ``k`` generation ``generation`` is news (caller holds the lock)."""
        if isinstance(self.state, TERMINAL) or generation != self.served.gens[k]:
            return False
        return not (isinstance(self.state, RECOVERING) and k in self.state.targets)

    # ------------------------------------------------------------------ the executor's side

    def in_flight(self) -> tuple[State, list]:
        """The state to carry out and the committed fleet's handles."""
        with self._lock:
            return self.state, list(self.served.handles)

    def work_done(self, state: State, outcome: Outcome) -> bool:
        """The executor finished ``state``: its outcome becomes the fleet (one transition; its
        effects, some of them remote calls, run after it with no lock held)."""
        return self.transition(WorkDone(state), outcome=outcome)

    def respawn_retry(self, k: int) -> None:
        with self._lock:
            self.transition(RespawnRetry(k, self.served.next_gens[k]))

    def lost_during_recovery(self, k: int) -> None:
        self.on_shard_death(k, self.served.gens[k], "died during a recovery", self._clock())

    def wait_for_work(self, timeout_s: float) -> None:
        self._work.wait(timeout_s)
        self._work.clear()

    def stopped(self) -> bool:
        return self._stop.is_set()

    # ------------------------------------------------------------------ committing an outcome

    def _commit_outcome(self, done: RecoveringShards | RollingBack, out: Outcome) -> list[Effect]:
        """Makes what the executor did for ``done`` the live fleet, with its failure records and
        events, in memory (inside the transition that journals them); returns the effects that
        run once the journal is written."""
        now, effects = self._clock(), []
        earlier = self._p.ledger.count()
        promoted = {k for k in getattr(done, "mirrors", ()) if k in out.handles}
        for k, (handle, info) in out.handles.items():
            g = done.targets[k]
            self.served.serve(k, g, handle, info, done.spares.get(k) or self._shard_name(k, g), k in promoted)
            effects.append(partial(self._p.fleet.watch, k, g, handle))
        for k, result in out.loaded.items():
            for fb in result.fallbacks:
                self._events.append("checkpoint_fallback", event_time=now, shard=k, step=fb.step, reason=fb.reason)
            if result.initial_rows_reason is not None:  # a shard restored to its initial rows says why
                self._events.append("shard_initial_rows", event_time=now, shard=k, reason=result.initial_rows_reason)
        self.generation += 1
        if out.handles:
            self._p.observe.observe_reschedule(out.reschedule_s)
        if out.loaded:
            self._p.observe.observe_load(out.load_s)
        dropped = self._p.mirrors.drop(range(self.n) if isinstance(done, RollingBack) else out.handles,
                                       {done.spares[k] for k in promoted})
        effects.append(partial(self._p.mirrors.kill_dropped, dropped))
        records = failure_records(done, out, self.generation, now, getattr(self._p.fleet, "plan", None))
        self._p.ledger.add(records)
        for f in records:
            self._events.append("shard_recovered", event_time=now, **encode(f))
        if done.spares:
            effects.append(self._p.spares.wake)  # a new spare starts in the background for each one used
        if isinstance(done, RollingBack):
            effects += self._commit_rollback(done, out, earlier, now)
        effects.append(self._release_restore_targets)
        return effects

    def _commit_rollback(self, done: RollingBack, out: Outcome, earlier: int, now: float) -> list[Effect]:
        recount = self._p.ledger.reopen_after_rollback(done.step, earlier)
        if done.why != FULL_RECOVERY:
            # Shards that died in a fallback or a resume: the new trainers start at the
            # rollback step through trainer_setup (no await_shards to settle them); the work
            # redone is the fallback's own (all_trainers_failed.steps_lost).
            self._p.ledger.close_from(earlier, done.step)
        self.served.first_steps = [done.step] * self.n
        self._p.prune_commits(done.step, self.generation)
        dense_follows = done.why == FULL_RECOVERY or done.refused_from is not None
        self.rollback = Rollback(self.generation, done.step) if dense_follows else None
        if done.why == RESUME:
            self.resume_step = done.step
        for kind, fields in rollback_events(done, out):
            self._events.append(kind, event_time=now, **fields)
        return [partial(self._p.ledger.count_later, recount)]

    def _release_restore_targets(self) -> None:
        """The recovery is done (or the run is over): its chains may be retired again."""
        with self._lock:
            owners, self._protected = self._protected, set()
        for owner in owners:
            self._p.release(owner)

    # ------------------------------------------------------------------ views

    def trainers_restarted_at(self, step: int) -> None:
        """Every trainer restarts at checkpoint ``step``, where the shards stand already (recovered
        there): steps from ``step`` are redone, so a partial recovery loses only updates before it."""
        with self._lock:
            recount = self._p.ledger.reopen_after_rollback(step, self._p.ledger.count())
            self.served.first_steps = [step if x is None else min(x, step) for x in self.served.first_steps]
            # Commits from ``step`` on died with their trainers (the shards never applied them):
            # left in the book, they would make every trainer that fails a step below them look
            # left behind (``Trainer.rejoin``), a needless fallback.
            self._p.prune_commits(step, self.generation)
            self._persist()
        self._p.ledger.count_later(recount)

    def settle(self, known_generation: int, redo_step: int, upto_generation: float = float("inf")) -> None:
        """Trainers redo ``redo_step`` on a newer fleet (they say so): the failures recovered since
        are closed there, and every replaced shard's first step is that one (a promoted mirror's
        was kept), journaled in one piece; lost samples are counted afterwards, outside the lock."""
        with self._lock:
            shards, todo = self._p.ledger.close_settled(known_generation, redo_step, upto_generation)
            for k in shards:
                if self.served.first_steps[k] is None:
                    self.served.first_steps[k] = redo_step
            if todo or shards:
                self._persist()
        self._p.ledger.count_later(todo)

    def handle_if_current(self, k: int, generation: int):
        """Shard ``k``'s actor, if training runs normally on fleet ``generation`` (a report about
        an older fleet, or during a recovery, must not kill a newer actor)."""
        with self._lock:
            if generation != self.generation or not isinstance(self.state, Running):
                return None
            return self.served.handles[k]

    def wait_settled(self, timeout_s: float) -> bool:
        """Waits until no recovery is in flight; False if ``timeout_s`` passed first."""
        with self.changed:
            return self.changed.wait_for(lambda: not isinstance(self.state, RECOVERING), timeout=timeout_s)

    def wait_generation_after(self, generation: int, timeout_s: float) -> None:
        with self.changed:
            self.changed.wait_for(lambda: self.generation > generation, timeout=timeout_s)

    def wait_started(self, timeout_s: float) -> tuple[bool, str | None]:
        """Waits until the first fleet answers or failed to start: (it did either, the start error)."""
        with self.changed:
            done = self.changed.wait_for(lambda: self.started or self.start_error, timeout_s)
            return bool(done), self.start_error

    def has_started(self) -> bool:
        return self.started  # the first fleet answered (a restarted supervisor looks for its shards then)

    def resume_point(self) -> int | None:
        return self.resume_step  # one attribute: read whole

    def state_now(self) -> State:
        with self._lock:
            return self.state

    def rollback_after(self, known_generation: int) -> Rollback | None:
        """The last full recovery's rollback, if it came after fleet ``known_generation``."""
        with self._lock:
            rb = self.rollback
            return rb if rb is not None and rb.generation > known_generation else None

    def fleet(self) -> tuple[int, tuple]:
        with self._lock:
            return self.generation, tuple(self.served.handles)

    def assigned_spares(self) -> list[str]:
        with self._lock:
            return list(getattr(self.state, "spares", {}).values())

    def continue_from(self, doc: dict) -> None:
        """``--resume``: the fleet's generations and every shard's go on from the last attempt's
        (``doc``, its journaled section), so that a try (generation, step, attempt) and a shard's
        generation name one thing in the whole run directory."""
        with self._lock:
            self.served.continue_from(doc, self._shard_name)
            self.generation = int(doc["generation"]) + 1

    def first_fleet(self) -> list[int]:
        """The generation of each shard's first actor: 0, or after the last attempt's."""
        with self._lock:
            return list(self.served.gens)

    def commit_start(self, handles: list, infos: list[ShardInfo]) -> None:
        """The first fleet answers."""
        with self._lock:
            self.served.handles, self.served.infos, self.started = list(handles), list(infos), True
            self._persist()
            self.changed.notify_all()

    def start_failed(self, error: str) -> None:
        with self._lock:
            self.start_error = error
            self.changed.notify_all()

    def reserve_first_fleet(self) -> None:
        """The first generation of every shard is reserved in the journal before it is spawned."""
        with self._lock:
            self.served.reserve(dict(enumerate(self.served.gens)))
            self._persist()

    # ------------------------------------------------------------------ journal

    def doc(self) -> dict:
        state = self._next if self._next is not None else self.state
        return {
            "state": state_to_dict(state), **self.served.doc(), "generation": self.generation,
            "rollback": encode(self.rollback), "resume_step": self.resume_step, "started": self.started,
        }

    def load(self, doc: dict) -> None:
        """The journaled state; a recovery in flight keeps its chain from retention again."""
        self.state = state_from_dict(doc["state"])
        self.served.load(doc)
        self.generation, self.started = doc["generation"], doc["started"]
        self.rollback, self.resume_step = decode(Rollback, doc["rollback"]), doc["resume_step"]
        if isinstance(self.state, RECOVERING) and self.state.chain:
            self._p.protect(_IN_FLIGHT, self.state.chain)
            self._protected.add(_IN_FLIGHT)

    def reacquire(self, probe: Callable[[str], tuple[object, ShardInfo] | None]) -> list[int]:
        """After a supervisor restart: the journaled actor of each shard, found by name and
        watched again where it answers (``probe(name)``). Returns the shards not found."""
        missing = []
        for k in range(self.n):
            found = probe(self.served.names[k]) if self.started else None
            if found is None:
                missing.append(k)
                continue
            with self._lock:
                self.served.handles[k], self.served.infos[k] = found
            self._p.fleet.watch(k, self.served.gens[k], found[0])
        return missing

    def recover_missing(self, missing: list[int]) -> None:
        """Shards whose actor a restarted supervisor did not find die now, in the books."""
        for k in missing if self.started else ():
            self.on_shard_death(k, self.served.gens[k], "not found after supervisor restart", self._clock())

    def wake(self) -> None:
        self._work.set()

    def start_executor(self) -> None:
        self._p.start_thread("recovery-executor", self.loop.run)
