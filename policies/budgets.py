"""One failure policy owns every failure budget of a run (like Ray Train's
``DefaultFailurePolicy``): which budget, how many failures so far, its limit, and one message
format for all of them: ``budgets.max_step_redos: 21 (max 20)``."""

from __future__ import annotations

from dataclasses import dataclass, fields
from enum import Enum

from policies._checks import check_int

__all__ = ["Budget", "BudgetLimits", "BudgetCheck", "FailurePolicy", "NO_LIMIT"]

NO_LIMIT = -1


class Budget(str, Enum):
    """A kind of failure a run takes only so many of; the value names its ``BudgetLimits`` field."""

    SHARD_RECOVERIES = "max_shard_recoveries"
    """Embedding-shard deaths recovered in the run."""
    STEP_REDOS = "max_step_redos"
    """Failures of one training step before it commits."""
    SUPERVISOR_RESTARTS = "max_supervisor_restarts"
    """Restarts of the supervisor actor."""
    EXECUTOR_ERRORS = "max_executor_errors"
    """Failed attempts of one recovery: an error, or a replacement shard that did not answer
    (killed and respawned)."""
    TRAINER_FAILURES = "max_trainer_failures"
    """Trainer deaths Ray Train replaces, and restarts of the whole trainer group."""
    FAILED_SAVES = "max_failed_saves"
    """Checkpoint saves that failed in a row (a commit starts the count again)."""


def _limit(name: str, value: int) -> int:
    # isinstance(int), not numbers.Integral: a limit comes from the config, where a numpy
    # integer (or a bool, an int subclass) would be a bug, not a count.
    if isinstance(value, bool) or not isinstance(value, int) or value < NO_LIMIT:
        raise ValueError(f"{name} must be an integer >= {NO_LIMIT} ({NO_LIMIT}: no limit), got {value!r}")
    return value


@dataclass(frozen=True)
class BudgetLimits:
    """The most failures of each kind a run takes (-1: no limit)."""

    max_shard_recoveries: int = 100
    max_step_redos: int = 20
    max_supervisor_restarts: int = 20
    max_executor_errors: int = 5
    max_trainer_failures: int = 20
    max_failed_saves: int = 20

    def __post_init__(self) -> None:
        for f in fields(self):
            _limit(f.name, getattr(self, f.name))


@dataclass(frozen=True)
class BudgetCheck:
    """One budget's count against its limit, and the message a run fails with past it."""

    budget: Budget
    count: int
    """Failures so far, this one included."""
    limit: int
    """-1: no limit."""

    def __post_init__(self) -> None:
        check_int("count", self.count, 0)
        _limit("limit", self.limit)

    @property
    def exceeded(self) -> bool:
        # count == limit is the last failure the budget allows; the next one is over it.
        return self.limit != NO_LIMIT and self.count > self.limit

    def message(self, detail: str = "") -> str:
        limit = "no limit" if self.limit == NO_LIMIT else f"max {self.limit}"
        return f"budgets.{self.budget.value}: {self.count} ({limit})" + (f": {detail}" if detail else "")


class FailurePolicy:
    """The one owner of every failure budget (like Ray Train's DefaultFailurePolicy)."""

    def __init__(self, limits: BudgetLimits) -> None:
        self.limits = limits

    def limit(self, budget: Budget) -> int:
        return getattr(self.limits, _budget(budget).value)

    def check(self, budget: Budget, count: int) -> BudgetCheck:
        return BudgetCheck(_budget(budget), count, self.limit(budget))

    def exceeded(self, budget: Budget, count: int, detail: str = "") -> str | None:
        """The message when ``count`` failures exceed the budget, else None."""
        check = self.check(budget, count)
        return check.message(detail) if check.exceeded else None


def _budget(budget: Budget | str) -> Budget:
    try:
        return Budget(budget)
    except ValueError:
        allowed = ", ".join(b.value for b in Budget)
        raise ValueError(f"budget must be one of {allowed}, got {budget!r}") from None
