"""Lost samples recounted from the audit, the data cache and the checkpoint files.

A partially recovered shard generation applied updates its replacement never got back: an
access at step ``t`` to a row whose newest copy in the replacement's chain was saved at a
step ``<= t`` is lost, unless trainers redid step ``t`` (from the redo step on). A lost
access is one sparse feature of one sample: 1/26 of a sample.
"""

from __future__ import annotations

import numpy as np

from verify.replay.data import DataCache
from verify.replay.schedule import Schedule
from verify.store import Store
from verify.timeline import LostSpanSeen

__all__ = ["check_replicas", "rows_per_table", "recount_lost"]


def rows_per_table(model: dict, features: int) -> np.ndarray:
    rows = model["table_rows"]
    rows = np.array([rows] * features if isinstance(rows, int) else rows, dtype=np.int64)
    if model.get("max_ind_range") is not None:
        rows = np.minimum(rows, int(model["max_ind_range"]))
    return rows


def check_replicas(shards: dict, report: dict) -> list[str]:
    """Replica recovery loses nothing: every failure the report says a mirror recovered has no
    lost samples and reloaded nothing, and each shard's audit logs hold one ``why: replica`` load
    per such failure (the mirror's own line, written when it took the shard's place; its step
    count against its predecessor's is ``walk_shard``'s check)."""
    v = []
    claimed: dict[int, int] = {}
    for f in report.get("failures", []):
        if f.get("recovery") != "replica":
            continue
        claimed[f["shard"]] = claimed.get(f["shard"], 0) + 1
        if (f.get("lost_samples") or 0.0) != 0.0 or f.get("bytes_reloaded"):
            v.append(f"shard {f['shard']} generation {f['generation']}: recovered by its mirror, yet the report says "
                     f"{f.get('lost_samples')} lost samples and {f.get('bytes_reloaded')} bytes reloaded")
    for k in sorted(set(claimed) | set(shards)):
        seen = sum(1 for file in shards.get(k, []) for r in file.records
                   if r.get("event") == "load" and r.get("why") == "replica")
        if seen != claimed.get(k, 0):
            v.append(f"shard {k}: the report says its mirror took its place {claimed.get(k, 0)} times, "
                     f"its audit logs {seen}")
    return v


def recount_lost(span: LostSpanSeen, slices: list[list[int]], store: Store, cache: DataCache,
                 schedule: Schedule, model: dict) -> float:
    """Lost samples of one partially recovered generation."""
    redo = span.redo if span.redo is not None else 0
    # Every step from the first it applied to the redo: its last committed step may be missing
    # from its log (a step applies at its commit, when the next step's first request comes).
    steps = list(range(min(span.applied), redo)) if span.applied else []
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
        for mb in span.applied.get(t, range(t * m, t * m + m)):
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
