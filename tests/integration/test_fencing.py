"""Fencing with real Ray (actors.lease): a shard actor holds its place through the GCS's
key-value store; once the supervisor has granted the place to a successor (and waited out
the term, as it does when the predecessor may still run), the old process applies nothing
more: its next step ends with its exit instead."""

from __future__ import annotations

import uuid

import numpy as np
import pytest

from actors.lease import Fences, LeaseSpec, shard_place
from actors.shard import EmbeddingShard
from core.plan import make_plan
from core.records import PushResult

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

DIM = 4


def _step(ray, shard, plan, step: int):
    rows = np.random.default_rng(step).integers(0, 50, size=(8, 26))
    routed = plan.route(rows, 0)
    ray.get(shard.lookup.remote(step, (step,), routed.lengths, routed.indices), timeout=60)
    grad = np.ones((8, len(plan.shards[0]) * DIM), dtype=np.float32)
    return ray.get(shard.push_grads.remote(step, (step,), grad), timeout=60)


def test_a_shard_whose_place_was_granted_to_a_successor_applies_nothing_more(ray_local):
    ray = ray_local
    spec = LeaseSpec(f"fence-{uuid.uuid4().hex[:8]}", 0.5)
    fences = Fences(spec)
    plan = make_plan("table_wise", [50] * 26, 2)
    fences.grant([shard_place(0, 0)], wait=False)
    shard = ray.remote(EmbeddingShard).options(max_restarts=0).remote(
        0, list(plan.shards[0]), DIM, 0.1, 1e-8, 3, microbatches_per_step=1, generation=0, lease=spec,
    )
    assert _step(ray, shard, plan, 0) == PushResult(applied=True)
    assert _step(ray, shard, plan, 1) == PushResult(applied=True)
    applied = ray.get(shard.applied_log.remote())
    # The successor's grant: the key now names generation 1, and the term has passed.
    waited = fences.grant([shard_place(0, 1)], wait=True)
    assert waited >= spec.term_s
    with pytest.raises(ray.exceptions.RayActorError) as died:
        _step(ray, shard, plan, 2)
    assert "its worker process has died" in str(died.value), str(died.value)
    assert [s for s, _ in applied] == [0, 1]
