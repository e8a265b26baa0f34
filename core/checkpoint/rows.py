"""Embedding rows of one shard as a checkpoint holds them: the record, its Arrow layout
(a shard file is one IPC record batch of these columns) and the merge of a restore chain.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from core.errors import CheckpointCorrupt

__all__ = [
    "SCHEMA_NAMES", "ShardRows", "merge_shard_rows", "rows_from_batch", "rows_within", "to_record_batch", "warm_up",
]

SCHEMA_NAMES = ("table", "row", "weights", "momentum")


@dataclass(frozen=True)
class ShardRows:
    """Embedding rows of one shard: row i is ``(tables[i], rows[i])`` with its weights and momentum.

    ``momentum`` is the one float per row that fbgemm's row-wise Adagrad keeps.
    """

    tables: np.ndarray  # int32 [n]
    rows: np.ndarray  # int64 [n], global row id within its table
    weights: np.ndarray  # float32 [n, D]
    momentum: np.ndarray  # float32 [n]

    def __post_init__(self) -> None:
        expected = (
            ("tables", np.int32, 1),
            ("rows", np.int64, 1),
            ("weights", np.float32, 2),
            ("momentum", np.float32, 1),
        )
        for name, dtype, ndim in expected:
            value = getattr(self, name)
            if not isinstance(value, np.ndarray):
                raise TypeError(f"ShardRows.{name} must be a numpy array, got {type(value).__name__}")
            if value.dtype != dtype or value.ndim != ndim:
                raise ValueError(
                    f"ShardRows.{name} must be {np.dtype(dtype).name} with {ndim} dims, "
                    f"got {value.dtype.name} with shape {value.shape}"
                )
        n = len(self.tables)
        if not (len(self.rows) == len(self.weights) == len(self.momentum) == n):
            raise ValueError(
                f"ShardRows lengths differ: tables {n}, rows {len(self.rows)}, "
                f"weights {len(self.weights)}, momentum {len(self.momentum)}"
            )

    def __len__(self) -> int:
        return len(self.tables)

    @property
    def dim(self) -> int:
        return int(self.weights.shape[1])


def to_record_batch(data: ShardRows) -> pa.RecordBatch:
    """The rows as the one record batch of a shard file."""
    # pa.array over contiguous numpy buffers is zero-copy; only a non-contiguous
    # weights view forces one copy.
    flat_weights = np.ascontiguousarray(data.weights).reshape(-1)
    weights = pa.FixedSizeListArray.from_arrays(pa.array(flat_weights), data.dim)
    return pa.record_batch(
        [
            pa.array(np.ascontiguousarray(data.tables)),
            pa.array(np.ascontiguousarray(data.rows)),
            weights,
            pa.array(np.ascontiguousarray(data.momentum)),
        ],
        names=list(SCHEMA_NAMES),
    )


def rows_from_batch(batch: pa.RecordBatch, step: int, name: str) -> ShardRows:
    """The rows a shard file's record batch holds, as read-only views over its buffers."""
    where = f"checkpoint step {step}: file {name}"
    if tuple(batch.schema.names) != SCHEMA_NAMES:
        raise CheckpointCorrupt(f"{where} has columns {batch.schema.names}, expected {list(SCHEMA_NAMES)}")
    weights = batch.column("weights")
    if not pa.types.is_fixed_size_list(weights.type) or weights.type.value_type != pa.float32():
        raise CheckpointCorrupt(f"{where} has weights of type {weights.type}, expected fixed_size_list<float>")
    if any(column.null_count for column in batch.columns) or weights.flatten().null_count:
        raise CheckpointCorrupt(f"{where} has null values")
    dim = weights.type.list_size
    try:
        return ShardRows(
            tables=batch.column("table").to_numpy(zero_copy_only=True),
            rows=batch.column("row").to_numpy(zero_copy_only=True),
            # flatten() honours the array offset, .values would not
            weights=weights.flatten().to_numpy(zero_copy_only=True).reshape(len(weights), dim),
            momentum=batch.column("momentum").to_numpy(zero_copy_only=True),
        )
    except (TypeError, ValueError) as exc:
        raise CheckpointCorrupt(f"{where} has unexpected column types: {exc}") from None


def warm_up() -> None:
    """Runs a tiny shard file through the write and read paths in memory, so the modules
    they pull in lazily (pyarrow.compute, pandas through it: 0.2 s) are loaded ahead of a
    recovery (a warm spare calls it)."""
    data = ShardRows(np.zeros(2, np.int32), np.arange(2, dtype=np.int64), np.zeros((2, 4), np.float32),
                     np.zeros(2, np.float32))
    batch = to_record_batch(data)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, batch.schema) as writer:
        writer.write_batch(batch)
    reader = pa.ipc.open_file(sink.getvalue())
    rows_from_batch(reader.get_batch(0), 0, "warm-up")


def merge_shard_rows(parts: Sequence[ShardRows]) -> ShardRows:
    """Rows of ``parts`` applied in order: a later value wins for the same (table, row).

    The result holds each (table, row) once, sorted by table then row.
    """
    if not parts:
        raise ValueError("merge_shard_rows needs at least one part")
    dims = {part.dim for part in parts}
    if len(dims) > 1:
        raise ValueError(f"cannot merge rows of different embedding dims {sorted(dims)}")
    tables = np.concatenate([p.tables for p in parts])
    rows = np.concatenate([p.rows for p in parts])
    # lexsort is stable, so within one (table, row) the parts stay in application order
    # and the last of each run is the newest value.
    order = np.lexsort((rows, tables))
    sorted_tables, sorted_rows = tables[order], rows[order]
    is_last = np.ones(len(order), dtype=bool)
    is_last[:-1] = (sorted_tables[1:] != sorted_tables[:-1]) | (sorted_rows[1:] != sorted_rows[:-1])
    keep = order[is_last]
    return ShardRows(
        tables=tables[keep],
        rows=rows[keep],
        weights=np.concatenate([p.weights for p in parts])[keep],
        momentum=np.concatenate([p.momentum for p in parts])[keep],
    )



def rows_within(data: ShardRows, slices) -> ShardRows:
    """The rows of ``data`` that fall in ``slices`` (TableSlice: table, [row_start, row_end))."""
    keep = np.zeros(len(data), dtype=bool)
    for s in slices:
        keep |= (data.tables == s.table) & (data.rows >= s.row_start) & (data.rows < s.row_end)
    if keep.all():
        return data
    return ShardRows(data.tables[keep], data.rows[keep], data.weights[keep], data.momentum[keep])
