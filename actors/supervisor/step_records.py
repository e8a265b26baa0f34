"""What the trainers reported of their steps, as the trainer book keeps it: every committed
step, failed step and heal, per attempt of the run (``--resume`` starts a new one), each
report counted once however often Ray delivers it (a call retried across a supervisor restart),
and the rollbacks that abandoned committed steps. The book file (``trainer_book.jsonl``) holds
the commits and failed steps in the order they came; a replay rebuilds the same records."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from core.accounting import trainer_failures
from core.books import KillRecord, StepCommit, TrainerFailure
from core.codec import decode, encode
from core.journal import AppendLog
from core.records import CommitRecord, Heal, StepFailure

__all__ = ["StepRecords"]

_SEEN_WINDOW = 4096  # report numbers remembered per trainer process (a retry comes within seconds)


@dataclass
class _Commit:
    microbatches: list[int] = field(default_factory=list)
    total: int = 0
    participants: int = 0
    time: float = 0.0


class StepRecords:
    """Not thread-safe on its own: the trainer book holds its lock around every call."""

    def __init__(self, book: AppendLog):
        self._book = book
        self.attempt = 1
        self.attempt_starts: list[float] = []  # wall time each attempt after the first began (for the report)
        self._commits: dict[tuple[int, int], _Commit] = {}  # (attempt, step) -> the step's commit
        self._failed: list[tuple[int, StepFailure]] = []
        self.heals: list[tuple[int, Heal]] = []
        self._redos: dict[int, dict[int, int]] = {}  # this attempt: step -> rank -> failures
        self._broken: set[tuple[int, int]] = set()  # (quorum id, step) whose all-reduce failed somewhere
        self._seen: dict[tuple[int, int], set[int]] = {}  # (rank, pid) -> report numbers counted
        self._records = 0  # records in the book file: where a rollback's prune applies on a replay
        self.prunes: list[tuple[int, int]] = []  # (step, records before it) of every rollback

    # ------------------------------------------------------------------ reports

    def fresh(self, rank: int, pid: int | None, seq: int | None) -> bool:
        """False for a report already counted."""
        if pid is None or seq is None:
            return True
        seen = self._seen.setdefault((rank, pid), set())
        if seq in seen:
            return False
        seen.add(seq)
        if len(seen) > _SEEN_WINDOW:
            seen.discard(min(seen))
        return True

    def commit(self, c: CommitRecord) -> bool:
        """False if it was counted already."""
        if not self.fresh(c.rank, c.pid, c.seq):
            return False
        self._add_commit(self.attempt, c)
        self._append({"kind": "commit", **encode(c)})
        return True

    def _add_commit(self, attempt: int, c: CommitRecord) -> None:
        entry = self._commits.setdefault((attempt, c.step), _Commit(total=c.total, participants=c.participants,
                                                                    time=c.time))
        entry.microbatches.extend(c.microbatches)

    def step_failed(self, f: StepFailure) -> int | None:
        """The step's failures so far on the trainer that failed most (the redo budget's
        count); None if it was counted already."""
        if not self.fresh(f.rank, f.pid, f.seq):
            return None
        redos = self._add_failure(self.attempt, f)
        self._append({"kind": "failed", **encode(f)})
        return redos

    def _add_failure(self, attempt: int, f: StepFailure) -> int:
        self._failed.append((attempt, f))
        if f.broken_quorum is not None:
            self._broken.add((f.broken_quorum, f.step))
        per_rank = self._redos.setdefault(f.step, {})
        per_rank[f.rank] = per_rank.get(f.rank, 0) + 1
        return max(per_rank.values())

    def heal(self, h: Heal) -> None:
        self.heals.append((self.attempt, h))

    def broken(self, quorum: int, step: int) -> bool:
        return (quorum, step) in self._broken

    def prune(self, step: int) -> None:
        """Everything went back to ``step``: this attempt's commits from there on belong to an
        abandoned timeline. Journaled with the rollback (where in the book it applies)."""
        self._prune(self.attempt, step)
        self.prunes.append((step, self._records))

    def _prune(self, attempt: int, step: int) -> None:
        self._commits = {k: c for k, c in self._commits.items() if k[0] != attempt or k[1] < step}

    def begin_attempt(self, wall_time: float) -> None:
        self.attempt += 1
        self.attempt_starts.append(wall_time)
        self._redos, self._broken = {}, set()
        self._append({"kind": "attempt", "attempt": self.attempt})

    def _append(self, record: dict) -> None:
        self._book.append(record)
        self._records += 1

    # ------------------------------------------------------------------ views

    def failures(self, kills: Sequence[KillRecord], num_trainers: int) -> list[TrainerFailure]:
        """One record per killed trainer, matched with the commits, failed steps and heals of
        its own attempt (a kill belongs to the attempt it came in, by the report's clock)."""
        starts = [float("-inf"), *self.attempt_starts, float("inf")]
        out = []
        for a in range(1, self.attempt + 1):
            commits = {s: StepCommit(tuple(c.microbatches), c.total, c.participants, c.time)
                       for (ca, s), c in self._commits.items() if ca == a}
            mine = [k for k in kills if starts[a - 1] <= k.time < starts[a]]
            out += trainer_failures(mine, [f for fa, f in self._failed if fa == a], commits,
                                    [h for ha, h in self.heals if ha == a], num_trainers)
        return out

    def commits(self) -> dict[int, StepCommit]:
        """Every committed step of the run's final timeline (a later attempt's commit of a step
        replaces an earlier attempt's)."""
        out = {}
        for (_, s), c in sorted(self._commits.items()):
            out[s] = StepCommit(tuple(sorted(c.microbatches)), c.total, c.participants, c.time)
        return dict(sorted(out.items()))

    def last_step(self) -> int | None:
        """The last step committed in this attempt."""
        steps = [s for a, s in self._commits if a == self.attempt]
        return max(steps) if steps else None

    def committed_since(self, step: int) -> bool:
        return any(a == self.attempt and s >= step for a, s in self._commits)

    # ------------------------------------------------------------------ journal

    def doc(self) -> dict:
        return {"heals": [{"attempt": a, **encode(h)} for a, h in self.heals], "attempt": self.attempt,
                "attempt_starts": self.attempt_starts, "prunes": self.prunes}

    def load(self, doc: dict, book: list[dict], history_only: bool) -> None:
        """The journaled part and the book's records in order, each rollback's prune where it
        came. An earlier attempt's failed steps are history (``history_only``: a resumed run):
        they count in the report, not in this attempt's redo budget."""
        self.heals = [(h.pop("attempt", 1), decode(Heal, h)) for h in map(dict, doc["heals"])]
        self.attempt_starts = list(doc.get("attempt_starts", []))
        prunes = [tuple(p) for p in doc.get("prunes", [])]
        attempt, pending = 1, sorted(prunes, key=lambda p: p[1])
        for i, record in enumerate(book):
            while pending and pending[0][1] <= i:
                self._prune(attempt, pending.pop(0)[0])
            kind = record.pop("kind")
            if kind == "attempt":
                attempt = record["attempt"]
                self._redos, self._broken = {}, set()
            elif kind == "commit":
                c = decode(CommitRecord, record)
                if self.fresh(c.rank, c.pid, c.seq):
                    self._add_commit(attempt, c)
            elif kind == "failed":
                f = decode(StepFailure, record)
                if self.fresh(f.rank, f.pid, f.seq):
                    self._add_failure(attempt, f)
            elif kind == "pruned":  # the books of an earlier version wrote prunes here
                self._prune(attempt, record["step"])
        for step, _ in pending:
            self._prune(attempt, step)
        self.attempt, self._records, self.prunes = attempt, len(book), list(prunes)
        if history_only:
            self._redos, self._broken = {}, set()
