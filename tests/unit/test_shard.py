"""EmbeddingShard's kernel path without Ray: a step is applied once, when all M
microbatches have arrived, to exactly the looked-up rows, independent of chunking."""

import numpy as np
import pyarrow as pa
import pytest

from core.plan import make_plan
from core.records import LoadResult, PushResult, Snapshot, WrittenPart
from actors.shard import EmbeddingShard

pytestmark = pytest.mark.timeout(120)

TABLE_ROWS = [50] * 26
DIM = 4


def _save(shard, uri, step, **kw) -> tuple[Snapshot, WrittenPart]:
    """A whole save as the coordinator drives it: the snapshot, then the background write."""
    snapshot = shard.save_checkpoint(uri, step, **kw)
    assert isinstance(snapshot, Snapshot)
    written = shard.save_written(step)
    assert isinstance(written, WrittenPart)
    return snapshot, written


def _shard(plan, k, m=2):
    return EmbeddingShard(k, list(plan.shards[k]), DIM, learning_rate=0.1, eps=1e-8, seed=3, microbatches_per_step=m)


def _batch(seed, batch=8):
    rng = np.random.default_rng(seed)
    return rng.integers(0, 50, size=(batch, 26))


def _rows_changed(before, after):
    return [np.flatnonzero((b[0] != a[0]).any(axis=1)) for b, a in zip(before, after)]


@pytest.mark.parametrize("kind", ["table_wise", "row_wise"])
def test_update_applied_once_when_step_complete_and_only_to_looked_up_rows(kind):
    plan = make_plan(kind, TABLE_ROWS, 2)
    shard = _shard(plan, 0)
    before = shard.get_rows()
    r0, r1 = _batch(0), _batch(1)
    sb0, sb1 = plan.route(r0, 0), plan.route(r1, 0)
    shard.lookup(0, (0,), sb0.lengths, sb0.indices)
    shard.lookup(0, (1,), sb1.lengths, sb1.indices)
    g = np.ones((8, len(plan.shards[0]) * DIM), dtype=np.float32)
    assert shard.push_grads(0, (0,), g) == PushResult(applied=False)
    assert all(np.array_equal(b[0], a[0]) for b, a in zip(before, shard.get_rows())), "applied before step complete"
    assert shard.push_grads(0, (1,), g) == PushResult(applied=True)
    after = shard.get_rows()
    for i, s in enumerate(plan.shards[0]):
        looked_up = set((np.concatenate([r0[:, s.table], r1[:, s.table]]) - s.row_start).tolist())
        looked_up = {r for r in looked_up if 0 <= r < s.num_rows}
        assert set(_rows_changed(before, after)[i].tolist()) == looked_up
        assert (after[i][1][sorted(looked_up)] > 0).all(), "Adagrad state of updated rows"
    # A redo resending the same microbatch must not apply it twice.
    assert shard.push_grads(0, (1,), g) == PushResult(applied=True, duplicate=True)
    assert all(np.array_equal(a[0], c[0]) for a, c in zip(after, shard.get_rows()))


def test_update_does_not_depend_on_chunking():
    """Step 0 as one chunk of both microbatches, or as two chunks arriving out of order: both
    shards apply it, to the rows looked up, and end bit-identical."""
    plan = make_plan("table_wise", TABLE_ROWS, 1)
    r = np.concatenate([_batch(0), _batch(1)])
    grad = np.random.default_rng(5).standard_normal((16, 26 * DIM)).astype(np.float32)

    whole = _shard(plan, 0, m=2)
    initial = whole.get_rows()
    sb = plan.route(r, 0)
    whole.lookup(0, (0, 1), sb.lengths, sb.indices)
    assert whole.push_grads(0, (0, 1), grad) == PushResult(applied=True)

    split = _shard(plan, 0, m=2)
    for mb, sl in ((1, slice(8, 16)), (0, slice(0, 8))):  # arrive out of order
        sbm = plan.route(r[sl], 0)
        split.lookup(0, (mb,), sbm.lengths, sbm.indices)
    assert split.push_grads(0, (1,), grad[8:]) == PushResult(applied=False)
    assert split.push_grads(0, (0,), grad[:8]) == PushResult(applied=True)

    for shard in (whole, split):
        assert shard.applied_log() == [(0, (0, 1))] and shard.applied_step == 0
        changed = _rows_changed(initial, shard.get_rows())
        for s, rows in zip(plan.shards[0], changed):
            assert set(rows.tolist()) == set(r[:, s.table].tolist()), "the step's update reached the rows looked up"
    for (wa, ma), (wb, mb_) in zip(whole.get_rows(), split.get_rows()):
        assert np.array_equal(wa, wb) and np.array_equal(ma, mb_)
        assert (ma > 0).any(), "Adagrad state of the updated rows"


def test_stale_gradient_of_a_replaced_chunk_is_ignored_not_an_error():
    # Defect 8: a redo split step 0 differently (one trainer took both microbatches); the
    # slow trainer's push for its old chunk (0,) must not crash it with a KeyError.
    plan = make_plan("table_wise", TABLE_ROWS, 1)
    shard = _shard(plan, 0)
    r0, r1 = _batch(0), _batch(1)
    sb0 = plan.route(r0, 0)
    shard.lookup(0, (0,), sb0.lengths, sb0.indices)
    both = plan.route(np.concatenate([r0, r1]), 0)
    shard.lookup(0, (0, 1), both.lengths, both.indices)  # the redo replaces chunk (0,)
    g = np.ones((8, 26 * DIM), dtype=np.float32)
    before = shard.get_rows()
    assert shard.push_grads(0, (0,), g) == PushResult(applied=False, stale=True)
    assert all(np.array_equal(b[0], a[0]) for b, a in zip(before, shard.get_rows()))
    assert shard.push_grads(0, (0, 1), np.ones((16, 26 * DIM), dtype=np.float32)).applied is True
    assert shard.applied_log() == [(0, (0, 1))]
    # A gradient that never had a lookup at all is stale too: nothing is applied.
    assert shard.push_grads(1, (2,), g) == PushResult(applied=False, stale=True) and shard.applied_step == 0


def test_mfu_counts_clear_only_when_the_save_is_confirmed_committed(tmp_path):
    # Defect 4 (two-phase saves): rows written for a save whose manifest never committed
    # stay counted, so the next incremental writes them again; a confirmed save clears them,
    # except for accesses that came after its snapshot.
    from core.checkpoint import FULL, INCREMENTAL, CheckpointStore

    plan = make_plan("table_wise", TABLE_ROWS, 1)
    prio = {"policy": "mfu", "r": 0.02, "sample_rate": 1.0, "full_every": 100}
    uri = str(tmp_path / "ckpt")
    store = CheckpointStore(uri)
    shard = EmbeddingShard(0, list(plan.shards[0]), DIM, 0.1, 1e-8, 3, microbatches_per_step=1, priority=prio)
    hot = np.zeros((16, 26), dtype=np.int64)  # row 0 of every table

    def train(step, rows):
        sb = plan.route(rows, 0)
        shard.lookup(step, (step,), sb.lengths, sb.indices)
        shard.push_grads(step, (step,), np.ones((16, 26 * DIM), dtype=np.float32))

    def saved(step, **kw):
        # The rows of the shard file as written, committed or not.
        _, written = _save(shard, uri, step, **kw)
        with pa.OSFile(str(tmp_path / "ckpt" / f"ckpt-{step:012d}" / written.entry.name)) as f:
            batch = pa.ipc.open_file(f).read_all()
        return set(zip(batch.column("table").to_pylist(), batch.column("row").to_pylist())), written.entry

    hot_rows = {(t, 0) for t in range(26)}
    for step in range(3):
        train(step, hot)
    store.commit(3, [_save(shard, uri, 3, save_index=0)[1].entry], kind=FULL)
    shard.confirm_save(3)
    for step in range(3, 6):
        train(step, hot)
    first, _ = saved(6, save_index=1)
    assert hot_rows <= first
    # Step 6's manifest never commits (a shard died during the save): nothing confirms it,
    # so the hot rows are still the most used and the next save writes them again.
    train(6, _batch(6, batch=16))
    again, again_entry = saved(7, save_index=2, confirmed_step=None)
    assert hot_rows <= again
    store.commit(7, [again_entry], kind=INCREMENTAL, base_step=3)
    train(7, hot)  # after the snapshot of step 7: these updates are not in it
    shard.confirm_save(7)
    for step in range(8, 10):
        train(step, _batch(step, batch=16))
    third, _ = saved(10, save_index=3)
    # Row 0 was used after the snapshot more than any random row since: still chosen.
    assert hot_rows <= third
    shard.confirm_save(10)
    train(10, _batch(10, batch=16))
    fourth, _ = saved(11, save_index=4)
    assert not (hot_rows & fourth), "confirmed rows with no later access must not be saved again"


@pytest.mark.parametrize("kind", ["table_wise", "row_wise"])
def test_checkpoint_round_trip_restores_rows_and_adagrad_state_bit_for_bit(tmp_path, kind):
    from core.checkpoint import CheckpointStore

    plan = make_plan(kind, TABLE_ROWS, 2)
    uri = str(tmp_path / "ckpt")
    trained = _shard(plan, 1, m=1)
    for step in range(3):
        r = _batch(step)
        sb = plan.route(r, 1)
        trained.lookup(step, (step,), sb.lengths, sb.indices)
        grad = np.random.default_rng(step).standard_normal((8, len(plan.shards[1]) * DIM)).astype(np.float32)
        trained.push_grads(step, (step,), grad)
    snapshot, written = _save(trained, uri, 3)
    assert snapshot.full and snapshot.rows == plan.shard_rows(1)
    CheckpointStore(uri).commit(3, [written.entry])

    fresh = _shard(plan, 1, m=1)
    assert not all(np.array_equal(a[0], b[0]) for a, b in zip(fresh.get_rows(), trained.get_rows()))
    loaded = fresh.load_checkpoint(uri, [3])
    assert isinstance(loaded, LoadResult)
    assert loaded.rows == plan.shard_rows(1) and loaded.chain == (3,) and loaded.incremental_rows == ()
    assert loaded.fallbacks == ()
    for (wa, ma), (wb, mb) in zip(trained.get_rows(), fresh.get_rows()):
        assert np.array_equal(wa, wb) and np.array_equal(ma, mb)
    assert fresh.applied_step == 2


def test_save_refuses_an_inconsistent_step(tmp_path):
    plan = make_plan("table_wise", TABLE_ROWS, 1)
    shard = _shard(plan, 0)
    with pytest.raises(RuntimeError, match="inconsistent"):
        shard.save_checkpoint(str(tmp_path), 5)


@pytest.mark.timeout(60)  # before issue 39 the second save hung under the shard's lock
def test_a_stuck_write_fails_the_next_save_within_its_deadline_and_the_shard_trains_on(tmp_path, monkeypatch):
    """Defect 5 of issue 39: a save waited for the previous save's write with no deadline, under
    the shard's lock, so slow storage stalled every trainer's call until they reported the
    healthy shard. Now the waits end within the shard's own deadlines, shorter than T: the
    save fails (the supervisor abandons it and saves again later) and training goes on."""
    import threading

    import actors.shard_save

    storage_back = threading.Event()
    write = actors.shard_save.write_shard_file

    def stalled_write(*args):
        storage_back.wait()
        return write(*args)

    monkeypatch.setattr(actors.shard_save, "write_shard_file", stalled_write)
    T = 2.0  # embeddings.call_timeout_s: what the supervisor waits for each of these calls
    plan = make_plan("table_wise", TABLE_ROWS, 1)
    shard = EmbeddingShard(0, list(plan.shards[0]), DIM, 0.1, 1e-8, 3, microbatches_per_step=1, call_timeout_s=T)
    uri = str(tmp_path / "ckpt")
    shard.save_checkpoint(uri, 0)  # its write hangs in the storage
    with pytest.raises(TimeoutError, match="slow storage"):
        shard.save_written(0)
    rows = _batch(0, batch=16)
    sb = plan.route(rows, 0)
    shard.lookup(0, (0,), sb.lengths, sb.indices)
    assert shard.push_grads(0, (0,), np.ones((16, 26 * DIM), dtype=np.float32)).applied
    with pytest.raises(TimeoutError, match="write of checkpoint step 0 is still running"):
        shard.save_checkpoint(uri, 1)
    shard.lookup(1, (1,), sb.lengths, sb.indices)  # the lock is free: training goes on
    assert shard.applied_step == 0
    storage_back.set()
    assert shard._ckpt._write.done.wait(30)
    snapshot, written = _save(shard, uri, 1)  # the next save is taken and written
    assert snapshot.full and written.entry is not None


def test_mfu_incremental_checkpoint_restores_row_by_row(tmp_path):
    """MFU: a full save, more training, an incremental save of the top r rows; a fresh shard
    restored from the chain holds the incremental's rows as trained and the others as in
    the full checkpoint."""
    from core.checkpoint import FULL, INCREMENTAL, CheckpointStore

    plan = make_plan("table_wise", TABLE_ROWS, 1)
    uri = str(tmp_path / "ckpt")
    prio = {"policy": "mfu", "r": 0.1, "sample_rate": 1.0, "full_every": 10}
    shard = EmbeddingShard(0, list(plan.shards[0]), DIM, 0.1, 1e-8, 3, microbatches_per_step=1, priority=prio)
    store = CheckpointStore(uri)

    def train(step):
        r = _batch(step, batch=16)
        sb = plan.route(r, 0)
        shard.lookup(step, (step,), sb.lengths, sb.indices)
        shard.push_grads(step, (step,), np.ones((16, 26 * DIM), dtype=np.float32))

    train(0)
    full, full_part = _save(shard, uri, 1, save_index=0)
    assert full.full and full.rows == 26 * 50
    store.commit(1, [full_part.entry], kind=FULL)
    at_full = shard.get_rows()
    for step in (1, 2, 3):
        train(step)
    inc, inc_part = _save(shard, uri, 4, save_index=1, confirmed_step=1)
    assert not inc.full and 0 < inc.rows <= int(np.ceil(0.1 * 26 * 50))
    store.commit(4, [inc_part.entry], kind=INCREMENTAL, base_step=1)
    trained = shard.get_rows()
    saved = store.read_shard(4, 0)
    saved_keys = set(zip(saved.tables.tolist(), saved.rows.tolist()))

    fresh = EmbeddingShard(0, list(plan.shards[0]), DIM, 0.1, 1e-8, 99, microbatches_per_step=1, priority=prio)
    loaded = fresh.load_checkpoint(uri, store.chain_steps())
    assert store.chain_steps() == [1, 4] and loaded.chain == (1, 4)
    assert [s for s, _ in loaded.incremental_rows] == [4] and len(loaded.incremental_rows[0][1]) == inc.rows
    for s, (w_full, m_full), (w_tr, m_tr), (w, m) in zip(plan.shards[0], at_full, trained, fresh.get_rows()):
        for row in range(s.num_rows):
            want_w, want_m = (w_tr, m_tr) if (s.table, row) in saved_keys else (w_full, m_full)
            assert np.array_equal(w[row], want_w[row]) and m[row] == want_m[row]
    # The MFU choice is the most-accessed rows since the full save.
    assert fresh.applied_step == 3


def test_a_corrupt_file_of_its_own_falls_back_and_says_why(tmp_path):
    """The newest full's file of this shard is corrupt: the shard loads the older full, and
    the result names the chain it used and the refused step; with no valid full left it
    refuses (NoValidChain, naming both), keeping away from its initial rows, which only
    ``reset_to_init`` (a reason given) restores."""
    from core.checkpoint import FULL, CheckpointStore, shard_file_name, step_dir_name
    from core.errors import NoValidChain

    plan = make_plan("table_wise", TABLE_ROWS, 1)
    uri = str(tmp_path / "ckpt")
    store = CheckpointStore(uri)
    shard = _shard(plan, 0, m=1)
    initial = shard.get_rows()
    for step in range(2):
        sb = plan.route(_batch(step), 0)
        shard.lookup(step, (step,), sb.lengths, sb.indices)
        shard.push_grads(step, (step,), np.ones((8, 26 * DIM), dtype=np.float32))
        store.commit(step + 1, [_save(shard, uri, step + 1)[1].entry], kind=FULL)
    path = tmp_path / "ckpt" / step_dir_name(2) / shard_file_name(0)
    path.write_bytes(path.read_bytes()[:-64] + bytes(64))

    loaded = _shard(plan, 0, m=1).load_checkpoint(uri, [2])
    assert loaded.chain == (1,) and [f.step for f in loaded.fallbacks] == [2] and loaded.fallbacks[0].reason
    path.parent.parent.joinpath(step_dir_name(1), shard_file_name(0)).write_bytes(b"")
    fresh = _shard(plan, 0, m=1)
    with pytest.raises(NoValidChain, match="step 2: .*checksum.*step 1: .*0 bytes") as refused:
        fresh.load_checkpoint(uri, [2])
    assert [s for s, _ in refused.value.tried] == [2, 1] and refused.value.shard_id == 0
    assert fresh.applied_step == -1 and fresh.state().applied_step == -1
    reset = shard.reset_to_init("rollback", "a test: the initial rows")
    assert reset == LoadResult(rows=0, bytes=0, chain=(), initial_rows_reason="a test: the initial rows")
    assert shard.applied_step == -1 and shard.applied_log() == []
    assert all(np.array_equal(a[0], b[0]) and not b[1].any() for a, b in zip(initial, shard.get_rows()))


def test_a_spare_with_tables_ready_adopts_a_shard_of_that_shape_without_allocating(monkeypatch):
    """``embeddings.spare_tables``: a spare allocates tables of the common shape ahead; a
    recovery of a shard of that shape adopts them (zero rows, zero Adagrad state, as freshly
    allocated ones); one of another shape allocates its own; "lazy" allocates nothing ahead."""
    from actors.shard_chunks import table_bytes, tables_wanted

    plan = make_plan("table_wise", [50] * 25 + [80], 2)
    shapes = [[s.num_rows for s in plan.shards[k]] for k in range(2)]
    assert shapes[0] != shapes[1]

    def spare(mode):
        return EmbeddingShard(None, None, DIM, 0.1, 1e-8, 3, microbatches_per_step=1, spare="x-spare0",
                              ready_rows=shapes[1], spare_tables=mode)

    monkeypatch.setattr("ray.get_runtime_context", lambda: type("C", (), {"get_node_id": lambda self: "n"})())
    ready = spare("ready")
    assert ready.ready().tables_ready_bytes == table_bytes(shapes[1], DIM) > 0
    tables = ready._ready_tables[1]
    ready.adopt(1, list(plan.shards[1]), 1)
    assert ready.tbe is tables and ready.ready().tables_ready_bytes == 0
    assert all((w == 0).all() for w, _ in ready.get_rows()) and all((m == 0).all() for _, m in ready.get_rows())
    other = spare("ready")
    held = other._ready_tables[1]
    other.adopt(0, list(plan.shards[0]), 1)
    assert other.tbe is not held and [w.shape[0] for w, _ in other.get_rows()] == shapes[0]
    assert spare("lazy").ready().tables_ready_bytes == 0
    assert not tables_wanted("auto", [1 << 40], DIM)  # no node has twice 70 TB available
    assert tables_wanted("auto", [10], DIM) and not tables_wanted("lazy", [10], DIM)


def test_a_shard_nothing_refers_to_is_freed_with_its_tables():
    """Its link's and its tracker's threads hold it weakly: shards made one after another in one
    process (tests, benchmarks) do not keep every earlier shard's tables."""
    import gc
    import weakref

    plan = make_plan("table_wise", TABLE_ROWS, 2)
    shard = EmbeddingShard(0, list(plan.shards[0]), DIM, 0.1, 1e-8, 3, microbatches_per_step=1,
                           priority={"policy": "mfu", "r": 0.1, "sample_rate": 1.0, "full_every": 4})
    sb = plan.route(_batch(1), 0)
    shard.lookup(0, (0,), sb.lengths, sb.indices)
    ref = weakref.ref(shard)
    del shard
    gc.collect()
    assert ref() is None
