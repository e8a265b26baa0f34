"""Failed checkpoint saves: each one counted, the next try after a backoff instead of at every
step, and ``budgets.max_failed_saves`` on the failures in a row (a commit starts the count
again). The checkpoint coordinator calls it under its timeline lock; training goes on."""

from __future__ import annotations

from collections.abc import Callable

from core.books import SaveFailures
from policies import Budget, FailurePolicy

__all__ = ["FailedSaves", "retry_gap_steps"]

_FIELDS = ("failed_saves", "failed_in_a_row", "longest_failed_in_a_row")


def retry_gap_steps(failed_in_a_row: int) -> int:
    """Steps from a failed save to the next try: 1, 2, 4 ... (the caller caps it at the regular
    interval). Most failures pass (a shard being recovered, a disk that retention or its owner
    frees), so the first retry is at the next step; doubling makes a fault that lasts cost a few
    tries before they settle at one per interval, each of which holds training for a snapshot
    and writes files onto the failing storage; the cap keeps a run whose storage came back no
    less protected than its schedule. With the default budget of 20 in a row, the run stops
    after at least ten intervals without a new checkpoint, for any interval up to 1,024 steps."""
    return 2 ** min(max(failed_in_a_row, 1) - 1, 30)


class FailedSaves:
    def __init__(self, policy: FailurePolicy, fail: Callable[[str], None]):
        self._policy, self._fail = policy, fail
        self.failed_saves = 0  # over the run, every attempt's
        self.failed_in_a_row = 0  # since the last commit, in this attempt: budgets.max_failed_saves
        self.longest_failed_in_a_row = 0
        self._over_budget: str | None = None  # the budget's message, until stop_if_over_budget

    def failed(self, step: int, due: int | None, reason: str) -> dict:
        """A save of ``step`` failed; ``due``: the step the next save is due at by the schedule
        (None: no periodic saves). Returns the event's fields, ``retry_step`` among them: the
        step the next save is due at now."""
        self.failed_saves += 1
        self.failed_in_a_row += 1
        self.longest_failed_in_a_row = max(self.longest_failed_in_a_row, self.failed_in_a_row)
        retry = None if due is None else min(due, step + retry_gap_steps(self.failed_in_a_row))
        self._over_budget = self._policy.exceeded(
            Budget.FAILED_SAVES, self.failed_in_a_row,
            f"{self.failed_in_a_row} checkpoint saves failed in a row, the last of step {step}: {reason}")
        return {"failed_in_a_row": self.failed_in_a_row, "retry_step": retry}

    def committed(self) -> None:
        self.failed_in_a_row = 0

    def stop_if_over_budget(self) -> None:
        """Fails the run if the failures in a row went past their budget. Called outside the
        coordinator's locks: failing persists the books, which a thread holding them may wait for."""
        over, self._over_budget = self._over_budget, None
        if over is not None:
            self._fail(over)

    def view(self) -> SaveFailures:
        return SaveFailures(self.failed_saves, self.longest_failed_in_a_row)

    def doc(self) -> dict:
        return {f: getattr(self, f) for f in _FIELDS}

    def load(self, doc: dict) -> None:
        """The same attempt, after a supervisor restart (a journal without them: none failed)."""
        for f in _FIELDS:
            setattr(self, f, doc.get(f, 0))

    def carry(self, doc: dict) -> None:
        """``--resume``: the earlier attempts' failed saves count in the report; the budget, like
        the other budgets of an attempt, starts again."""
        self.failed_saves = doc.get("failed_saves", 0)
        self.longest_failed_in_a_row = doc.get("longest_failed_in_a_row", 0)
