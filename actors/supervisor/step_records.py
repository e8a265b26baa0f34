"""What the trainers reported of their steps, as the trainer book keeps it: per attempt of the
run (``--resume`` starts a new one), each report counted once however often Ray delivers it (a
call retried across a supervisor restart), with the rollbacks that abandoned committed steps.

The memory holds a window of the last ``COMMIT_WINDOW`` steps of this attempt (commits,
failed steps, redo counts, broken groups); a step that leaves it is folded into running
tallies (``step_tally``) that grow with the failures, not the steps. The book file
(``trainer_book.jsonl``) holds every record in the order it came; a replay rebuilds the same
window and tallies."""

from __future__ import annotations

import dataclasses
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from actors.supervisor.step_tally import AttemptTally, KillFold, final_tally
from core.books import CommitTally, KillRecord, StepCommit, TrainerFailure
from core.codec import decode, encode
from core.journal import AppendLog
from core.records import CommitRecord, Heal, StepFailure
from core.step_protocol import Decision, StepLedger, StepStart, Vote

__all__ = ["StepRecords", "COMMIT_WINDOW", "read_commits"]

COMMIT_WINDOW = 1024  # steps of this attempt kept one by one; a retry or a late report comes within seconds
_SEEN_WINDOW = 1024  # report numbers remembered per trainer process below its highest


@dataclass
class _Commit:
    total: int
    participants: int
    time: float


class _Seen:
    """Report numbers counted, per trainer process: a report delivered twice counts once. A
    process numbers its reports in order, so one more than ``_SEEN_WINDOW`` below its highest
    is a retry; the processes least recently heard from are forgotten past ``limit``."""

    def __init__(self, limit: int):
        self._limit = limit
        self._procs: OrderedDict[tuple[int, object], list] = OrderedDict()  # -> [highest, numbers seen]

    def fresh(self, rank: int, pid: int | None, seq: int | None, process: str | None = None) -> bool:
        """``process``: the trainer process's own name (its pid may repeat on another host: a
        replacement there numbering its reports from 1 again is a new process)."""
        if pid is None or seq is None:
            return True
        key = (rank, process if process is not None else pid)
        entry = self._procs.get(key)
        if entry is None:
            entry = self._procs[key] = [seq, set()]
            if len(self._procs) > self._limit:
                self._procs.popitem(last=False)
        else:
            self._procs.move_to_end(key)
        if seq in entry[1] or seq <= entry[0] - _SEEN_WINDOW:
            return False
        entry[1].add(seq)
        entry[0] = max(entry[0], seq)
        if len(entry[1]) > 2 * _SEEN_WINDOW:
            entry[1] = {s for s in entry[1] if s > entry[0] - _SEEN_WINDOW}
        return True

    def size(self) -> int:
        return sum(len(e[1]) for e in self._procs.values())


class StepRecords:
    """Not thread-safe on its own: the trainer book holds its lock around every call.
    ``kills()``: the run's trainer kills, for the steps that leave the window. ``book`` None:
    a reader of a run's files (``cpr report``), which only replays them."""

    def __init__(self, book: AppendLog | None, kills: Callable[[], Sequence[KillRecord]] = list, num_trainers: int = 1,
                 window: int = COMMIT_WINDOW, unwritable: Callable[[str, object, OSError], Exception] | None = None):
        self._book = book
        # A record that cannot be written (a full disk) fails the run like the journal's writes.
        self._unwritable = unwritable
        self._kills = kills
        self._n = num_trainers
        self._window_steps = window
        self.attempt = 1
        self.attempt_starts: list[float] = []  # wall time each attempt after the first began (for the report)
        self.heals: list[tuple[int, Heal]] = []  # one per replacement trainer: grows with the failures
        self._tallies: list[AttemptTally] = [AttemptTally()]  # per attempt
        self._folds: dict[tuple, KillFold] = {}  # per trainer kill: its part of the steps folded
        self._seen = _Seen(4 * num_trainers + 16)
        self._records = 0  # records in the book file: where a rollback's prune applies on a replay
        self.prunes: list[tuple] = []  # (step, records before it, generation) of every rollback
        self._begin_window()

    def _begin_window(self) -> None:
        self._window: dict[int, _Commit] = {}  # step -> its first commit report, this attempt
        self._newest: int | None = None
        self._failed: deque[StepFailure] = deque()
        self._redos: dict[int, dict[int, int]] = {}  # step -> rank -> failures
        self._broken: dict[int, set[int]] = {}  # step -> quorum ids whose all-reduce failed somewhere
        self.ledger = StepLedger()  # the one decision of every try of this attempt's steps

    # ------------------------------------------------------------------ reports

    def commit(self, c: CommitRecord) -> bool:
        """False if it was counted already."""
        if not self._seen.fresh(c.rank, c.pid, c.seq, c.process):
            return False
        self._add_commit(c)
        self._append({"kind": "commit", **encode(c)})
        return True

    def _add_commit(self, c: CommitRecord) -> None:
        tally = self._tallies[-1]
        tally.committed.add(c.step)
        if c.step in self._window or (self._newest is not None and c.step <= self._newest - self._window_steps):
            return  # the step's first report decided (a later one from the window's far side is late)
        self._window[c.step] = _Commit(c.total, c.participants, c.time)
        tally.totals.add(c.total)
        if c.participants < self._n:
            tally.degraded.add(c.step)
        if self._newest is None or c.step > self._newest:
            self._newest = c.step
            self._evict(c.step - self._window_steps)

    def step_failed(self, f: StepFailure) -> int | None:
        """The step's failures so far on the trainer that failed most (the redo budget's
        count); None if it was counted already."""
        if not self._seen.fresh(f.rank, f.pid, f.seq, f.process):
            return None
        redos = self._add_failure(f)
        self._append({"kind": "failed", **encode(f)})
        return redos

    def _add_failure(self, f: StepFailure) -> int:
        self._failed.append(f)
        if len(self._failed) > self._window_steps:
            self._fold_failure(self._failed.popleft())
        if f.broken_quorum is not None:
            self._broken.setdefault(f.step, set()).add(f.broken_quorum)
        per_rank = self._redos.setdefault(f.step, {})
        per_rank[f.rank] = per_rank.get(f.rank, 0) + 1
        return max(per_rank.values())

    def decide(self, v: Vote) -> Decision:
        """The decision of ``v``'s try (``core.step_protocol``): the first vote of a try decides it
        and is written to the book before anyone hears it, so a supervisor restart keeps it."""
        steps = self.ledger.committed_steps()
        decision, new = self.ledger.vote(v)
        self._mark_broken(v, steps)
        if new or v.broken_quorum is not None:
            self._append({"kind": "decision", **encode(v)})
        return decision

    def _mark_broken(self, v: Vote, steps: int | None) -> None:
        """``v``'s quorum broke: its peers waiting in the all-reduce of that step walk away. A
        trainer whose heal failed votes at its own (un-healed) step; its peers wait at the run's
        committed steps (``steps``, as the ledger stood before this vote): both are marked."""
        if v.broken_quorum is not None:
            for step in {v.step.step, steps} - {None}:
                self._broken.setdefault(step, set()).add(v.broken_quorum)

    def start_step(self, generation: int, step: int, healed: bool) -> StepStart:
        return self.ledger.start(generation, step, healed)

    def heal(self, h: Heal) -> None:
        self.heals.append((self.attempt, h))

    def broken(self, quorum: int, step: int) -> bool:
        return quorum in self._broken.get(step, ())

    def prune(self, step: int, generation: int | None = None) -> None:
        """Everything went back to ``step`` (the trainers start again in fleet ``generation``):
        this attempt's commits from there on belong to an abandoned timeline. Journaled with the
        rollback (where in the book it applies)."""
        self._prune(step, generation)
        self.prunes.append((step, self._records, generation))

    def _prune(self, step: int, generation: int | None = None) -> None:
        self._window = {s: c for s, c in self._window.items() if s < step}
        self.ledger.rolled_back(step, generation)
        self._newest = max(self._window, default=None)
        self._tallies[-1].cut(step)
        for fold in self._folds.values():
            if fold.attempt == self.attempt:
                fold.degraded.cut(step)

    def begin_attempt(self, wall_time: float) -> None:
        self._next_attempt(wall_time)
        self._append({"kind": "attempt", "attempt": self.attempt})

    def _next_attempt(self, wall_time: float | None) -> None:
        self._evict(None)
        while self._failed:
            self._fold_failure(self._failed.popleft())
        self.attempt += 1
        if wall_time is not None:
            self.attempt_starts.append(wall_time)
        self._tallies.append(AttemptTally())
        self._begin_window()

    def _append(self, record: dict) -> None:
        try:
            self._book.append(record)
        except OSError as err:
            if self._unwritable is None:
                raise
            raise self._unwritable("trainer book", self._book.path, err) from err
        self._records += 1

    # ------------------------------------------------------------------ folding

    def _evict(self, upto: int | None) -> None:
        """Folds the window's steps up to ``upto`` (None: all) into the kills' tallies."""
        while self._window:
            step = next(iter(self._window))
            if upto is not None and step > upto:
                break
            self._fold_commit(step, self._window.pop(step))
        for per_step in (self._redos, self._broken):
            while per_step and (upto is None or next(iter(per_step)) <= upto):
                del per_step[next(iter(per_step))]

    def _mine(self, attempt: int) -> list[KillRecord]:
        starts = [float("-inf"), *self.attempt_starts, float("inf")]
        return [k for k in self._kills()
                if k.target.startswith("trainer:") and starts[attempt - 1] <= k.time < starts[attempt]]

    def _fold_commit(self, step: int, c: _Commit) -> None:
        if c.participants >= self._n:
            return
        for kill in self._mine(self.attempt):
            _absorb_commit(self._fold(kill), kill, self._end(kill, self.attempt), step, c)

    def _fold_failure(self, f: StepFailure) -> None:
        for kill in self._mine(self.attempt):
            if f.time >= kill.time:
                self._fold(kill).seen(f.time)

    def _fold(self, kill: KillRecord) -> KillFold:
        return self._folds.setdefault((kill.target, kill.time, kill.pid), KillFold(self.attempt))

    def _end(self, kill: KillRecord, attempt: int) -> float:
        """When the killed trainer's replacement healed (its outage's end)."""
        rank = int(kill.target.split(":")[1])
        heal = next((h for a, h in self.heals if a == attempt and h.rank == rank and h.time >= kill.time), None)
        return heal.time if heal else float("inf")

    # ------------------------------------------------------------------ views

    def failures(self) -> list[TrainerFailure]:
        """One record per killed trainer, matched with the commits, failed steps and heals of
        its own attempt (a kill belongs to the attempt it came in, by the report's clock)."""
        out = []
        for a in range(1, self.attempt + 1):
            for kill in self._mine(a):
                fold = self._folds.get((kill.target, kill.time, kill.pid))
                fold = fold.copy() if fold is not None else KillFold(a)
                end = self._end(kill, a)
                if a == self.attempt:
                    for step, c in self._window.items():
                        _absorb_commit(fold, kill, end, step, c, self._n)
                    for f in self._failed:
                        if f.time >= kill.time:
                            fold.seen(f.time)
                out.append(_failure(kill, fold, end, self.heals, a))
        return out

    def tally(self) -> CommitTally:
        steps, totals, degraded = final_tally(self._tallies)
        return CommitTally(steps, totals, degraded)

    def last_step(self) -> int | None:
        """The last step committed in this attempt."""
        return self._tallies[-1].committed.last()

    def committed_since(self, step: int) -> bool:
        last = self.last_step()
        return last is not None and last >= step

    def sizes(self) -> dict[str, int]:
        """How many entries each structure holds (a bounded book keeps these flat)."""
        return {"window": len(self._window), "failed": len(self._failed), "redos": len(self._redos),
                "broken": len(self._broken), "tries": self.ledger.sizes(), "seen": self._seen.size(), "heals": len(self.heals),
                "ranges": sum(len(t.committed) + len(t.degraded) for t in self._tallies),
                "folds": sum(1 + len(f.degraded) for f in self._folds.values())}

    # ------------------------------------------------------------------ journal

    def doc(self) -> dict:
        return {"heals": [{"attempt": a, **encode(h)} for a, h in self.heals], "attempt": self.attempt,
                "attempt_starts": self.attempt_starts, "prunes": self.prunes}

    def load(self, doc: dict, book: Iterable[dict], history_only: bool) -> None:
        """The journaled part and the book's records in order, each rollback's prune where it
        came. An earlier attempt's failed steps are history (``history_only``: a resumed run):
        they count in the report, not in this attempt's redo budget."""
        self.heals = [(h.pop("attempt", 1), decode(Heal, h)) for h in map(dict, doc["heals"])]
        self.attempt_starts = list(doc.get("attempt_starts", []))
        prunes = [tuple(p) for p in doc.get("prunes", [])]
        pending, n = sorted(prunes, key=lambda p: p[1]), 0
        for n, record in enumerate(book, 1):
            while pending and pending[0][1] <= n - 1:
                self._prune(*_step_and_generation(pending.pop(0)))
            self._replay(dict(record))
        for prune in pending:
            self._prune(*_step_and_generation(prune))
        self._records, self.prunes = n, list(prunes)
        if history_only:
            self._redos, self._broken = {}, {}

    def _replay(self, record: dict) -> None:
        kind = record.pop("kind")
        if kind == "attempt":
            self._next_attempt(None)  # its wall time is journaled (attempt_starts)
        elif kind == "commit":
            c = decode(CommitRecord, record)
            if self._seen.fresh(c.rank, c.pid, c.seq, c.process):
                self._add_commit(c)
        elif kind == "failed":
            f = decode(StepFailure, record)
            if self._seen.fresh(f.rank, f.pid, f.seq, f.process):
                self._add_failure(f)
        elif kind == "decision":
            v = decode(Vote, record)
            steps = self.ledger.committed_steps()
            self.ledger.vote(v)
            self._mark_broken(v, steps)
        elif kind == "pruned":  # the books of an earlier version wrote prunes here
            self._prune(record["step"])


def _step_and_generation(prune: tuple) -> tuple[int, int | None]:
    """A journaled prune: (step, records before it[, generation]) (books before the step ledger
    have no generation)."""
    return prune[0], prune[2] if len(prune) > 2 else None


def _absorb_commit(fold: KillFold, kill: KillRecord, end: float, step: int, c: _Commit, n: int | None = None) -> None:
    """A commit by fewer trainers than the group: it detects ``kill`` if it came after it, and
    is one of its steps with fewer trainers if it came before the replacement healed."""
    if n is not None and c.participants >= n:
        return
    if c.time >= kill.time:
        fold.seen(c.time)
        if c.time <= end:
            fold.degraded.add(step)


def _failure(kill: KillRecord, fold: KillFold, end: float, heals: list[tuple[int, Heal]],
             attempt: int) -> TrainerFailure:
    rank = int(kill.target.split(":")[1])
    heal = next((h for a, h in heals if a == attempt and h.rank == rank and h.time >= kill.time), None)
    return TrainerFailure(
        actor=kill.target, cause=kill.trigger, killed_at=kill.time,
        detection_s=round(fold.first_seen - kill.time, 3) if fold.first_seen is not None else None,
        steps_with_fewer_trainers=fold.degraded.count(),
        heal_s=round(heal.heal_s, 3) if heal else None,
        rejoined_s=round(heal.time - kill.time, 3) if heal else None,
        replacement_joined_at_step=heal.step if heal else None,
    )


def read_commits(book: Iterable[dict], prunes: Sequence[tuple[int, int]] = ()) -> dict[int, StepCommit]:
    """Every committed step of the run's final timeline with every microbatch its trainers
    reported, from the book file's records and the journal's prunes: for a check or a tool
    (it holds the whole run; the supervisor keeps a window)."""
    commits: dict[tuple[int, int], StepCommit] = {}
    attempt, pending, seen = 1, sorted(prunes, key=lambda p: p[1]), set()
    for i, record in enumerate(book):
        while pending and pending[0][1] <= i:
            step = pending.pop(0)[0]
            commits = {k: c for k, c in commits.items() if k[0] != attempt or k[1] < step}
        if record["kind"] == "attempt":
            attempt = record["attempt"]
        elif record["kind"] == "commit" and (key := (record["rank"], record.get("pid"), record.get("seq"))) not in seen:
            if record.get("seq") is not None:
                seen.add(key)
            c = commits.get((attempt, record["step"]))
            mbs = (c.microbatches if c else ()) + tuple(record["microbatches"])
            commits[(attempt, record["step"])] = StepCommit(
                mbs, c.total if c else record["total"], c.participants if c else record["participants"],
                c.time if c else record["time"])
    for step, *_ in pending:
        commits = {k: c for k, c in commits.items() if k[0] != attempt or k[1] < step}
    out = {s: dataclasses.replace(c, microbatches=tuple(sorted(c.microbatches)))
           for (_, s), c in sorted(commits.items())}
    return dict(sorted(out.items()))
