"""Checkpoints outlive plans. A manifest records the sharding plan its shard files were
written under; a shard of any other plan reads its rows from the files that hold them; and
a run goes on with its plan's generation: a resume on another number of shards (or another
sharding) starts the next one, the same plan keeps its own."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

from core.checkpoint.files import CheckpointInfo
from core.checkpoint.rows import ShardRows, gather_rows
from core.errors import CheckpointCorrupt, CheckpointNotFound
from core.plan import ShardingPlan, overlapping, plan_from_json

if TYPE_CHECKING:
    from core.checkpoint.reader import CheckpointReader

__all__ = ["newest_plan", "plan_after", "read_slices", "recorded_plan", "same_rows"]


def recorded_plan(info: CheckpointInfo) -> ShardingPlan | None:
    """The sharding plan ``info``'s shard files were written under, or None for a checkpoint
    made before manifests recorded it.

    Raises:
        CheckpointCorrupt: the manifest's plan is malformed or names other files than it lists.
    """
    doc = info.meta.get("plan")
    if doc is None:
        return None
    try:
        plan = plan_from_json(doc)
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointCorrupt(f"checkpoint step {info.step}: its manifest's plan is malformed ({exc!r:.120})") from None
    if info.shard_ids != list(range(plan.num_shards)):
        raise CheckpointCorrupt(
            f"checkpoint step {info.step}: its plan has {plan.num_shards} shards, its files are of shards {info.shard_ids}"
        )
    return plan


def read_slices(reader: CheckpointReader, info: CheckpointInfo, shard_id: int, slices: Sequence | None) -> ShardRows:
    """The rows of ``slices`` (a shard's TableSlices under the plan now) that checkpoint ``info``
    holds, whatever plan wrote it: the shard's own file when that plan gave this shard these
    very slices, else the rows of ``slices`` gathered from every file that holds some of them,
    sorted by table then row. Only the files read are verified, each on the bytes read.
    Without ``slices``, or for a checkpoint that records no plan (made before manifests did; a
    resume refuses to change the plan of one), the shard's own file.
    """
    written = recorded_plan(info)
    if slices is None or written is None or (shard_id < written.num_shards
                                             and list(written.shards[shard_id]) == list(slices)):
        return reader.read_shard(info.step, shard_id)
    sources = overlapping(written, slices)
    if not sources:
        raise CheckpointCorrupt(f"checkpoint step {info.step}: no shard file holds rows of shard {shard_id}")
    return gather_rows([reader.read_shard(info.step, k) for k in sources], slices)


def newest_plan(reader: CheckpointReader) -> tuple[int, ShardingPlan] | None:
    """(step, plan) of the newest committed checkpoint whose manifest records its plan."""
    for step in reversed(reader.list_committed()):
        try:
            plan = recorded_plan(reader.info(step))
        except (CheckpointCorrupt, CheckpointNotFound):
            continue
        if plan is not None:
            return step, plan
    return None


def same_rows(a: ShardingPlan, b: ShardingPlan) -> bool:
    """Whether every shard holds the same rows under ``a`` and ``b`` (generations aside)."""
    return (a.kind, a.table_rows, a.shards) == (b.kind, b.table_rows, b.shards)


def plan_after(reader: CheckpointReader, plan: ShardingPlan) -> ShardingPlan:
    """``plan`` numbered after the run's checkpoints: the generation of the newest recorded
    plan when it holds the same rows, the next one when it does not (0 without checkpoints)."""
    found = newest_plan(reader)
    if found is None:
        return plan
    _, written = found
    generation = written.generation if same_rows(written, plan) else written.generation + 1
    return dataclasses.replace(plan, generation=generation)
