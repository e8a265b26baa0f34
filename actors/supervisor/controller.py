"""The recovery controller: owns the recovery state, the committed fleet of shard actors and
the generations reserved for new ones. Events go in through ``transition(event)``: it decides
(``machine.transition``), persists the intent with every part's books, and only then changes
the state and wakes the executor thread, whose outcome comes back as ``WorkDone``. No Ray
here: the fleet, the executor and the journal are collaborators it is given (fakes in tests).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

from actors.supervisor.events import EventLog
from actors.supervisor.collaborators import Collaborators
from actors.supervisor.machine import (
    FULL_RECOVERY, RECOVERING, RESUME, TERMINAL, Fail, Failed, RecoveringShards, RespawnRetry,
    RollingBack, Running, ShardDied, State, WorkDone, state_from_dict, state_to_dict, transition,
)
from actors.supervisor.outcome import ChainMismatch, Outcome, ShardsLost, failure_records, refusal, rollback_events
from core.codec import decode, encode
from core.books import DeathCause
from core.records import Rollback, ShardInfo
from policies import Budget, RecoveryMode

__all__ = ["RecoveryController"]

logger = logging.getLogger(__name__)

class RecoveryController:
    def __init__(self, run_id: str, shard_name: Callable[[int, int], str], num_shards: int,
                 lock: threading.RLock, events: EventLog, persist: Callable[[], None], parts: Collaborators,
                 clock: Callable[[], float] = time.time):
        self.run_id, self._shard_name, self.n, self._lock = run_id, shard_name, num_shards, lock
        self.changed = threading.Condition(lock)
        self._events, self._persist, self._p, self._clock = events, persist, parts, clock
        self.state: State = Running()
        self._next: State | None = None  # a decided state being persisted (the journal shows it first)
        self.handles: list = [None] * num_shards
        self.infos: list[ShardInfo | None] = [None] * num_shards
        self.gens = [0] * num_shards  # generation of each shard in the live fleet
        self.next_gens = [0] * num_shards  # lowest generation never reserved, per shard
        self.live_since: list[int | None] = [0] * num_shards  # first step the live actor of each shard applies
        self.names = [shard_name(k, 0) for k in range(num_shards)]  # the actor serving each shard
        self.generation = 0  # bumped whenever the fleet or the timeline changes
        self.rollback: Rollback | None = None  # the last full recovery's rollback (without its dense state)
        self.resume_step: int | None = None
        self.started, self.start_error = False, None
        self._deaths: list[tuple] = []  # (node id, actor, detected at) of each shard death
        self._deciding: set[tuple[int, int]] = set()  # (shard, generation) of deaths being decided
        self._outcome: Outcome | None = None
        self._work, self._stop = threading.Event(), threading.Event()

    # ------------------------------------------------------------------ transitions

    def transition(self, event) -> bool:
        """The only place the state changes: decide, persist the intent, then act on it."""
        with self._lock:
            pending = len(self.state.targets) if isinstance(self.state, RECOVERING) else 0
            t = transition(self.state, event, self._p.ledger.count_this_attempt() + pending, self._p.policy)
            if t is None:
                return False
            previous = self.state
            self._next = t.state
            try:
                for k, g in getattr(t.state, "targets", {}).items():
                    self.next_gens[k] = max(self.next_gens[k], g + 1)  # reserved before any spawn
                self._p.spares.take(getattr(t.state, "spares", {}).values())
                self._p.mirrors.take(getattr(t.state, "spares", {}).values())
                if isinstance(event, WorkDone):
                    self._commit_outcome(previous)
                self._events.append("state_changed", previous=previous.name, state=t.state.name, reason=t.reason)
                self._persist()
            finally:
                self._next = None
            self.state = t.state
            self.changed.notify_all()
        logger.warning("supervisor: %s -> %s: %s", previous.name, t.state.name, t.reason)
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
        """A watched shard actor is gone: decide its recovery and transition. The chain is read
        (for a rollback, verified once) outside the lock; a second report of the same death
        meanwhile is dropped. Its mirror (replica) takes its place, but not in a rollback."""
        with self._lock:
            if not self._is_current(k, generation) or (k, generation) in self._deciding:
                return
            self._deciding.add((k, generation))
            kill = self._p.ledger.kill_of(f"shard:{k}", before=detected)
            node = self.infos[k].node_id if self.infos[k] is not None else None
            self._deaths.append((node, f"shard:{k}", detected))  # a host's loss names it
            killed_at = kill.time if kill is not None else self._p.host_down_since(node)
            self._p.observe.observe_failure(detected)
            decision = self._p.decide()
            partial = decision.mode in (RecoveryMode.PARTIAL, RecoveryMode.REPLICA)
            death = DeathCause(
                actor=f"shard:{k}", shard=k, generation=generation, cause=cause, detected_at=round(detected, 3),
                killed_at=killed_at, detection_s=round(detected - killed_at, 3) if killed_at is not None else None,
                first_step=self.live_since[k], exited=exited,
            )
        try:
            chain = self._p.partial_chain() if partial else ()
            consistent = () if partial else self._p.consistent_chain()
            with self._lock:
                if self._is_current(k, generation):
                    replica = decision.mode == RecoveryMode.REPLICA and not isinstance(self.state, RollingBack)
                    mirror = self._p.mirrors.candidate(k, self._p.suspects()) if replica else None
                    spare = mirror or self._p.spares.candidate(self._p.suspects())
                    self.transition(ShardDied(k, generation, self.gens[k], self.next_gens[k], death, partial,
                                              decision, tuple(chain), tuple(consistent), spare, mirror is not None))
        finally:
            with self._lock:
                self._deciding.discard((k, generation))

    def _is_current(self, k: int, generation: int) -> bool:
        if isinstance(self.state, TERMINAL) or generation != self.gens[k]:
            return False
        return not (isinstance(self.state, RECOVERING) and k in self.state.targets)

    # ------------------------------------------------------------------ the executor thread

    def run_executor(self) -> None:
        """The executor thread: carries out each recovering state as it comes."""
        attempts = 0
        while not self._stop.is_set():
            self._p.hooks.at_point("thread.recovery-executor")
            self._work.wait(0.5)
            self._work.clear()
            attempts = self.execute_once(attempts)

    def execute_once(self, attempts: int = 0) -> int:
        """One pass: carries out the state in flight, if any, and commits its outcome.
        Retries what may fail for a while; ``attempts`` counts the failed attempts of this
        recovery so far (``budgets.max_executor_errors``), and the new count is returned."""
        with self._lock:
            state, committed = self.state, list(self.handles)
        if not isinstance(state, RECOVERING):
            return 0
        try:
            outcome = self._p.executor.run(state, committed)
        except ShardsLost as lost:
            return attempts + self._on_lost(state, lost.shards, attempts)
        except ChainMismatch as err:
            self._refused(state, err)
            return attempts
        except self._p.retried as err:
            attempts += 1
            self._events.record("recovery_error", state=state.name, error=repr(err)[:300], attempt=attempts)
            logger.warning("recovery attempt %d failed: %r", attempts, err)
            if not self._over_budget(attempts, f"{state.name}: {err!r}"[:300]):
                time.sleep(1.0)
                self._work.set()
            return attempts
        with self._lock:
            self._outcome = outcome
            self.transition(WorkDone(state))
        return 0

    def _refused(self, state: State, err: ChainMismatch) -> None:
        """A shard refused a corrupt file of the rollback's chain: go further back (``refusal``)."""
        if isinstance(state, RollingBack) and err.fallbacks:
            self._p.refuse(err.fallbacks)
            if self.transition(refusal(err, self._p.full_upto)):
                return
        self.fail(f"invariant: {err}")

    def _on_lost(self, state: State, lost: Sequence[int], attempts: int) -> int:
        """Shards the executor lost: a replacement that did not answer is respawned under a new
        generation (a failed attempt, within budget); a survivor that died is a new death."""
        retries = [k for k in lost if k in state.targets]
        if retries and self._over_budget(attempts + 1, f"shards {retries} did not answer after respawning"):
            return 1
        for k in lost:
            if k in state.targets:
                with self._lock:
                    self.transition(RespawnRetry(k, self.next_gens[k]))
            else:
                self.on_shard_death(k, self.gens[k], "died during a recovery", self._clock())
        self._work.set()
        return 1 if retries else 0

    def _over_budget(self, attempts: int, detail: str) -> bool:
        over = self._p.policy.exceeded(Budget.EXECUTOR_ERRORS, attempts, detail)
        if over is not None:
            self.fail(over)
        return over is not None

    # ------------------------------------------------------------------ committing an outcome

    def _commit_outcome(self, done: RecoveringShards | RollingBack) -> None:
        """Makes what the executor did for ``done`` the live fleet, with its failure records
        and events (under the lock, inside the transition that persists them)."""
        out, now = self._outcome, self._clock()
        earlier = self._p.ledger.count()
        for k, (handle, info) in out.handles.items():
            self.handles[k], self.infos[k], self.gens[k] = handle, info, done.targets[k]
            self.names[k] = done.spares.get(k) or self._shard_name(k, done.targets[k])
            self._p.fleet.watch(k, done.targets[k], handle)
            self.live_since[k] = None  # known once trainers redo a step on it
        for k, result in out.loaded.items():
            for fb in result.fallbacks:
                self._events.append("checkpoint_fallback", event_time=now, shard=k, step=fb.step, reason=fb.reason)
        self.generation += 1
        if out.handles:
            self._p.observe.observe_reschedule(out.reschedule_s)
        if out.loaded:
            self._p.observe.observe_load(out.load_s)
        promoted = {done.spares[k] for k in getattr(done, "mirrors", ()) if k in out.handles}
        self._p.mirrors.replaced(range(self.n) if isinstance(done, RollingBack) else out.handles, promoted)
        records = failure_records(done, out, self.generation, now)
        self._p.ledger.add(records)
        for f in records:
            self._events.append("shard_recovered", event_time=now, **encode(f))
        if done.spares:
            self._p.spares.wake()  # a new spare starts in the background for each one used
        if isinstance(done, RollingBack):
            self._commit_rollback(done, out, earlier, now)

    def _commit_rollback(self, done: RollingBack, out: Outcome, earlier: int, now: float) -> None:
        self._p.ledger.reopen_after_rollback(done.step, earlier)
        if done.why != FULL_RECOVERY:
            # Shards that died in a fallback or a resume: the new trainers start at the
            # rollback step through trainer_setup (no await_shards to settle them); the work
            # redone is the fallback's own (all_trainers_failed.steps_lost).
            self._p.ledger.close_from(earlier, done.step)
        self.live_since = [done.step] * self.n
        self._p.prune_commits(done.step)
        dense_follows = done.why == FULL_RECOVERY or done.refused_from is not None
        self.rollback = Rollback(self.generation, done.step) if dense_follows else None
        if done.why == RESUME:
            self.resume_step = done.step
        for kind, fields in rollback_events(done, out):
            self._events.append(kind, event_time=now, **fields)

    # ------------------------------------------------------------------ views

    def trainers_restarted_at(self, step: int) -> None:
        """Every trainer restarts at checkpoint ``step``, where the shards stand already (recovered
        there): steps from ``step`` are redone, so a partial recovery loses only updates before it."""
        with self._lock:
            self._p.ledger.reopen_after_rollback(step, self._p.ledger.count())
            self.live_since = [step if x is None else min(x, step) for x in self.live_since]
            self._persist()

    def settle(self, known_generation: int, redo_step: int, upto_generation: float = float("inf")) -> None:
        """Trainers redo ``redo_step`` on a newer fleet: close the failures recovered since and
        start the replaced shards' spans there (a rollback set them already), journaled in one
        piece; their lost samples are counted afterwards, outside the lock."""
        with self._lock:
            shards, todo = self._p.ledger.close_settled(known_generation, redo_step, upto_generation)
            for k in shards:
                if self.live_since[k] is None:
                    self.live_since[k] = redo_step
            if todo or shards:
                self._persist()
        self._p.ledger.count_later(todo)

    def handle_if_current(self, k: int, generation: int):
        """Shard ``k``'s actor, if training runs normally on fleet ``generation`` (a report about
        an older fleet, or during a recovery, must not kill a newer actor)."""
        with self._lock:
            if generation != self.generation or not isinstance(self.state, Running):
                return None
            return self.handles[k]

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

    def infos_now(self) -> tuple[ShardInfo, ...]:
        """The serving shards' identities (those not being replaced)."""
        with self._lock:
            return tuple(i for i in self.infos if i is not None)

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

    def targets(self) -> dict[int, tuple[int | None, str | None]]:
        """Shard -> (pid, node id) of the actor serving it (None while it is being replaced)."""
        with self._lock:
            return {k: (i.pid, i.node_id) if i is not None else (None, None) for k, i in enumerate(self.infos)}

    def fleet(self) -> tuple[int, tuple]:
        with self._lock:
            return self.generation, tuple(self.handles)

    def shard_nodes(self, exclude=()) -> list:
        with self._lock:
            return [i.node_id if i else None for k, i in enumerate(self.infos) if k not in exclude]

    def assigned_spares(self) -> list[str]:
        with self._lock:
            return list(getattr(self.state, "spares", {}).values())

    def shards_on(self, node_id: str, since: float) -> list[str]:
        """The shards a lost node held: still placed there, or whose death there was seen since ``since``."""
        with self._lock:
            return sorted({f"shard:{k}" for k, i in enumerate(self.infos) if i is not None and i.node_id == node_id}
                          | {a for n, a, t in self._deaths if n == node_id and t >= since})

    def commit_start(self, handles: list, infos: list[ShardInfo]) -> None:
        """The first fleet (generation 0) answers."""
        with self._lock:
            self.handles, self.infos, self.started = list(handles), list(infos), True
            self._persist()
            self.changed.notify_all()

    def start_failed(self, error: str) -> None:
        with self._lock:
            self.start_error = error
            self.changed.notify_all()

    def reserve_first_fleet(self) -> None:
        """Generation 0 of every shard is reserved in the journal before it is spawned."""
        with self._lock:
            self.next_gens = [max(g, 1) for g in self.next_gens]
            self._persist()

    # ------------------------------------------------------------------ journal

    def doc(self) -> dict:
        state = self._next if self._next is not None else self.state
        return {
            "state": state_to_dict(state), "gens": self.gens, "next_gens": self.next_gens,
            "live_since": self.live_since, "names": self.names, "generation": self.generation,
            "rollback": encode(self.rollback), "resume_step": self.resume_step, "started": self.started,
        }

    def load(self, doc: dict) -> None:
        self.state = state_from_dict(doc["state"])
        self.gens, self.next_gens, self.live_since = doc["gens"], doc["next_gens"], doc["live_since"]
        self.names, self.generation, self.started = doc["names"], doc["generation"], doc["started"]
        self.rollback, self.resume_step = decode(Rollback, doc["rollback"]), doc["resume_step"]

    def reacquire(self, probe: Callable[[str], tuple[object, ShardInfo] | None]) -> list[int]:
        """After a supervisor restart: the journaled actor of each shard, found by name and
        watched again where it answers (``probe(name)``). Returns the shards not found."""
        missing = []
        for k in range(self.n):
            found = probe(self.names[k]) if self.started else None
            if found is None:
                missing.append(k)
                continue
            with self._lock:
                self.handles[k], self.infos[k] = found
            self._p.fleet.watch(k, self.gens[k], found[0])
        return missing

    def recover_missing(self, missing: list[int]) -> None:
        """Shards whose actor a restarted supervisor did not find die now, in the books."""
        for k in missing if self.started else ():
            self.on_shard_death(k, self.gens[k], "not found after supervisor restart", self._clock())

    def wake(self) -> None:
        self._work.set()
    def start_executor(self) -> None:
        self._p.start_thread("recovery-executor", self.run_executor)
