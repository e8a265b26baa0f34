"""Which embedding rows a checkpoint saves: all (full), most-frequently-used (MFU), or sampled (SSU).

Policies track a shard's row indices 0..num_rows-1 and turn them into ``SaveSelection`` decisions.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import numpy.typing as npt

from policies._checks import check_int, check_unit_half_open

__all__ = [
    "SaveSelection",
    "PriorityPolicy",
    "FullPolicy",
    "MfuPolicy",
    "SsuPolicy",
    "make_policy",
    "DEFAULT_FULL_EVERY",
    "POLICY_NAMES",
]

DEFAULT_FULL_EVERY = 10
"""Every 10th save (and the first) saves all rows, so a restore replays <= 9 partial saves."""

POLICY_NAMES = ("full", "mfu", "ssu")

# Row ids reach 2**32 (config allows 2**32 rows per table), so the public dtype is int64.
_ROW_DTYPE = np.int64
_INT32_MAX = np.iinfo(np.int32).max


# eq=False: == on numpy arrays is elementwise, so a generated __eq__ would be ambiguous.
@dataclass(frozen=True, eq=False)
class SaveSelection:
    """The rows one checkpoint save writes, and why.

    ``rows`` is a sorted, unique, read-only int64 array; for a full save it is
    every row (callers should test ``full`` first rather than index all rows).
    """

    rows: np.ndarray
    full: bool
    save_index: int
    budget_rows: int
    """Most rows a partial save of this policy may write (ceil(r * num_rows))."""
    candidate_rows: int
    """Rows the policy was tracking (touched / sampled) when it selected."""
    reason: str

    @property
    def num_selected_rows(self) -> int:
        return int(self.rows.shape[0])


def _frozen(rows: np.ndarray) -> np.ndarray:
    rows.flags.writeable = False
    return rows


def _budget_rows(r: float, num_rows: int) -> int:
    # r * num_rows is often a hair above an integer (0.1 * 100_000 ==
    # 10000.000000000002); shave a relative epsilon so ceil does not add a row.
    x = r * num_rows
    return min(num_rows, max(1, math.ceil(x - 1e-9 * x)))


class PriorityPolicy(ABC):
    """Tracks row accesses of one shard and picks the rows each save writes.

    Protocol per save: ``observe`` every training step's accessed ids; at a
    checkpoint call ``select(save_index)`` (no state change), write the rows, then
    ``mark_saved(selection.rows)`` once they are durable. Accesses observed
    between select and mark_saved are forgotten for the saved rows; that is
    harmless because those rows are re-dirtied by their next access.
    """

    name: ClassVar[str]

    def __init__(self, num_rows: int) -> None:
        self.num_rows = check_int("num_rows", num_rows, 1)

    @abstractmethod
    def observe(self, rows: npt.ArrayLike) -> None:
        """Records the row ids accessed in one training step (repeats allowed)."""

    @abstractmethod
    def select(self, save_index: int) -> SaveSelection:
        """The rows save number ``save_index`` (0-based) writes."""

    @abstractmethod
    def mark_saved(self, rows: npt.ArrayLike) -> None:
        """Forgets tracking state of ``rows``, now durable in a checkpoint."""

    @property
    @abstractmethod
    def tracking_bytes(self) -> int:
        """Bytes of persistent tracking state (array storage; per-object overhead ignored)."""

    @property
    def interval_scale(self) -> float:
        """Factor on the full-save interval: a policy saving r of the rows saves 1/r as often."""
        return 1.0

    @property
    def tracked_rows(self) -> int:
        """Rows the policy holds as candidates for the next prioritized save (0: no tracking)."""
        return 0

    def scale_interval_s(self, full_interval_s: float) -> float:
        """Interval for this policy given the interval a full-save schedule would use."""
        return full_interval_s * self.interval_scale

    def select_full(self, save_index: int, reason: str) -> SaveSelection:
        """Every row, whatever the policy would pick (the final checkpoint of a run)."""
        return self._full_selection(_check_save_index(save_index), reason)

    def _full_selection(self, save_index: int, reason: str) -> SaveSelection:
        return SaveSelection(
            rows=_frozen(np.arange(self.num_rows, dtype=_ROW_DTYPE)),
            full=True,
            save_index=save_index,
            budget_rows=self.num_rows,
            candidate_rows=self.num_rows,
            reason=reason,
        )

    def _rows_arg(self, rows: npt.ArrayLike, name: str = "rows") -> np.ndarray:
        arr = np.asarray(rows)
        if arr.size == 0:
            return np.empty(0, dtype=_ROW_DTYPE)
        if arr.dtype.kind not in "iu":
            raise ValueError(
                f"{name} must be integer row ids in [0, {self.num_rows}), got dtype {arr.dtype}"
            )
        arr = arr.reshape(-1)
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi >= self.num_rows:
            raise ValueError(
                f"{name} must be row ids in [0, {self.num_rows}), got values in [{lo}, {hi}]"
            )
        return arr.astype(_ROW_DTYPE, copy=False)


def _check_save_index(save_index: int) -> int:
    return check_int("save_index", save_index, 0)


class FullPolicy(PriorityPolicy):
    """Every save writes every row; nothing is tracked."""

    name = "full"

    def observe(self, rows: npt.ArrayLike) -> None:
        # Nothing to track: skipping even validation keeps the hot path free.
        return None

    def select(self, save_index: int) -> SaveSelection:
        save_index = _check_save_index(save_index)
        return self._full_selection(save_index, f"full policy: all {self.num_rows} rows")

    def mark_saved(self, rows: npt.ArrayLike) -> None:
        return None

    @property
    def tracking_bytes(self) -> int:
        return 0


class _BudgetedPolicy(PriorityPolicy):
    """A policy whose partial saves write at most ceil(r * num_rows) rows, 1/r times as often.

    Save 0 and every ``full_every``-th save after it are full: a restore loads the
    last full save and replays the partial ones after it in order, so the chain
    is at most ``full_every - 1`` partial saves long, and rows that never win a
    partial save still reach the checkpoint within ``full_every`` saves.
    """

    def __init__(self, num_rows: int, r: float, full_every: int = DEFAULT_FULL_EVERY) -> None:
        super().__init__(num_rows)
        self.r = check_unit_half_open("r", r)
        self.full_every = check_int("full_every", full_every, 1)
        self.budget_rows = _budget_rows(self.r, self.num_rows)

    @property
    def interval_scale(self) -> float:
        return self.r

    def select(self, save_index: int) -> SaveSelection:
        save_index = _check_save_index(save_index)
        if save_index % self.full_every == 0:
            return self._full_selection(
                save_index,
                f"{self.name}: full save, save_index {save_index} is a multiple of "
                f"full_every={self.full_every} (restore chains stay <= {self.full_every - 1} partial saves)",
            )
        return self._select_partial(save_index)

    @abstractmethod
    def _select_partial(self, save_index: int) -> SaveSelection: ...


class MfuPolicy(_BudgetedPolicy):
    """Most-frequently-used: saves the rows accessed most since they were last saved.

    One int32 counter per row (saturating at 2**31-1, which still ranks first).
    A partial save takes the ``budget_rows`` highest counts among rows with a
    count > 0; rows untouched since their last save are never chosen, because the
    checkpoint already holds their current value, so a selection may be smaller
    than the budget. Ties at the cut-off go to the lower row id (deterministic).
    """

    name = "mfu"

    def __init__(self, num_rows: int, r: float, full_every: int = DEFAULT_FULL_EVERY) -> None:
        super().__init__(num_rows, r, full_every)
        self._counts = np.zeros(self.num_rows, dtype=np.int32)

    def observe(self, rows: npt.ArrayLike) -> None:
        ids = self._rows_arg(rows)
        if ids.size == 0:
            return
        # unique+counts is O(batch log batch); a bincount would be O(num_rows) per step.
        uniq, hits = np.unique(ids, return_counts=True)
        summed = self._counts[uniq].astype(np.int64) + hits
        self._counts[uniq] = np.minimum(summed, _INT32_MAX)

    def _select_partial(self, save_index: int) -> SaveSelection:
        touched = np.flatnonzero(self._counts)
        k = self.budget_rows
        if touched.size <= k:
            rows = touched.astype(_ROW_DTYPE)
            why = f"all {touched.size} touched rows fit the budget of {k}"
        else:
            counts = self._counts[touched]
            # k-th largest count by partition (O(n)), then every row above it plus
            # the lowest-id rows at it; touched is ascending, so [:need] is lowest ids.
            cut = int(np.partition(counts, touched.size - k)[touched.size - k])
            above = touched[counts > cut]
            at_cut = touched[counts == cut][: k - above.size]
            rows = np.sort(np.concatenate([above, at_cut])).astype(_ROW_DTYPE)
            why = f"top {k} of {touched.size} touched rows by access count (cut-off count {cut})"
        return SaveSelection(
            rows=_frozen(rows),
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


class SsuPolicy(_BudgetedPolicy):
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
        dtype = np.int32 if self.num_rows - 1 <= _INT32_MAX else np.int64
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
        rows = self._members[: self._size].astype(_ROW_DTYPE)
        return SaveSelection(
            rows=_frozen(rows),
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
) -> PriorityPolicy:
    """Builds a policy by name ("full", "mfu", "ssu"); "full" ignores r, sample_rate and seed."""
    if name == "full":
        return FullPolicy(num_rows)
    if name == "mfu":
        return MfuPolicy(num_rows, r, full_every)
    if name == "ssu":
        return SsuPolicy(num_rows, r, sample_rate, seed, full_every)
    raise ValueError(f"name must be one of {', '.join(POLICY_NAMES)}, got {name!r}")
