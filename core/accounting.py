"""Pure accounting of lost samples (CPR's PLS numerator) and of trainer failures.

No Ray: functions over arrays and typed records, so the supervisor and the report share
one definition.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace

import numpy as np

from core.store import MicrobatchStore
from core.config import RunConfig
from core.data import NUM_SPARSE
from core.checkpoint.plans import read_slices
from core.plan import ShardingPlan, TableSlice, shard_row_ids, slice_offsets
from core.books import KillRecord, StepCommit, TrainerFailure
from core.records import CommitRecord, Heal, StepFailure
from core.schedule import StepSchedule

__all__ = ["LostSpan", "saved_at_rows", "lost_accesses", "chain_rows", "count_lost_samples", "plan_held",
           "trainer_failures"]


@dataclass(frozen=True)
class LostSpan:
    """A partially recovered shard's updates at risk: the dead actor applied the steps
    ``[first_step, redo_step)`` (None: it applied none), and its replacement was restored
    from ``chain`` (a full checkpoint, then incrementals)."""

    shard: int
    chain: tuple[int, ...]
    first_step: int | None
    redo_step: int


def saved_at_rows(num_rows: int, chain: Iterable[int], incremental_rows: Iterable[tuple[int, np.ndarray]]) -> np.ndarray:
    """Per shard row, the step of the checkpoint it was last saved in along ``chain``
    (a full at ``chain[0]``, then incrementals); 0 without a checkpoint (initial rows)."""
    chain = list(chain)
    saved_at = np.full(num_rows, chain[0] if chain else 0, dtype=np.int64)
    for step, rows in incremental_rows:
        saved_at[np.asarray(rows, dtype=np.int64)] = step
    return saved_at


def lost_accesses(
    saved_at: np.ndarray, first_step: int, redo_step: int, shard_rows_of_step: Callable[[int], Iterable[np.ndarray]]
) -> int:
    """Accesses whose update the dead actor held and nobody will redo.

    The dead actor applied the steps ``[first_step, redo_step)`` (it took over at
    ``first_step``; trainers redo from ``redo_step`` on its replacement). An access at step
    ``t`` to a row last saved at step ``c <= t`` is lost; one saved after ``t`` is not.
    ``shard_rows_of_step(t)`` yields the shard-row ids each microbatch of step ``t`` looks up.
    """
    if redo_step <= first_step:
        return 0
    lost = 0
    for t in range(max(first_step, int(saved_at.min())), redo_step):
        for ids in shard_rows_of_step(t):
            lost += int((saved_at[ids] <= t).sum())
    return lost


def plan_held(plan: ShardingPlan, shard: int, slices) -> ShardingPlan:
    """``plan`` with ``shard`` holding ``slices`` ((table, row_start, row_end) each; None: as
    ``plan`` says): the plan a dead shard of an earlier attempt held its rows under, for its
    lost samples (only that shard's slices are read)."""
    if slices is None:
        return plan
    held = tuple(TableSlice(int(t), int(a), int(b)) for t, a, b in slices)
    if shard < plan.num_shards and plan.shards[shard] == held:
        return plan
    shards = list(plan.shards) + [()] * max(0, shard + 1 - plan.num_shards)
    shards[shard] = held
    return replace(plan, shards=tuple(shards))


def chain_rows(plan: ShardingPlan, store, span: LostSpan) -> list[tuple[int, np.ndarray]]:
    """The shard rows each incremental of the span's restored chain saved, as
    ``(step, shard-row ids)``: what ``count_lost_samples`` reads from the store. Only the
    incrementals before the redo step matter (a rollback may have fenced later ones: the
    chain then ends at or before the rollback's full checkpoint)."""
    k, chain = span.shard, span.chain
    if span.first_step is None or not chain or span.redo_step <= chain[0]:
        return []  # nothing applied, or every row was saved at or after the redo step
    offsets = slice_offsets(plan.shards[k])
    out = []
    for step in chain[1:]:
        data = read_slices(store, store.info(step), k, plan.shards[k])  # whatever plan wrote it
        ids = [data.rows[data.tables == s.table] - s.row_start + offsets[i] for i, s in enumerate(plan.shards[k])]
        out.append((step, np.concatenate(ids)))
    return out


def count_lost_samples(
    cfg: RunConfig, plan: ShardingPlan, schedule: StepSchedule, train_cache: str, span: LostSpan, incrementals: list
) -> float:
    """Lost samples of one partial recovery: the dead actor's updates since
    ``span.first_step`` that its restored chain does not hold and that trainers do not redo
    (from ``span.redo_step`` on). ``incrementals`` is ``chain_rows()`` of the span; the
    microbatches come from the data cache; a lost access is 1/26 of a sample."""
    k = span.shard
    if span.first_step is None:
        return 0.0  # the dead actor never applied a step
    offsets = slice_offsets(plan.shards[k])
    saved_at = saved_at_rows(plan.shard_rows(k), span.chain, incrementals)
    cache = MicrobatchStore(train_cache)

    def rows_of_step(t: int):
        for m in range(schedule.microbatches_per_step):
            rows = cache.get(schedule.microbatch(t, m))[2].astype(np.int64)
            sb = plan.route(rows, k)
            yield shard_row_ids(sb.lengths, sb.indices, offsets)

    return lost_accesses(saved_at, span.first_step, span.redo_step, rows_of_step) / NUM_SPARSE


def trainer_failures(
    kills: Iterable[KillRecord], failed_steps: Iterable[StepFailure], commits: Mapping[int, StepCommit | CommitRecord],
    heals: Iterable[Heal], num_trainers: int,
) -> list[TrainerFailure]:
    """One record per killed trainer: detection, steps with fewer trainers, heal time."""
    failed_steps, heals = list(failed_steps), list(heals)
    out = []
    for kill in (k for k in kills if k.target.startswith("trainer:")):
        rank = int(kill.target.split(":")[1])
        # Detected when the survivors first act on it: a failed step, or a commit by a
        # smaller quorum (the synchronous quorum often drops the dead trainer at once).
        seen = sorted(
            [f.time for f in failed_steps if f.time >= kill.time]
            + [c.time for c in commits.values() if c.time >= kill.time and c.participants < num_trainers]
        )
        heal = next((h for h in heals if h.rank == rank and h.time >= kill.time), None)
        end = heal.time if heal else float("inf")
        degraded = [s for s, c in commits.items() if kill.time <= c.time <= end and c.participants < num_trainers]
        out.append(TrainerFailure(
            actor=kill.target, cause=kill.trigger, killed_at=kill.time,
            detection_s=round(seen[0] - kill.time, 3) if seen else None,
            steps_with_fewer_trainers=len(degraded),
            heal_s=round(heal.heal_s, 3) if heal else None,
            rejoined_s=round(heal.time - kill.time, 3) if heal else None,
            replacement_joined_at_step=heal.step if heal else None,
        ))
    return out
