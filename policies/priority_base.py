"""What every row-priority policy shares: the ``SaveSelection`` decision, the ``PriorityPolicy``
protocol and ``BudgetedPolicy``, the base of the partial-save policies (MFU, SSU).
The policies themselves are in ``policies.priority``, which re-exports the public names."""

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
    "BudgetedPolicy",
    "DEFAULT_FULL_EVERY",
    "ROW_DTYPE",
    "INT32_MAX",
    "frozen_rows",
    "check_save_index",
]

DEFAULT_FULL_EVERY = 10
"""Every 10th save (and the first) saves all rows, so a restore replays <= 9 partial saves."""

# Row ids reach 2**32 (config allows 2**32 rows per table), so the public dtype is int64.
ROW_DTYPE = np.int64
INT32_MAX = np.iinfo(np.int32).max


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


def frozen_rows(rows: np.ndarray) -> np.ndarray:
    """``rows``, made read-only in place (a selection must not change after it is made)."""
    rows.flags.writeable = False
    return rows


def check_save_index(save_index: int) -> int:
    return check_int("save_index", save_index, 0)


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
        return self._full_selection(check_save_index(save_index), reason)

    def _full_selection(self, save_index: int, reason: str) -> SaveSelection:
        return SaveSelection(
            rows=frozen_rows(np.arange(self.num_rows, dtype=ROW_DTYPE)),
            full=True,
            save_index=save_index,
            budget_rows=self.num_rows,
            candidate_rows=self.num_rows,
            reason=reason,
        )

    def _rows_arg(self, rows: npt.ArrayLike, name: str = "rows") -> np.ndarray:
        arr = np.asarray(rows)
        if arr.size == 0:
            return np.empty(0, dtype=ROW_DTYPE)
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
        return arr.astype(ROW_DTYPE, copy=False)


class BudgetedPolicy(PriorityPolicy):
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
        save_index = check_save_index(save_index)
        if save_index % self.full_every == 0:
            return self._full_selection(
                save_index,
                f"{self.name}: full save, save_index {save_index} is a multiple of "
                f"full_every={self.full_every} (restore chains stay <= {self.full_every - 1} partial saves)",
            )
        return self._select_partial(save_index)

    @abstractmethod
    def _select_partial(self, save_index: int) -> SaveSelection: ...
