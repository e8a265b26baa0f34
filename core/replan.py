"""The plan that follows another when the shard count changes, and the rows that must move.

A live run that goes on with fewer shards (after a loss) or more (a scale-up) needs a new
``ShardingPlan``. Moving rows costs bandwidth and, for the rows of a lost shard, a read from a
mirror or checkpoint, so ``replan`` keeps as much of the old placement as the plan's kind allows,
and ``moves`` lists exactly the row ranges whose holder changes. (A resume on another number of
shards takes the config's plan, ``make_plan``: every row is read from the checkpoint's files
anyway; ``moves`` says how many come from another shard's file.)

Shard numbering: the surviving old shards (all but ``drop``) keep their relative order and
become new shards 0..S-1; new shards are appended after them. With more survivors than
``num_shards``, the last survivors retire (their rows move, but they are alive to send them).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from core.plan import ShardingPlan, TableSlice, make_plan

__all__ = ["Move", "moved_rows", "moves", "replan", "survivor_ids"]


@dataclass(frozen=True)
class Move:
    """Rows ``[row_start, row_end)`` of ``table`` go to new shard ``dest`` from old shard
    ``source``; ``source`` is None where that old shard was dropped (read a mirror or checkpoint)."""

    table: int
    row_start: int
    row_end: int
    source: int | None
    dest: int


def survivor_ids(old_num_shards: int, drop: Sequence[int] = ()) -> list[int]:
    """The old id of each surviving shard, in order: new shard i was old shard ``result[i]``
    (for i below ``num_shards`` of the new plan; survivors past it retire)."""
    gone = set(drop)
    return [k for k in range(old_num_shards) if k not in gone]


def moved_rows(moves_: Sequence[Move]) -> int:
    """How many rows the moves carry."""
    return sum(m.row_end - m.row_start for m in moves_)


def _check(old: ShardingPlan, num_shards: int, drop: Sequence[int]) -> None:
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    outside = sorted({k for k in drop if not 0 <= k < old.num_shards})
    if outside:
        raise ValueError(f"drop names shards {outside} outside the old plan's 0..{old.num_shards - 1}")
    if old.kind == "table_wise":
        if num_shards > len(old.table_rows):
            raise ValueError(f"table_wise needs num_shards <= {len(old.table_rows)} tables, got {num_shards}")
    elif old.kind == "row_wise":
        small = [t for t, rows in enumerate(old.table_rows) if rows < num_shards]
        if small:
            raise ValueError(f"row_wise needs every table to have >= num_shards={num_shards} rows; "
                             f"table {small[0]} has {old.table_rows[small[0]]}"
                             + (f" (and tables {small[1:]} too)" if len(small) > 1 else ""))
    else:
        raise ValueError(f"sharding must be table_wise or row_wise, got {old.kind!r}")


def replan(old: ShardingPlan, num_shards: int, drop: Sequence[int] = ()) -> ShardingPlan:
    """The plan after ``old`` on ``num_shards`` shards, without the shards in ``drop``.

    table_wise: survivors keep their tables; orphaned tables (of dropped or retired shards) go,
    largest first, to the least loaded shard (an empty one first); when shards were added, tables
    then move from the most loaded shard while that lowers the peak, smallest first (``_spread``).

    row_wise: every table is cut again exactly as ``make_plan`` would (contiguous ranges in new
    shard order, ``np.linspace(...).round()`` bounds), so a replanned run holds rows just as a
    fresh start on ``num_shards`` would. Under that shape the plan is fully determined: it moves
    only what the shape forces: a dropped middle shard moves just its own rows, but 2 -> 3 shards
    moves about 1/2 of the rows (new ranges [0,1/3) [1/3,2/3) [2/3,1) against old halves) where
    1/3 would suffice if a new shard's range could sit between old ones.

    Raises ValueError on num_shards < 1, ``drop`` outside ``old``, a table_wise plan with more
    shards than tables, or a row_wise table with fewer rows than shards.
    """
    _check(old, num_shards, drop)
    if old.kind == "row_wise":
        return replace(make_plan("row_wise", list(old.table_rows), num_shards), generation=old.generation + 1)
    rows = old.table_rows
    keep = survivor_ids(old.num_shards, drop)[:num_shards]
    held = [[s.table for s in old.shards[k]] for k in keep] + [[] for _ in range(num_shards - len(keep))]
    load = [sum(rows[t] for t in tables) for tables in held]
    kept = {t for tables in held for t in tables}
    for t in sorted((t for t in range(len(rows)) if t not in kept), key=lambda t: (-rows[t], t)):
        k = min(range(num_shards), key=lambda k: (len(held[k]) > 0, load[k], k))
        held[k].append(t)
        load[k] += rows[t]
    if num_shards > len(keep):
        _spread(held, load, rows)
    shards = tuple(tuple(TableSlice(t, 0, rows[t]) for t in sorted(tables)) for tables in held)
    return ShardingPlan(old.kind, tuple(rows), shards, old.generation + 1)


def _spread(held: list[list[int]], load: list[int], rows: Sequence[int]) -> None:
    """Balances after shards were added, moving few tables (edits ``held`` and ``load``).

    Each step moves one table from the most loaded shard (lowest id on ties) to the least loaded
    (an empty one first), and only if the larger of the two loads drops: the largest load never
    rises. Of the tables that qualify, the smallest moves (then lower id), not the one that
    balances the pair best: sending a big table to an empty shard moves many rows for the same
    final peak (about 1.7 times the rows on random skewed tables). When no step is left but a
    shard is still empty, the most loaded shard with more than one table gives it its
    smallest table. Every step lowers the sorted load vector or the count of empty shards, so
    the loop ends.
    """
    n = len(held)

    def move(t: int, src: int, dst: int) -> None:
        held[src].remove(t)
        held[dst].append(t)
        load[src] -= rows[t]
        load[dst] += rows[t]

    while True:
        src = min((k for k in range(n) if held[k]), key=lambda k: (-load[k], k))
        dst = min(range(n), key=lambda k: (len(held[k]) > 0, load[k], k))
        fits = [t for t in held[src] if 0 < rows[t] and load[dst] + rows[t] < load[src]]
        if src != dst and fits:
            move(min(fits, key=lambda t: (rows[t], t)), src, dst)
            continue
        empty = [k for k in range(n) if not held[k]]
        donors = [k for k in range(n) if len(held[k]) > 1]
        if not empty or not donors:
            return
        src = min(donors, key=lambda k: (-load[k], k))
        move(min(held[src], key=lambda t: (rows[t], t)), src, empty[0])


def moves(old: ShardingPlan, new: ShardingPlan, drop: Sequence[int] = ()) -> list[Move]:
    """The row ranges whose holder changes from ``old`` to ``new`` (old shards renumbered as
    ``replan`` does), merged where adjacent with the same (table, source, dest), sorted by
    (dest, table, row_start). Works on range bounds, never on per-row arrays, so it is cheap
    for tables of millions of rows."""
    if tuple(old.table_rows) != tuple(new.table_rows):
        raise ValueError("old and new plans cover different tables")
    renumber = {o: i for i, o in enumerate(survivor_ids(old.num_shards, drop)[:new.num_shards])}
    gone = set(drop)
    out: list[Move] = []
    for t in range(len(old.table_rows)):
        was = sorted((s.row_start, s.row_end, k) for k, held in enumerate(old.shards) for s in held if s.table == t)
        now = sorted((s.row_start, s.row_end, k) for k, held in enumerate(new.shards) for s in held if s.table == t)
        cuts = sorted({b for a, e, _ in was + now for b in (a, e)})
        i = j = 0
        for a, b in zip(cuts, cuts[1:]):
            while i < len(was) and was[i][1] <= a:
                i += 1
            while j < len(now) and now[j][1] <= a:
                j += 1
            if i == len(was) or j == len(now) or was[i][0] > a or now[j][0] > a:
                raise ValueError(f"rows [{a}, {b}) of table {t} have no holder in one of the plans")
            source, dest = was[i][2], now[j][2]
            if renumber.get(source) == dest:
                continue
            src = None if source in gone else source
            last = out[-1] if out else None
            if last and (last.table, last.row_end, last.source, last.dest) == (t, a, src, dest):
                out[-1] = replace(last, row_end=b)
            else:
                out.append(Move(t, a, b, src, dest))
    return sorted(out, key=lambda m: (m.dest, m.table, m.row_start))
