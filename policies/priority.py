"""Which embedding rows a checkpoint saves: all (full), most-frequently-used (MFU), or sampled (SSU).

Policies track a shard's row indices 0..num_rows-1 and turn them into ``SaveSelection`` decisions
(the decision, the protocol and the budgeted base are in ``policies.priority_base``).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import numpy.typing as npt

from policies._checks import check_int, check_unit_half_open
from policies.priority_base import (
    DEFAULT_FULL_EVERY,
    INT32_MAX,
    ROW_DTYPE,
    BudgetedPolicy,
    PriorityPolicy,
    SaveSelection,
    check_save_index,
    frozen_rows,
)

__all__ = [
    "SaveSelection",
    "PriorityPolicy",
    "FullPolicy",
    "MfuPolicy",
    "SsuPolicy",
    "make_policy",
    "add_ones",
    "DEFAULT_FULL_EVERY",
    "POLICY_NAMES",
]

POLICY_NAMES = ("full", "mfu", "ssu")


class FullPolicy(PriorityPolicy):
    """Every save writes every row; nothing is tracked."""

    name = "full"

    def observe(self, rows: npt.ArrayLike) -> None:
        # Nothing to track: skipping even validation keeps the hot path free.
        return None

    def select(self, save_index: int) -> SaveSelection:
        save_index = check_save_index(save_index)
        return self._full_selection(save_index, f"full policy: all {self.num_rows} rows")

    def mark_saved(self, rows: npt.ArrayLike) -> None:
        return None

    @property
    def tracking_bytes(self) -> int:
        return 0


def add_ones(counts: np.ndarray, ids: np.ndarray) -> None:
    """``counts[i] += 1`` for every ``i`` in ``ids``, repeats included (numpy's add.at; a
    shard passes torch's index_add, 30 times faster on a step's ids)."""
    np.add.at(counts, ids, 1)


class MfuPolicy(BudgetedPolicy):
    """Most-frequently-used: saves the rows accessed most since they were last saved.

    One int32 counter per row (saturating at 2**31-1, which still ranks first).
    A partial save takes the ``budget_rows`` highest counts among rows with a
    count > 0; rows untouched since their last save are never chosen, because the
    checkpoint already holds their current value, so a selection may be smaller
    than the budget. Ties at the cut-off go to the lower row id (deterministic).
    """

    name = "mfu"

    def __init__(self, num_rows: int, r: float, full_every: int = DEFAULT_FULL_EVERY,
                 add: Callable[[np.ndarray, np.ndarray], None] = add_ones) -> None:
        super().__init__(num_rows, r, full_every)
        self._add = add
        self._counts = np.zeros(self.num_rows, dtype=np.int32)
        self._bound = 0  # no count exceeds this (each access adds at most one to one count)

    def observe(self, rows: npt.ArrayLike) -> None:
        ids = self._rows_arg(rows)
        if ids.size == 0:
            return
        if self._bound + ids.size <= INT32_MAX:
            # No count can reach the cap: add in place, O(batch) (a sort-based unique was 20
            # times slower on a step's ids).
            self._add(self._counts, ids)
            self._bound += ids.size
            return
        uniq, hits = np.unique(ids, return_counts=True)
        summed = self._counts[uniq].astype(np.int64) + hits
        self._counts[uniq] = np.minimum(summed, INT32_MAX)  # saturating
        self._bound = int(self._counts.max())

    def _select_partial(self, save_index: int) -> SaveSelection:
        touched = np.flatnonzero(self._counts)
        k = self.budget_rows
        if touched.size <= k:
            rows = touched.astype(ROW_DTYPE)
            why = f"all {touched.size} touched rows fit the budget of {k}"
        else:
            counts = self._counts[touched]
            # k-th largest count by partition (O(n)), then every row above it plus
            # the lowest-id rows at it; touched is ascending, so [:need] is lowest ids.
            cut = int(np.partition(counts, touched.size - k)[touched.size - k])
            above = touched[counts > cut]
            at_cut = touched[counts == cut][: k - above.size]
            rows = np.sort(np.concatenate([above, at_cut])).astype(ROW_DTYPE)
            why = f"top {k} of {touched.size} touched rows by access count (cut-off count {cut})"
        return SaveSelection(
            rows=frozen_rows(rows),
            full=False,
            save_index=save_index,
            budget_rows=k,
            candidate_rows=int(touched.size),
            reason=f"mfu: {why}; r={self.r:g}",
        )

    def mark_saved(self, rows: npt.ArrayLike) -> None:
        ids = self._rows_arg(rows)
        self._counts[ids] = 0

    @property
    def tracking_bytes(self) -> int:
        return int(self._counts.nbytes)

    @property
    def tracked_rows(self) -> int:
        return int(np.count_nonzero(self._counts))

    def access_count(self, rows: npt.ArrayLike) -> np.ndarray:
        """Counts since last save of ``rows`` (a copy; for tests and diagnostics)."""
        return self._counts[self._rows_arg(rows)].astype(np.int64)


class SsuPolicy(BudgetedPolicy):
    """Sub-sampled-used: saves a bounded random sample of the rows accessed since last saved.

    Each access is sampled with probability ``sample_rate`` (seeded RNG). A sampled
    row already in the set is ignored; a new row is an "offer". The set holds at
    most ``budget_rows`` rows: offers fill it, and once it is full the n-th offer
    replaces a uniformly random member with probability capacity/n (reservoir
    sampling, Algorithm R), so the set stays a uniform sample of the offers.
    Hot rows are sampled early and re-offered soon after an eviction, so the set
    leans towards them without per-row counters. State is one sorted array of
    ``budget_rows`` row ids (int32 where ids fit), i.e. memory bounded by the
    capacity, not by num_rows; membership tests binary-search it.
    """

    name = "ssu"

    def __init__(
        self,
        num_rows: int,
        r: float,
        sample_rate: float,
        seed: int,
        full_every: int = DEFAULT_FULL_EVERY,
    ) -> None:
        super().__init__(num_rows, r, full_every)
        self.sample_rate = check_unit_half_open("sample_rate", sample_rate)
        self.seed = check_int("seed", seed, 0)
        self._rng = np.random.default_rng(self.seed)
        dtype = np.int32 if self.num_rows - 1 <= INT32_MAX else np.int64
        self._members = np.empty(self.budget_rows, dtype=dtype)
        self._size = 0
        self._offers = 0  # offers since the set was last emptied (Algorithm R's n)

    @property
    def capacity_rows(self) -> int:
        return self.budget_rows

    @property
    def sampled_rows(self) -> int:
        return self._size

    @property
    def tracked_rows(self) -> int:
        return self._size

    def _contains(self, cand: np.ndarray) -> np.ndarray:
        members = self._members[: self._size]
        if self._size == 0:
            return np.zeros(cand.shape, dtype=bool)
        pos = np.searchsorted(members, cand)
        return members[np.minimum(pos, self._size - 1)] == cand

    def observe(self, rows: npt.ArrayLike) -> None:
        ids = self._rows_arg(rows)
        if ids.size == 0:
            return
        if self.sample_rate < 1.0:
            ids = ids[self._rng.random(ids.size) < self.sample_rate]
        cand = np.unique(ids)
        new = cand[~self._contains(cand)]
        if new.size == 0:
            return
        # Offers within one step have no order; shuffle so that acceptance odds,
        # which fall with the offer number, do not favour low row ids.
        new = self._rng.permutation(new)
        cap = self.budget_rows
        fill = new[: cap - self._size]
        rest = new[fill.size :]
        slots = np.concatenate([self._members[: self._size], np.sort(fill).astype(self._members.dtype)])
        offers_before = self._offers + fill.size
        self._offers += new.size
        replaced = False
        if rest.size:
            n = offers_before + np.arange(1, rest.size + 1, dtype=np.float64)
            accepted = rest[self._rng.random(rest.size) < cap / n]
            if accepted.size:
                targets = self._rng.integers(0, cap, size=accepted.size)
                # Sequential semantics: a later offer may evict an earlier one in the
                # same slot, so only the last write per slot counts.
                _, last_rev = np.unique(targets[::-1], return_index=True)
                last = accepted.size - 1 - last_rev
                slots[targets[last]] = accepted[last]
                replaced = True
        # Two sorted runs merge in linear time with the stable (timsort) kind.
        slots = np.sort(slots, kind="quicksort" if replaced else "stable")
        self._members[: slots.size] = slots
        self._size = int(slots.size)

    def _select_partial(self, save_index: int) -> SaveSelection:
        rows = self._members[: self._size].astype(ROW_DTYPE)
        return SaveSelection(
            rows=frozen_rows(rows),
            full=False,
            save_index=save_index,
            budget_rows=self.budget_rows,
            candidate_rows=self._size,
            reason=(
                f"ssu: {self._size} sampled rows (capacity {self.budget_rows}, "
                f"sample_rate {self.sample_rate:g}, {self._offers} offers); r={self.r:g}"
            ),
        )

    def mark_saved(self, rows: npt.ArrayLike) -> None:
        ids = self._rows_arg(rows)
        if self._size == 0 or ids.size == 0:
            return
        members = self._members[: self._size]
        keep = members[~np.isin(members, ids)]
        self._members[: keep.size] = keep
        self._size = int(keep.size)
        # The survivors start a new reservoir window, as if they were its first offers.
        self._offers = self._size

    @property
    def tracking_bytes(self) -> int:
        return int(self._members.nbytes)


def make_policy(
    name: str,
    num_rows: int,
    r: float,
    sample_rate: float,
    seed: int,
    full_every: int = DEFAULT_FULL_EVERY,
    add: Callable[[np.ndarray, np.ndarray], None] = add_ones,
) -> PriorityPolicy:
    """Builds a policy by name ("full", "mfu", "ssu"); "full" ignores r, sample_rate and seed;
    ``add``: how MFU adds a step's accesses to its counts (``add_ones``)."""
    if name == "full":
        return FullPolicy(num_rows)
    if name == "mfu":
        return MfuPolicy(num_rows, r, full_every, add)
    if name == "ssu":
        return SsuPolicy(num_rows, r, sample_rate, seed, full_every)
    raise ValueError(f"name must be one of {', '.join(POLICY_NAMES)}, got {name!r}")
