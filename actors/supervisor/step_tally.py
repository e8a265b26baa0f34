"""What the trainer book keeps of steps that left its window, in a size that grows with the
run's failures, not its steps: sets of steps as ranges (a run commits its steps in order, so
an attempt's committed steps are one range, its steps with fewer trainers one per outage),
the distinct microbatch totals, and per trainer kill when the survivors first acted on it."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

__all__ = ["StepRanges", "AttemptTally", "KillFold", "final_tally"]


class StepRanges:
    """A set of steps as sorted, disjoint, non-adjacent inclusive ranges."""

    def __init__(self, ranges: list[list[int]] | None = None):
        self._starts: list[int] = [a for a, _ in ranges or []]
        self._ends: list[int] = [b for _, b in ranges or []]

    def add(self, step: int) -> None:
        i = bisect.bisect_right(self._starts, step)
        if i > 0 and self._ends[i - 1] >= step:
            return
        left = i > 0 and self._ends[i - 1] == step - 1
        right = i < len(self._starts) and self._starts[i] == step + 1
        if left and right:
            self._ends[i - 1] = self._ends[i]
            del self._starts[i], self._ends[i]
        elif left:
            self._ends[i - 1] = step
        elif right:
            self._starts[i] = step
        else:
            self._starts.insert(i, step)
            self._ends.insert(i, step)

    def add_range(self, first: int, last: int) -> None:
        """Adds ``first..last`` (a union of two sets, range by range)."""
        lo = bisect.bisect_left(self._ends, first - 1)
        hi = bisect.bisect_right(self._starts, last + 1)
        if lo < hi:
            first, last = min(first, self._starts[lo]), max(last, self._ends[hi - 1])
        self._starts[lo:hi], self._ends[lo:hi] = [first], [last]

    def cut(self, step: int) -> None:
        """Drops every step from ``step`` on."""
        i = bisect.bisect_left(self._starts, step)
        del self._starts[i:], self._ends[i:]
        if self._ends and self._ends[-1] >= step:
            self._ends[-1] = step - 1

    def count(self) -> int:
        return sum(b - a + 1 for a, b in zip(self._starts, self._ends))

    def count_outside(self, other: StepRanges) -> int:
        """Steps of this set that ``other`` does not hold."""
        overlap, j = 0, 0
        for a, b in zip(self._starts, self._ends):
            while j < len(other._starts) and other._ends[j] < a:
                j += 1
            k = j
            while k < len(other._starts) and other._starts[k] <= b:
                overlap += min(b, other._ends[k]) - max(a, other._starts[k]) + 1
                k += 1
        return self.count() - overlap

    def last(self) -> int | None:
        return self._ends[-1] if self._ends else None

    def ranges(self) -> list[list[int]]:
        return [[a, b] for a, b in zip(self._starts, self._ends)]

    def copy(self) -> StepRanges:
        return StepRanges(self.ranges())

    def __len__(self) -> int:
        return len(self._starts)


@dataclass
class AttemptTally:
    """One attempt's committed steps, those committed by fewer trainers than the group, and
    the microbatch totals their all-reduces summed."""

    committed: StepRanges = field(default_factory=StepRanges)
    degraded: StepRanges = field(default_factory=StepRanges)
    totals: set[int] = field(default_factory=set)

    def cut(self, step: int) -> None:
        self.committed.cut(step)
        self.degraded.cut(step)


@dataclass
class KillFold:
    """A trainer kill's part of the steps that left the window: when the survivors first acted
    on it (a failed step or a smaller quorum's commit) and the steps committed without it."""

    attempt: int
    first_seen: float | None = None
    degraded: StepRanges = field(default_factory=StepRanges)

    def seen(self, t: float) -> None:
        self.first_seen = t if self.first_seen is None else min(self.first_seen, t)

    def copy(self) -> KillFold:
        return KillFold(self.attempt, self.first_seen, self.degraded.copy())


def final_tally(tallies: list[AttemptTally]) -> tuple[int, tuple[int, ...], int]:
    """(steps, distinct microbatch totals, steps with fewer trainers) over the run's final
    timeline: a later attempt's commit of a step replaces an earlier attempt's."""
    later, degraded, steps, totals = StepRanges(), 0, 0, set()
    for tally in reversed(tallies):
        degraded += tally.degraded.count_outside(later)
        for a, b in tally.committed.ranges():
            later.add_range(a, b)
        totals |= tally.totals
        last = tally.committed.last()
        steps = max(steps, last + 1 if last is not None else 0)
    return steps, tuple(sorted(totals)), degraded
