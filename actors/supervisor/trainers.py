"""The supervisor's book of trainers: registrations, committed steps, failed steps, heals and
progress, and the step-redo budget. Commits and failed steps come at every step, so they are
appended to ``trainer_book.jsonl`` (replayed after a restart or a resume) instead of being
rewritten with the journal; the rest is journaled with the other parts."""

from __future__ import annotations

import bisect
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from actors.supervisor.events import EventLog
from actors.supervisor.hooks import RunHooks
from core.accounting import trainer_failures
from core.codec import decode, encode
from core.journal import AppendLog
from core.books import KillRecord, StepCommit, TrainerFailure
from core.records import CommitRecord, Heal, Progress, StepFailure, Target, TrainerStart
from policies import Budget, FailurePolicy

__all__ = ["TrainerBook", "LivenessProbe"]

logger = logging.getLogger(__name__)

# {rank: (pid, node id)}, timeout -> {rank: True (alive) / False (gone, or its node) / None (no answer)}
LivenessProbe = Callable[[dict, float], dict]


@dataclass
class _Trainer:
    pid: int | None
    node_id: str | None
    registered: float
    starts: int
    committed_at: float = 0.0
    committed_step: int | None = None


@dataclass
class _Commit:
    microbatches: list[int] = field(default_factory=list)
    total: int = 0
    participants: int = 0
    time: float = 0.0


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
        alive: LivenessProbe,
        book: AppendLog,
        num_trainers: int,
        samples_per_step: int,
        on_replaced: Callable[[int, str], None] = lambda pid, node: None,
        place: Callable[[int, int | None, str | None], None] = lambda rank, pid, node: None,
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
        self._alive = alive
        self._book = book
        self.num_trainers = num_trainers
        self.samples_per_step = samples_per_step
        self._trainers: dict[int, _Trainer] = {}
        self._commits: dict[int, _Commit] = {}
        self._failed: list[StepFailure] = []
        self._heals: list[Heal] = []
        self._progress: list[Progress] = []
        self._started = False
        self._redos: dict[int, dict[int, int]] = {}
        # (quorum id, step) whose all-reduce failed on some trainer: its group cannot finish.
        self._broken: set[tuple[int, int]] = set()
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
                self._trainers[start.rank] = _Trainer(start.pid, start.node_id, time.time(), starts)
                self._events.append("trainer_started", rank=start.rank, pid=start.pid, starts=starts,
                                    marks=encode(start.marks))
                self._persist()
            ready = self._started or len(self._trainers) >= self.num_trainers
        if new:
            # Its place (actors.lease): the process it replaces is fenced. Outside the lock (a GCS
            # write); a failure fails this call, and the trainer's next process registers again.
            self._place(start.rank, start.pid, start.node_id)
        return ready

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
            self._heals.append(Heal(rank, step, heal_s, wall_time))
            self._pins.pop(rank, None)
        self._events.record("trainer_healed", rank=rank, step=step, heal_s=round(heal_s, 3))

    # ------------------------------------------------------------------ steps

    def commit(self, c: CommitRecord) -> None:
        """A trainer's share of a committed step. A commit on fleet ``generation`` settles the
        recoveries up to it that no ``await_shards`` settled (trainers that learned the fleet
        from trainer_setup or a fallback)."""
        if c.generation is not None:
            self._on_commit(c.step, c.generation)
        with self._lock:
            self._add_commit(c)
            self._book.append({"kind": "commit", **encode(c)})
            me = self._trainers.get(c.rank)
            if me is not None:
                me.committed_at = c.time
                me.committed_step = max(c.step, me.committed_step if me.committed_step is not None else -1)
            self._pins.pop(c.rank, None)
        if c.participants < self.num_trainers:
            self._export_detections()
        self._hooks.after_commit(c.step)

    def _add_commit(self, c: CommitRecord) -> None:
        entry = self._commits.setdefault(c.step, _Commit(total=c.total, participants=c.participants, time=c.time))
        entry.microbatches.extend(c.microbatches)

    def step_failed(self, f: StepFailure) -> None:
        with self._lock:
            redos = self._add_failure(f)
            self._book.append({"kind": "failed", **encode(f)})
        self._export_detections()
        over = self._policy.exceeded(
            Budget.STEP_REDOS, redos, f"step {f.step} failed {redos} times (last on trainer {f.rank}: {f.cause[:200]})"
        )
        if over is not None:
            self._fail(over)

    def _add_failure(self, f: StepFailure) -> int:
        self._failed.append(f)
        if f.broken_quorum is not None:
            self._broken.add((f.broken_quorum, f.step))
        per_rank = self._redos.setdefault(f.step, {})
        per_rank[f.rank] = per_rank.get(f.rank, 0) + 1
        return max(per_rank.values())

    def group_broken(self, quorum: int, step: int) -> bool:
        with self._lock:
            return (quorum, step) in self._broken

    def prune(self, step: int) -> None:
        """Everything went back to ``step``: commits from there on belong to an abandoned
        timeline, and a live trainer that had committed them is at ``step - 1`` again."""
        with self._lock:
            self._prune(step)
            self._book.append({"kind": "pruned", "step": step})

    def _prune(self, step: int, trainers: bool = True) -> None:
        self._commits = {s: c for s, c in self._commits.items() if s < step}
        for t in self._trainers.values() if trainers else ():
            if t.committed_step is not None and t.committed_step >= step:
                t.committed_step = step - 1

    # ------------------------------------------------------------------ progress

    def progress(self, p: Progress) -> Progress:
        """Kept in the order the trainers sent them: the supervisor runs calls on several
        threads, so two reports a step apart may be recorded the other way round (a clock
        counting steps from the last one, as the emulation's, would count a step twice)."""
        record = p if p.time else dataclasses.replace(p, time=round(time.time(), 3))
        with self._lock:
            bisect.insort(self._progress, record, key=lambda r: r.time)
        self._hooks.on_progress(record)
        return record

    def all_progress(self) -> list[Progress]:
        with self._lock:
            return list(self._progress)

    def last_progress(self) -> Progress | None:
        with self._lock:
            return self._progress[-1] if self._progress else None

    def step_time_s(self) -> float | None:
        with self._lock:
            rates = [p.samples_per_s for p in self._progress[-5:] if p.samples_per_s]
        return self.samples_per_step / (sum(rates) / len(rates)) if rates else None

    # ------------------------------------------------------------------ liveness and failures

    def live_established(self, exclude: int, timeout_s: float) -> dict[int, int | None]:
        """Ranks other than ``exclude`` whose current process has committed a step and is alive,
        with the last step each committed. A trainer whose node is gone is not alive (before, the
        probe's error reached the replacement trainer asking, which crash-looped); one whose
        probe did not answer in time counts as alive: the replacement then waits to heal from
        it rather than roll the shards back under a trainer that may be ahead."""
        with self._lock:
            candidates = {r: t for r, t in self._trainers.items()
                          if r != exclude and t.committed_at > t.registered and t.pid is not None}
        answers = self._alive({r: (t.pid, t.node_id) for r, t in candidates.items()}, timeout_s) if candidates else {}
        for r, alive in answers.items():
            if alive is None:
                logger.warning("trainer %d (pid %s) did not answer a liveness probe in %.1fs; counted as alive",
                               r, candidates[r].pid, timeout_s)
        return {r: candidates[r].committed_step for r, alive in answers.items() if alive is not False}

    def failures(self) -> list[TrainerFailure]:
        with self._lock:
            commits = {s: StepCommit(tuple(c.microbatches), c.total, c.participants, c.time) for s, c in self._commits.items()}
            failed, heals = list(self._failed), list(self._heals)
        return trainer_failures(self._kills(), failed, commits, heals, self.num_trainers)

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

    def commits(self) -> dict[int, StepCommit]:
        with self._lock:
            return {s: StepCommit(tuple(sorted(c.microbatches)), c.total, c.participants, c.time)
                    for s, c in sorted(self._commits.items())}

    def last_step_committed(self) -> int | None:
        with self._lock:
            return max(self._commits) if self._commits else None

    def committed_since(self, step: int) -> bool:
        with self._lock:
            return any(s >= step for s in self._commits)

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
            "trainers": {str(r): encode(t) for r, t in self._trainers.items()},
            "heals": encode(self._heals), "progress": encode(self._progress[-200:]), "started": self._started,
            "exported": sorted(self._exported), "pins": {str(r): s for r, s in self._pins.items()},
        }

    def load(self, doc: dict, book: list[dict], history_only: bool = False) -> None:
        """The journaled book and the replayed records. ``history_only``: an earlier attempt
        of the run (``--resume``): its commits, failed steps, heals and progress, not its
        trainer processes, which are gone."""
        self._heals = [decode(Heal, h) for h in doc["heals"]]
        self._progress = [decode(Progress, p) for p in doc["progress"]]
        self._exported = set(doc["exported"])
        if not history_only:
            self._trainers = {int(r): _Trainer(**t) for r, t in doc["trainers"].items()}
            self._started = doc["started"]
            self._pins = {int(r): s for r, s in doc.get("pins", {}).items()}
        # The journaled trainers are already as every prune left them; replaying a prune must
        # not lower the committed step of trainers that committed later steps since. An earlier
        # attempt's failed steps are history: they count in the report, not in this attempt's
        # redo budget.
        for record in book:
            kind = record.pop("kind")
            if kind == "commit":
                self._add_commit(decode(CommitRecord, record))
            elif kind == "failed":
                failure = decode(StepFailure, record)
                if history_only:
                    self._failed.append(failure)
                else:
                    self._add_failure(failure)
            elif kind == "pruned":
                self._prune(record["step"], trainers=False)
