"""Sharding plans: which embedding shard owns which rows of which table.

A plan is a list of slices ``(table, row_start, row_end)`` per shard. Table-wise plans give
whole tables to shards; row-wise plans cut every table into contiguous row ranges. Both are
routed the same way, and sum pooling makes partial pools of a row-wise table add up.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = [
    "ShardBatch", "ShardingPlan", "TableSlice", "make_plan", "overlapping", "plan_from_json", "plan_to_json",
    "shard_row_ids", "slice_offsets",
]


@dataclass(frozen=True)
class TableSlice:
    """Rows ``[row_start, row_end)`` of table ``table``; local row = global row - row_start."""

    table: int
    row_start: int
    row_end: int

    @property
    def num_rows(self) -> int:
        return self.row_end - self.row_start


@dataclass(frozen=True)
class ShardBatch:
    """The part of a batch one shard sees, in fbgemm's table-major layout.

    lengths: int64 [S, B] ids of sample b in the shard's slice s (0 or 1 for Criteo).
    indices: int64 [sum(lengths)] local row ids, slice-major then sample order.
    """

    lengths: np.ndarray
    indices: np.ndarray

    @property
    def batch_rows(self) -> int:
        return int(self.lengths.shape[1])


@dataclass(frozen=True)
class ShardingPlan:
    """Which rows each shard holds. ``generation`` numbers the plans of one run: a plan that
    replaces another (a resume on another shard count, a move of rows) has the next one."""

    kind: str
    table_rows: tuple[int, ...]
    shards: tuple[tuple[TableSlice, ...], ...]
    generation: int = 0

    @property
    def num_shards(self) -> int:
        return len(self.shards)

    def shard_rows(self, shard: int) -> int:
        return sum(s.num_rows for s in self.shards[shard])

    def shard_fraction(self, shard: int) -> float:
        """Fraction of all embedding rows held by ``shard`` (weights lost samples)."""
        return self.shard_rows(shard) / sum(self.table_rows)

    def slice_tables(self, shard: int) -> np.ndarray:
        return np.array([s.table for s in self.shards[shard]], dtype=np.int64)

    def table_index(self, shard: int) -> slice | np.ndarray:
        """``slice_tables(shard)`` as a slice where the tables are evenly spaced (a table-wise
        plan deals them out in turn): a strided copy, three times faster than a gather."""
        tables = self.slice_tables(shard)
        if tables.size == 1 or (tables.size > 1 and (np.diff(tables) == tables[1] - tables[0]).all() and tables[1] > tables[0]):
            step = int(tables[1] - tables[0]) if tables.size > 1 else 1
            return slice(int(tables[0]), int(tables[-1]) + 1, step)
        return tables


    def route(self, rows: np.ndarray, shard: int) -> ShardBatch:
        """Selects the ids of ``rows`` (int64 [B, F], table rows) that ``shard`` owns."""
        slices = self.shards[shard]
        cols = rows[:, [s.table for s in slices]].T  # [S, B]
        start = np.array([s.row_start for s in slices], dtype=np.int64)[:, None]
        end = np.array([s.row_end for s in slices], dtype=np.int64)[:, None]
        owned = (cols >= start) & (cols < end)
        if owned.all():
            return ShardBatch(np.ones(cols.shape, dtype=np.int64), (cols - start).ravel())
        return ShardBatch(owned.astype(np.int64), (cols - start)[owned])

    def assemble_pooled(self, parts: list[np.ndarray], out: np.ndarray | None = None) -> np.ndarray:
        """The pooled embeddings float32 [B, F, D] from each shard's pooled output [B, S*D]
        (``parts[k]`` from shard k): a table's first part is copied in, the others (row-wise
        partial pools) added. ``out`` float32 [B, F, D] is overwritten when given."""
        batch = parts[0].shape[0]
        num_tables = len(self.table_rows)
        dim = next(p.shape[1] // len(self.shards[k]) for k, p in enumerate(parts) if self.shards[k])
        if out is None:
            out = np.empty((batch, num_tables, dim), dtype=np.float32)
        written = np.zeros(num_tables, dtype=bool)
        for k, part in enumerate(parts):
            tables = self.slice_tables(k)  # a shard holds at most one slice of a table
            p = part.reshape(batch, len(tables), dim)
            fresh = ~written[tables]
            if fresh.all():
                out[:, self.table_index(k), :] = p
            elif not fresh.any():
                out[:, tables, :] += p
            else:
                out[:, tables[fresh], :] = p[:, fresh]
                out[:, tables[~fresh], :] += p[:, ~fresh]
            written[tables] = True
        if not written.all():
            out[:, ~written, :] = 0.0
        return out

    def gather_grad(self, grad: np.ndarray, shard: int, out: np.ndarray | None = None) -> np.ndarray:
        """The gradient a shard needs, float32 [B, S*D], from the pooled gradient [B, F, D]
        (written into ``out`` float32 [B, S*D] when given)."""
        batch, _, dim = grad.shape
        tables = self.slice_tables(shard)
        if out is None:
            out = np.empty((batch, len(tables) * dim), dtype=np.float32)
        index = self.table_index(shard)
        if isinstance(index, slice):
            out.reshape(batch, len(tables), dim)[...] = grad[:, index, :]
        else:
            np.take(grad, tables, axis=1, out=out.reshape(batch, len(tables), dim))
        return out


def slice_offsets(slices) -> np.ndarray:
    """int64 [S+1]: a shard numbers its rows slice after slice; shard row = offset[s] + local row."""
    return np.concatenate([[0], np.cumsum([s.num_rows for s in slices])]).astype(np.int64)


def shard_row_ids(lengths: np.ndarray, indices: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Shard row ids of a ShardBatch's (lengths [S, B], slice-major local indices)."""
    return indices + np.repeat(offsets[:-1], lengths.sum(axis=1))


def make_plan(kind: str, table_rows: list[int], num_shards: int) -> ShardingPlan:
    """Builds a table-wise or row-wise plan that gives every row to exactly one shard.

    Table-wise balances rows greedily (largest table to the least-loaded shard), which is
    what TorchRec's planner does for a memory-bound CPU placement.
    """
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    per_shard: list[list[TableSlice]] = [[] for _ in range(num_shards)]
    if kind == "table_wise":
        if num_shards > len(table_rows):
            raise ValueError(f"table_wise needs num_shards <= {len(table_rows)} tables")
        load = [0] * num_shards
        for t in sorted(range(len(table_rows)), key=lambda t: (-table_rows[t], t)):
            # Ties go to the lowest shard, and a shard without tables is filled first.
            k = min(range(num_shards), key=lambda k: (len(per_shard[k]) > 0, load[k], k))
            per_shard[k].append(TableSlice(t, 0, table_rows[t]))
            load[k] += table_rows[t]
        for k in range(num_shards):
            per_shard[k].sort(key=lambda s: s.table)
    elif kind == "row_wise":
        for t, rows in enumerate(table_rows):
            bounds = np.linspace(0, rows, num_shards + 1).round().astype(np.int64)
            for k in range(num_shards):
                if bounds[k + 1] > bounds[k]:
                    per_shard[k].append(TableSlice(t, int(bounds[k]), int(bounds[k + 1])))
    else:
        raise ValueError(f"sharding must be table_wise or row_wise, got {kind!r}")
    return ShardingPlan(kind, tuple(table_rows), tuple(tuple(s) for s in per_shard))


def plan_to_json(plan: ShardingPlan) -> dict:
    """The plan as a checkpoint's manifest records it: which rows each shard file holds."""
    return {
        "kind": plan.kind,
        "generation": plan.generation,
        "table_rows": list(plan.table_rows),
        "shards": [[[s.table, s.row_start, s.row_end] for s in slices] for slices in plan.shards],
    }


def plan_from_json(doc: dict) -> ShardingPlan:
    """``plan_to_json``'s inverse. Raises ValueError (KeyError, TypeError) on a malformed record."""
    shards = tuple(tuple(TableSlice(int(t), int(a), int(b)) for t, a, b in slices) for slices in doc["shards"])
    return ShardingPlan(str(doc["kind"]), tuple(int(r) for r in doc["table_rows"]), shards, int(doc["generation"]))


def overlapping(plan: ShardingPlan, slices) -> list[int]:
    """The shards of ``plan`` holding any row of ``slices``, ascending."""
    wanted = [(s.table, s.row_start, s.row_end) for s in slices]
    return [k for k, held in enumerate(plan.shards)
            if any(h.table == t and h.row_start < b and a < h.row_end for h in held for t, a, b in wanted)]
