"""The supervisor's book of trainers: registrations (with the worker actor a recovery asks for
the trainer's facts), committed steps, failed steps, heals and progress, and the step-redo
budget. Commits and failed steps come at every step, so they are appended to
``trainer_book.jsonl`` (replayed after a restart or a resume) instead of being rewritten with
the journal, and the memory keeps a window of them with running tallies (``step_records``);
progress reports are appended to ``progress.jsonl`` (the run log) and the memory keeps the
last ones. The rest is journaled with the other parts.

The book is a cache of reports the trainers send without waiting: a report retried across a
supervisor restart counts once (each carries its process and number), and every attempt of
the run (``--resume``) keeps its own commits, failed steps and heals, so that a trainer failure
is matched with what happened in its own attempt."""

from __future__ import annotations

import base64
import bisect
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import ray

from actors.supervisor.events import EventLog
from actors.supervisor.hooks import RunHooks
from actors.supervisor.step_records import StepRecords
from core.codec import decode, encode
from core.journal import AppendLog
from core.books import CommitTally, KillRecord, TrainerFailure
from core.records import CommitRecord, Heal, Progress, StepFailure, Target, TrainerStart
from core.step_protocol import Decision, StepStart, Vote
from policies import Budget, FailurePolicy

__all__ = ["TrainerBook"]

logger = logging.getLogger(__name__)

PROGRESS_KEPT = 64  # progress reports in memory (the last: the step time, the console); the file has all
_RATE_REPORTS = 5  # the step time is the mean rate of the last reports: journaled for a restart


@dataclass
class _Trainer:
    pid: int | None
    node_id: str | None
    starts: int
    worker: object = None  # its Ray Train worker actor (not journaled as such: pickled, see doc())
    blob: str | None = None  # the worker pickled, once: every journal write carries it

    def pickled(self) -> str | None:
        if self.blob is None and self.worker is not None:
            self.blob = _pickled(self.worker)
        return self.blob


class TrainerBook:
    def __init__(
        self,
        lock: threading.RLock,
        events: EventLog,
        persist: Callable[[], None],
        hooks: RunHooks,
        policy: FailurePolicy,
        fail: Callable[[str], None],
        kills: Callable[[], Sequence[KillRecord]],
        on_commit: Callable[[int, int], None],
        book: AppendLog,
        num_trainers: int,
        samples_per_step: int,
        on_replaced: Callable[[int, str], None] = lambda pid, node: None,
        place: Callable[[int, int | None, str | None], None] = lambda rank, pid, node: None,
        unwritable: Callable[[str, object, OSError], Exception] | None = None,
    ):
        self._on_replaced = on_replaced
        self._place = place  # grants rank's place (actors.lease) to a process; pid None: to none
        self._lock = lock
        self._events = events
        self._persist = persist
        self._hooks = hooks
        self._policy = policy
        self._fail = fail
        self._kills = kills
        self._on_commit = on_commit
        self._book = book
        self.num_trainers = num_trainers
        self.samples_per_step = samples_per_step
        self._trainers: dict[int, _Trainer] = {}
        self._steps = StepRecords(book, kills, num_trainers, unwritable=unwritable)
        self._progress: list[Progress] = []  # the last PROGRESS_KEPT, in time order
        self._started = False
        # Kill times of trainer failures whose detection is already in the metrics.
        self._exported: set[float] = set()
        # rank -> the checkpoint step trainer_setup handed it to start from (kept from retention).
        self._pins: dict[int, int] = {}

    # ------------------------------------------------------------------ registration

    def register(self, start: TrainerStart) -> bool:
        """A trainer is ready to step. True once the first step may begin: every trainer of the
        group registered, or training is under way (a replacement joins the running quorum)."""
        with self._lock:
            known = self._trainers.get(start.rank)
            # A new process (the call repeats until all are in); pids repeat across hosts.
            new = known is None or (known.pid, known.node_id) != (start.pid, start.node_id)
            if new:
                if known is not None and known.pid is not None:
                    self._on_replaced(known.pid, known.node_id)  # what the dead process left (its slabs)
                starts = (known.starts if known else 0) + 1
                self._trainers[start.rank] = _Trainer(start.pid, start.node_id, starts, start.worker)
                self._events.append("trainer_started", rank=start.rank, pid=start.pid, starts=starts,
                                    marks=encode(start.marks))
                self._persist()
            ready = self._started or len(self._trainers) >= self.num_trainers
        if new:
            # Its place (actors.lease): the process it replaces is fenced. Outside the lock (a GCS
            # write); a failure fails this call, and the trainer's next process registers again.
            self._place(start.rank, start.pid, start.node_id)
        return ready

    def workers(self) -> dict[int, object]:
        """Rank -> the worker actor of its current process (None: not known), for a recovery's questions."""
        with self._lock:
            return {r: t.worker for r, t in self._trainers.items() if t.pid is not None}

    def on_node(self, node_id: str) -> int:
        with self._lock:
            return sum(1 for t in self._trainers.values() if t.node_id == node_id)

    def start_training(self, step: int, trainers: int, wall_time: float) -> bool:
        """Returns True the first time: training is under way."""
        with self._lock:
            if self._started:
                return False
            self._started = True
        self._events.record("training_started", step=step, trainers=trainers, wall_time=wall_time)
        return True

    def has_started(self) -> bool:
        """Whether training is under way (a trainer that registers now replaces a dead one)."""
        with self._lock:
            return self._started

    def healed(self, rank: int, step: int, heal_s: float, wall_time: float) -> None:
        with self._lock:
            self._steps.heal(Heal(rank, step, heal_s, wall_time))
            self._pins.pop(rank, None)
        self._events.record("trainer_healed", rank=rank, step=step, heal_s=round(heal_s, 3))

    def begin_attempt(self) -> None:
        """A new attempt of the run (``--resume``): its commits, failed steps and heals start
        afresh; the earlier attempts' stay for the report."""
        with self._lock:
            self._steps.begin_attempt(time.time())

    # ------------------------------------------------------------------ steps

    def commit(self, c: CommitRecord) -> None:
        """A trainer's share of a committed step (counted once, however often it is delivered).
        A commit on fleet ``generation`` settles the recoveries up to it that no
        ``await_shards`` settled (trainers that learned the fleet from trainer_setup or a fallback)."""
        with self._lock:
            if not self._steps.commit(c):
                return
            self._pins.pop(c.rank, None)
        if c.generation is not None:
            self._on_commit(c.step, c.generation)
        if c.participants < self.num_trainers:
            self._export_detections()
        self._hooks.after_commit(c.step)

    def step_failed(self, f: StepFailure) -> None:
        with self._lock:
            redos = self._steps.step_failed(f)
        if redos is None:
            return  # counted already
        self._export_detections()
        over = self._policy.exceeded(
            Budget.STEP_REDOS, redos, f"step {f.step} failed {redos} times (last on trainer {f.rank}: {f.cause[:200]})"
        )
        if over is not None:
            self._fail(over)

    def decide(self, v: Vote) -> Decision:
        """The one decision of ``v``'s try (``core.step_protocol``)."""
        with self._lock:
            return self._steps.decide(v)

    def start_step(self, rank: int, generation: int, step: int, healed_from: int | None) -> StepStart:
        """Trainer ``rank``'s try at ``step``; ``healed_from``: its step before torchft healed it
        in this quorum (a replacement's or a live trainer's heal), recorded as an event, and
        refused past the steps the run committed since its last rollback."""
        with self._lock:
            start = self._steps.start_step(generation, step, healed_from is not None)
        if healed_from is not None:
            self._events.record("dense_healed", rank=rank, from_step=healed_from, step=step, generation=generation,
                                allowed=start.heal_allowed)
        return start

    def group_broken(self, quorum: int, step: int) -> bool:
        with self._lock:
            return self._steps.broken(quorum, step)

    def prune(self, step: int, generation: int | None = None) -> None:
        """Everything went back to ``step`` (the trainers start again in fleet ``generation``):
        this attempt's commits from there on belong to an abandoned timeline. Part of a
        rollback's transition: journaled with it."""
        with self._lock:
            self._steps.prune(step, generation)

    # ------------------------------------------------------------------ progress

    def progress(self, p: Progress) -> Progress:
        """Kept in the order the trainers sent them: the supervisor runs calls on several
        threads, so two reports a step apart may be recorded the other way round (a clock
        counting steps from the last one, as the emulation's, would count a step twice)."""
        record = p if p.time else dataclasses.replace(p, time=round(time.time(), 3))
        with self._lock:
            bisect.insort(self._progress, record, key=lambda r: r.time)
            if len(self._progress) > PROGRESS_KEPT:
                del self._progress[0]
        self._hooks.on_progress(record)
        return record

    def recent_progress(self) -> list[Progress]:
        """The last ``PROGRESS_KEPT`` reports (``progress.jsonl`` has every one)."""
        with self._lock:
            return list(self._progress)

    def last_progress(self) -> Progress | None:
        with self._lock:
            return self._progress[-1] if self._progress else None

    def step_time_s(self) -> float | None:
        with self._lock:
            rates = [p.samples_per_s for p in self._progress[-_RATE_REPORTS:] if p.samples_per_s]
        return self.samples_per_step / (sum(rates) / len(rates)) if rates else None

    # ------------------------------------------------------------------ failures

    def failures(self) -> list[TrainerFailure]:
        """One record per killed trainer, matched with what happened in its own attempt."""
        with self._lock:
            return self._steps.failures()

    def failure_of(self, healed: dict) -> dict | None:
        """The trainer failure a ``trainer_healed`` event ended, if its kill is known."""
        mine = [t for t in self.failures() if t.actor == f"trainer:{healed['rank']}" and t.rejoined_s is not None]
        return encode(mine[-1]) if mine else None

    def _export_detections(self) -> None:
        """Exports the detection time of each trainer failure the survivors just acted on
        (a failed step or a smaller quorum's commit), once per failure."""
        with self._lock:
            if all(k.time in self._exported for k in self._kills() if k.target.startswith("trainer:")):
                return
        for t in self.failures():
            with self._lock:
                fresh = t.detection_s is not None and t.killed_at not in self._exported
                if fresh:
                    self._exported.add(t.killed_at)
            if fresh:
                self._hooks.on_trainer_detected(t.detection_s)

    # ------------------------------------------------------------------ views

    def tally(self) -> CommitTally:
        """The committed steps of the run's final timeline, as the report counts them."""
        with self._lock:
            return self._steps.tally()

    def sizes(self) -> dict[str, int]:
        """Entries in memory per structure (flat over a run: a window and tallies)."""
        with self._lock:
            return {**self._steps.sizes(), "progress": len(self._progress), "trainers": len(self._trainers)}

    def last_step_committed(self) -> int | None:
        """The last step committed in this attempt."""
        with self._lock:
            return self._steps.last_step()

    def committed_steps(self) -> int:
        """Steps this attempt's commit reports say are committed (0: none yet)."""
        last = self.last_step_committed()
        return 0 if last is None else last + 1

    def timeline_steps(self) -> int | None:
        """Steps the run holds committed since its last rollback: the step ledger's decisions
        (made before any trainer steps), else this attempt's commit reports; None: unknown."""
        with self._lock:
            steps, last = self._steps.ledger.committed_steps(), self._steps.last_step()
        return steps if steps is not None else None if last is None else last + 1

    def committed_since(self, step: int) -> bool:
        """Whether a step from ``step`` on was committed: by the step ledger (decided before any
        trainer reports it) or by a commit report."""
        with self._lock:
            steps = self._steps.ledger.committed_steps()
            return (steps is not None and steps > step) or self._steps.committed_since(step)

    def nodes(self) -> set:
        with self._lock:
            return {t.node_id for t in self._trainers.values()}

    def lose_node(self, node_id: str) -> None:
        """Ray declared ``node_id`` dead: its trainers lose their places (one cut off there and
        back exits instead of stepping on)."""
        with self._lock:
            ranks = [rank for rank, t in self._trainers.items() if t.node_id == node_id]
        for rank in ranks:
            try:
                self._place(rank, None, node_id)
            except Exception as err:  # noqa: BLE001 - its lease runs out by itself (ray.lease_s)
                logger.warning("could not take trainer %d's place on lost node %s: %s", rank, node_id, err)

    def ranks_on(self, node_id: str) -> list[str]:
        with self._lock:
            return [f"trainer:{r}" for r, t in sorted(self._trainers.items()) if t.node_id == node_id]

    def targets(self) -> dict[str, Target]:
        with self._lock:
            return {f"trainer:{r}": Target(t.pid, t.node_id) for r, t in self._trainers.items()}

    def pin(self, rank: int, step: int) -> None:
        """``trainer_setup`` handed checkpoint ``step`` to ``rank`` to start from: retention
        keeps it until that trainer heals, joins, falls back or commits."""
        with self._lock:
            self._pins[rank] = step

    def unpin(self, rank: int) -> None:
        with self._lock:
            self._pins.pop(rank, None)

    def pinned(self) -> set[int]:
        with self._lock:
            return set(self._pins.values())

    # ------------------------------------------------------------------ journal

    def doc(self) -> dict:
        return {
            "trainers": {str(r): {"pid": t.pid, "node_id": t.node_id, "starts": t.starts, "worker": t.pickled()}
                         for r, t in self._trainers.items()},
            "progress": encode(self._progress[-_RATE_REPORTS:]), "started": self._started,
            "exported": sorted(self._exported),
            "pins": {str(r): s for r, s in self._pins.items()}, **self._steps.doc(),
        }

    def load(self, doc: dict, book: Iterable[dict], history_only: bool = False) -> None:
        """The journaled book and the replayed records. ``history_only``: an earlier attempt
        of the run (``--resume``): its commits, failed steps, heals and progress, not its
        trainer processes, which are gone."""
        self._progress = [decode(Progress, p) for p in doc["progress"]]
        self._exported = set(doc["exported"])
        if not history_only:
            self._trainers = {
                int(r): _Trainer(t["pid"], t["node_id"], t["starts"], _unpickled(t.get("worker")), t.get("worker"))
                for r, t in doc["trainers"].items()
            }
            self._started = doc["started"]
            self._pins = {int(r): s for r, s in doc.get("pins", {}).items()}
        self._steps.load(doc, book, history_only)


def _pickled(worker) -> str | None:
    """A worker actor's handle, for the journal: a restarted supervisor asks the same process."""
    if worker is None:
        return None
    return base64.b64encode(ray.cloudpickle.dumps(worker)).decode()


def _unpickled(blob: str | None):
    if blob is None:
        return None
    try:
        return ray.cloudpickle.loads(base64.b64decode(blob))
    except Exception as err:  # noqa: BLE001 - without it the trainer is asked nothing: its answer is unknown
        logger.warning("a trainer's worker handle could not be read back from the journal: %s", err)
        return None
