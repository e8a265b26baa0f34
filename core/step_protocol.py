"""The step protocol's identities and its one decision per try, as pure data and a pure ledger
(``docs/ARCHITECTURE.md``, "The step protocol").

A try of a step is ``StepId(generation, step, attempt)``: the fleet generation the trainers
train on, the step, and the attempt, counted from 0 per step and generation. Trainers carry it
in every lookup and push, the shards keep it with the step's chunks and in their audit logs,
and a shard applies a step only on an explicit commit naming that try.

The ledger (kept by the supervisor's trainer book, journaled there) decides each try once: the
first vote of a try decides it (a trainer's all-reduce completed with no failure anywhere:
commit; anything else: abort), and every later vote of it gets the same answer, so a trainer
that did not see the sum (it walked away from a broken group) cannot contradict a trainer
that committed. It also answers what a trainer's next try is, the last committed try (what the
shards are told to apply), and whether a heal may carry a dense model to a step."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["StepId", "Vote", "Decision", "StepStart", "StepLedger"]

_KEPT_STEPS = 64  # decided steps the ledger remembers below the newest (a late vote comes within seconds)


@dataclass(frozen=True, order=True)
class StepId:
    generation: int
    step: int
    attempt: int

    def __str__(self) -> str:
        return f"step {self.step} (generation {self.generation}, attempt {self.attempt})"


@dataclass(frozen=True)
class Vote:
    """Trainer ``rank``'s vote on try ``step``: ``ok`` when its all-reduce completed and summed no
    failure (every trainer of the quorum looked up, computed and pushed its share).
    ``broken_quorum``: the quorum whose group failed here (its peers stop waiting at once)."""

    step: StepId
    rank: int
    ok: bool
    broken_quorum: int | None = None


@dataclass(frozen=True)
class Decision:
    """The one decision of try ``step``; ``next``: the voter's next try (the next step's first
    after a commit, this step's next attempt after an abort); ``committed``: the newest committed
    try, which the next lookups name to the shards; ``rejoin``: the voter's dense model is not at the
    run's committed steps (it stalled while the others trained on, or it trained on an abandoned
    timeline): it must not redo this step but start again from the checkpoint."""

    step: StepId
    commit: bool
    next: StepId
    committed: StepId | None
    rejoin: bool = False


@dataclass(frozen=True)
class StepStart:
    """What a trainer that did not vote on the previous try (a first step, a heal, a rollback, a
    new fleet) is told at its quorum: its try, the newest committed one, and, after a heal,
    whether the heal is allowed (not past what the run committed since its last rollback)."""

    step: StepId
    committed: StepId | None
    heal_allowed: bool = True


class StepLedger:
    """Pure; the trainer book holds its lock around every call and journals each new decision."""

    def __init__(self, committed_steps: int | None = None):
        self._tries: dict[tuple[int, int], dict[int, bool]] = {}  # (generation, step) -> attempt -> commit
        self._next: dict[tuple[int, int], int] = {}  # (generation, step) -> the next attempt
        self.committed: StepId | None = None  # the newest committed try
        self._floor: tuple[int, int, int] | None = None  # the last rollback: (generation, step, first new attempt)
        # Steps the run holds committed (its dense state and the shards): None until known
        # (a new attempt of the run learns it from its first commit).
        self._steps = committed_steps

    def committed_steps(self) -> int | None:
        return self._steps

    def vote(self, v: Vote) -> tuple[Decision, bool]:
        """The decision of ``v``'s try, and whether this vote made it (the caller journals it)."""
        s = v.step
        key = (s.generation, s.step)
        tries = self._tries.setdefault(key, {})
        new = s.attempt not in tries
        if new:
            # A step commits once, at the run's committed steps: never a step committed already
            # (a stalled trainer's redo) nor one past them (a dense model healed past a rollback),
            # nor a try that began before the last rollback (its first vote came late).
            tries[s.attempt] = v.ok and (self._steps is None or s.step == self._steps) and not self._abandoned(s)
            self._next[key] = max(self._next.get(key, 0), s.attempt + 1)
            if tries[s.attempt]:
                self.committed = s  # always the newest: a commit lands at the run's committed steps
                self._steps = s.step + 1
            self._forget(s.step)
        commit = tries[s.attempt]
        rejoin = not commit and self._steps is not None and s.step != self._steps
        nxt = StepId(s.generation, s.step + 1, 0) if commit else StepId(s.generation, s.step, self._next[key])
        return Decision(s, commit, nxt, self.committed, rejoin=rejoin), new

    def start(self, generation: int, step: int, healed: bool = False) -> StepStart:
        """The try a trainer starts at ``step`` of ``generation``: the step's next attempt. After a
        heal to ``step``, refused if the run has not committed ``step`` steps since its last
        rollback: the dense model would be past the shards (healed from a peer still on the
        abandoned timeline)."""
        attempt = self._next.get((generation, step), 0)
        allowed = not healed or self._steps is None or step <= self._steps
        return StepStart(StepId(generation, step, attempt), self.committed, allowed)

    def rolled_back(self, step: int, generation: int | None = None) -> None:
        """Everything went back to ``step`` committed steps; the trainers start again in fleet
        ``generation``. The tries of later steps belong to an abandoned timeline: those decided
        stay, aborted (a vote of one still on its way gets "abort", not a fresh decision on the
        new timeline), a first vote of one from before the rollback aborts it, and a new try of
        ``step`` gets an attempt number none of them had. Nothing is pending on the reloaded
        shards: no committed try is named to them."""
        for (_, st), tries in self._tries.items():
            if st >= step:
                tries.update(dict.fromkeys(tries, False))
        if generation is not None:
            key = (generation, step)
            self._next[key] = self._next.get(key, 0) + 1
            self._floor = (generation, step, self._next[key])
        self.committed = None
        self._steps = step

    def _abandoned(self, s: StepId) -> bool:
        """Whether try ``s`` began before the last rollback: of an older generation, or of the
        rollback's own step and generation with an attempt handed out before it. (A later step's
        try of that generation from before the rollback cannot commit: the run's committed steps
        went back to the rollback's step, below it.)"""
        if self._floor is None or s.step < self._floor[1]:
            return False
        generation, step, first = self._floor
        return s.generation < generation or (s.generation == generation and s.step == step and s.attempt < first)

    def _forget(self, newest: int) -> None:
        for key in [k for k in self._tries if k[1] < newest - _KEPT_STEPS]:
            del self._tries[key]
            self._next.pop(key, None)

    def sizes(self) -> int:
        return len(self._tries)
