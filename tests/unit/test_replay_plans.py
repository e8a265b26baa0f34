"""The replay reads what a load read: a checkpoint a resume on another plan fenced, and then
committed again under the same step with other shard files, is read from the fenced copy with
the files of its own plan (found in review: the live manifest's plan named files the copy never
had)."""

from __future__ import annotations

import time

import numpy as np
import pytest

from actors.shard import EmbeddingShard
from core.checkpoint import FULL, CheckpointStore
from core.plan import make_plan, plan_to_json
from verify.replay.history import History, ShardLoad
from verify.replay.loaded import CLOCK_SLACK_S, LoadedFiles
from verify.store import Store

pytestmark = pytest.mark.timeout(120)

TABLE_ROWS = [40, 30, 30, 20, 20, 10] + [12] * 20


def _shards(plan):
    return [EmbeddingShard(k, list(plan.shards[k]), 4, learning_rate=0.1, eps=1e-8, seed=3, microbatches_per_step=1)
            for k in range(plan.num_shards)]


def _trained(plan, steps: int):
    shards = _shards(plan)
    for step in range(steps):
        rng = np.random.default_rng(step)
        rows = np.stack([rng.integers(0, n, size=8) for n in TABLE_ROWS], axis=1)
        grad = rng.standard_normal((8, len(TABLE_ROWS), 4)).astype(np.float32)
        for k, shard in enumerate(shards):
            sb = plan.route(rows, k)
            shard.lookup(step, (step,), sb.lengths, sb.indices)
            shard.push_grads(step, (step,), plan.gather_grad(grad, k))
    return shards


def _save(store, plan, shards, step):
    entries = []
    for s in shards:
        s.save_checkpoint(store.uri, step, full=True)
        entries.append(s.save_written(step).entry)
    store.commit(step, entries, kind=FULL, meta={"plan": plan_to_json(plan)})


def test_a_load_of_a_fenced_checkpoint_reads_the_files_of_the_plan_it_was_written_under(tmp_path):
    a, b = make_plan("row_wise", TABLE_ROWS, 2), make_plan("row_wise", TABLE_ROWS, 3)
    store = CheckpointStore(str(tmp_path / "ckpt"), keep_fenced=True)
    _save(store, a, _trained(a, 1), 1)
    _save(store, a, _trained(a, 2), 2)
    loaded_at = time.time() + CLOCK_SLACK_S + 0.1  # shard 1 of plan A loads step 2
    time.sleep(2 * CLOCK_SLACK_S + 0.3)
    store.fence_after(1)  # a resume on plan B goes back to step 1 ...
    time.sleep(CLOCK_SLACK_S + 0.2)
    _save(store, b, _trained(b, 2), 2)  # ... and commits step 2 again, with three files
    verify_store = Store(store.uri)
    history = History([], [], [], {(1, 0): [(s.table, s.row_start, s.row_end) for s in a.shards[1]]})
    files = LoadedFiles(verify_store, {s: verify_store.commit_time(s) for s in verify_store.committed()}, [], history)
    found, missing = files.read(ShardLoad(1, 0, [2], "recovery", loaded_at, 3), 2)
    assert missing is None and [j for j, _ in found] == [1]
    assert "fenced" in found[0][1]  # the copy plan A wrote, not step 2 as plan B saved it again
