"""Checkpoints outlive plans, on real shards and real files without Ray: rows saved by the
shards of one plan (a full, then an incremental) load into the shards of another (more,
fewer, the other sharding), each row with its Adagrad state bit for bit, and training goes on
from them exactly as it would have on the old plan. A manifest's plan is checked as it is read."""

from __future__ import annotations

import json

import numpy as np
import pytest

from actors.shard import EmbeddingShard
from core.checkpoint import FULL, INCREMENTAL, CheckpointStore, step_dir_name
from core.checkpoint.plans import newest_plan, plan_after, recorded_plan
from core.errors import CheckpointCorrupt
from core.plan import make_plan, plan_to_json

pytestmark = pytest.mark.timeout(120)

TABLE_ROWS = [40, 30, 30, 20, 20, 10] + [12] * 20
DIM = 4


def _shards(plan):
    return [EmbeddingShard(k, list(plan.shards[k]), DIM, learning_rate=0.1, eps=1e-8, seed=3, microbatches_per_step=1,
                           priority={"policy": "mfu", "r": 0.5, "sample_rate": 1.0, "full_every": 4})
            for k in range(plan.num_shards)]


def _train(plan, shards, step: int) -> None:
    rng = np.random.default_rng(step)
    rows = np.stack([rng.integers(0, n, size=8) for n in TABLE_ROWS], axis=1)
    grad = rng.standard_normal((8, len(TABLE_ROWS), DIM)).astype(np.float32)
    for k, shard in enumerate(shards):
        sb = plan.route(rows, k)
        shard.lookup(step, (step,), sb.lengths, sb.indices)
        shard.push_grads(step, (step,), plan.gather_grad(grad, k))


def _save(uri: str, plan, shards, step: int, full: bool, base: int | None = None) -> None:
    entries = []
    for shard in shards:
        shard.save_checkpoint(uri, step, save_index=0 if full else 1, full=full)
        entries.append(shard.save_written(step).entry)
    CheckpointStore(uri).commit(step, entries, kind=FULL if full else INCREMENTAL, base_step=base,
                                meta={"plan": plan_to_json(plan)})


def _model(plan, shards) -> dict:
    """(table, row) -> (weights, momentum) over every shard."""
    out = {}
    for k, shard in enumerate(shards):
        for s, (w, m) in zip(plan.shards[k], shard.get_rows()):
            for i in range(s.num_rows):
                out[(s.table, s.row_start + i)] = (w[i].tobytes(), m[i].tobytes())
    return out


@pytest.mark.parametrize("before,after", [
    (("table_wise", 2), ("table_wise", 3)),
    (("table_wise", 3), ("table_wise", 2)),
    (("row_wise", 2), ("row_wise", 3)),
    (("row_wise", 3), ("row_wise", 1)),
    (("row_wise", 2), ("table_wise", 4)),
])
def test_rows_saved_under_one_plan_load_into_another_and_train_on_the_same(tmp_path, before, after):
    uri = str(tmp_path / "ckpt")
    old = make_plan(*before[:1], TABLE_ROWS, before[1])
    shards = _shards(old)
    for step in range(3):
        _train(old, shards, step)
    _save(uri, old, shards, 3, full=True)
    _train(old, shards, 3)
    _save(uri, old, shards, 4, full=False, base=3)  # MFU: half the rows, a chain of two
    store = CheckpointStore(uri)
    assert 0 < sum(len(store.read_shard(4, k)) for k in range(old.num_shards)) < sum(TABLE_ROWS) // 2 + old.num_shards

    new = plan_after(CheckpointStore(uri), make_plan(after[0], TABLE_ROWS, after[1]))
    _, written = newest_plan(CheckpointStore(uri))
    assert written == old and new.generation == 1  # another plan: the next generation
    restored, moved = _shards(old), _shards(new)
    for shard in restored + moved:
        result = shard.load_checkpoint(uri, [3, 4], why="rollback")
        assert result.chain == (3, 4) and not result.fallbacks
    # The chain's state is the same on either plan: every row, with its optimizer state, bit for bit.
    assert _model(new, moved) == _model(old, restored)

    for step in (4, 5):  # one id per feature: a row's update is the same on any plan
        _train(old, restored, step)
        _train(new, moved, step)
    assert _model(new, moved) == _model(old, restored)


def _saved_once(tmp_path):
    """Two table-wise shards trained a step and saved in full at step 1: (uri, plan)."""
    uri = str(tmp_path / "ckpt")
    plan = make_plan("table_wise", TABLE_ROWS, 2)
    shards = _shards(plan)
    _train(plan, shards, 0)
    _save(uri, plan, shards, 1, full=True)
    return uri, plan


def test_the_same_plan_keeps_its_generation_and_reads_its_own_file(tmp_path):
    uri, plan = _saved_once(tmp_path)
    again = plan_after(CheckpointStore(uri), make_plan("table_wise", TABLE_ROWS, 2))
    _, written = newest_plan(CheckpointStore(uri))
    assert again == plan and written == plan and again.generation == 0


def test_a_manifest_whose_plan_does_not_match_its_files_is_refused(tmp_path):
    uri, plan = _saved_once(tmp_path)
    path = tmp_path / "ckpt" / step_dir_name(1) / "manifest.json"
    doc = json.loads(path.read_text())
    store = CheckpointStore(uri)
    assert recorded_plan(store.info(1)) == plan
    doc["meta"]["plan"] = plan_to_json(make_plan("table_wise", TABLE_ROWS, 3))  # three shards, two files
    path.write_text(json.dumps(doc))
    with pytest.raises(CheckpointCorrupt, match="its plan has 3 shards, its files are of shards"):
        recorded_plan(store.info(1))
    doc["meta"]["plan"] = {"kind": "table_wise", "shards": "?"}
    path.write_text(json.dumps(doc))
    with pytest.raises(CheckpointCorrupt, match="plan is malformed"):
        recorded_plan(store.info(1))


@pytest.mark.parametrize("kind,before,after", [("row_wise", 2, 3), ("row_wise", 3, 2), ("table_wise", 2, 3)])
def test_gather_rows_gives_a_shards_rows_in_its_layout_from_files_of_another_plan(kind, before, after):
    """Every row of a full checkpoint once (copied run by run), or an incremental's scattered
    subset (sorted): the same as selecting each slice's rows and sorting by table then row."""
    from core.checkpoint.rows import ShardRows, gather_rows

    old, new = make_plan(kind, TABLE_ROWS, before), make_plan(kind, TABLE_ROWS, after)
    rng = np.random.default_rng(0)

    def file_of(slices, subset: bool) -> ShardRows:
        tables = np.concatenate([np.full(s.num_rows, s.table, np.int32) for s in slices])
        rows = np.concatenate([np.arange(s.row_start, s.row_end) for s in slices])
        pick = np.sort(rng.choice(len(rows), len(rows) // 3, replace=False)) if subset else np.arange(len(rows))
        return ShardRows(tables[pick], rows[pick], rng.standard_normal((len(pick), DIM)).astype(np.float32),
                         rng.standard_normal(len(pick)).astype(np.float32))

    for subset in (False, True):
        files = [file_of(old.shards[k], subset) for k in range(before)]
        everything = ShardRows(*(np.concatenate([getattr(f, n) for f in files])
                                 for n in ("tables", "rows", "weights", "momentum")))
        for k in range(after):
            got = gather_rows(files, new.shards[k])
            mine = np.zeros(len(everything), bool)
            for s in new.shards[k]:
                mine |= (everything.tables == s.table) & (everything.rows >= s.row_start) & (everything.rows < s.row_end)
            order = np.lexsort((everything.rows[mine], everything.tables[mine]))
            for name in ("tables", "rows", "weights", "momentum"):
                assert np.array_equal(getattr(got, name), getattr(everything, name)[mine][order]), (subset, k, name)
            if not subset:
                assert len(got) == new.shard_rows(k)
