"""Lost samples recounted from the audit, the data cache and the checkpoint files.

A partially recovered shard generation applied updates its replacement never got back: an
access at step ``t`` to a row whose newest copy in the replacement's chain was saved at a
step ``<= t`` is lost, unless trainers redid step ``t`` (from the redo step on). A lost
access is one sparse feature of one sample: 1/26 of a sample.
"""

from __future__ import annotations

import numpy as np

from core.schedule import StepSchedule
from core.store import MicrobatchStore
from verify.store import Store
from verify.timeline import LostSpanSeen

__all__ = ["DataCache", "rows_per_table", "recount_lost"]


class DataCache:
    """The training data's microbatch store as written (any ``pyarrow.fs`` URI): microbatch
    ``i`` and its table rows."""

    def __init__(self, uri: str):
        self._store = MicrobatchStore(uri, 0)

    def __len__(self) -> int:
        return len(self._store)

    def sparse(self, i: int) -> np.ndarray:
        return self._store.get(i)[2]


def rows_per_table(model: dict, features: int) -> np.ndarray:
    rows = model["table_rows"]
    rows = np.array([rows] * features if isinstance(rows, int) else rows, dtype=np.int64)
    if model.get("max_ind_range") is not None:
        rows = np.minimum(rows, int(model["max_ind_range"]))
    return rows


def recount_lost(span: LostSpanSeen, slices: list[list[int]], store: Store, cache: DataCache,
                 schedule: StepSchedule, model: dict) -> float:
    """Lost samples of one partially recovered generation."""
    redo = span.redo if span.redo is not None else 0
    steps = sorted(t for t in span.applied if t < redo)
    base = span.chain[0] if span.chain else 0
    if not steps or (span.chain and redo <= base):
        return 0.0  # every row was saved at or after the redo step: nothing the dead one held is lost
    saved_at = {table: np.full(end - start, base, dtype=np.int64) for table, start, end in slices}
    start_of = {table: start for table, start, _ in slices}
    for step in span.chain[1:]:
        tables, rows = store.shard_rows(step, span.shard)
        for table, start, end in slices:
            mine = rows[(tables == table) & (rows >= start) & (rows < end)]
            saved_at[table][mine - start] = step
    m = schedule.microbatches_per_step
    lost, table_rows = 0, None
    for t in steps:
        for mb in span.applied[t]:
            step, pos = divmod(mb, m)
            sparse = cache.sparse(schedule.microbatch(step, pos))
            if table_rows is None:
                table_rows = rows_per_table(model, sparse.shape[1])
            rows = sparse.astype(np.int64) % table_rows
            for table, _, end in slices:
                col = rows[:, table]
                col = col[(col >= start_of[table]) & (col < end)]
                lost += int((saved_at[table][col - start_of[table]] <= t).sum())
    return lost / len(table_rows)
