"""MFU/SSU tracking off the lookup's path (actors.tracking) and MFU's in-place counts select
exactly the rows that the inline, sort-based tracking selected for the same accesses."""

import numpy as np
import pyarrow as pa
import pytest

from actors.shard import EmbeddingShard
from actors.tracking import AccessTracker
from core.plan import make_plan, shard_row_ids
from policies.priority import INT32_MAX, MfuPolicy, make_policy

pytestmark = pytest.mark.timeout(120)

TABLE_ROWS = [40] * 26
DIM = 4


class SortedMfu(MfuPolicy):
    """MFU as it counted before: unique ids and their hits, added with saturation."""

    def observe(self, rows) -> None:
        ids = self._rows_arg(rows)
        if ids.size:
            uniq, hits = np.unique(ids, return_counts=True)
            self._counts[uniq] = np.minimum(self._counts[uniq].astype(np.int64) + hits, INT32_MAX)


def _skewed(rng, n, size):
    return np.minimum(rng.zipf(1.3, size) - 1, n - 1)


def test_mfu_in_place_counts_select_the_rows_that_sorted_counts_select():
    rng = np.random.default_rng(1)
    n = 5_000
    ours, before = MfuPolicy(n, 0.05, full_every=4), SortedMfu(n, 0.05, full_every=4)
    for save in range(12):
        for _ in range(5):
            ids = _skewed(rng, n, 3_000)
            ours.observe(ids)
            before.observe(ids)
        assert np.array_equal(ours._counts, before._counts)
        a, b = ours.select(save), before.select(save)
        assert np.array_equal(a.rows, b.rows) and a.full == b.full
        ours.mark_saved(a.rows)
        before.mark_saved(b.rows)


def test_mfu_counts_saturate_at_the_cap_as_before():
    ours, before = MfuPolicy(8, 0.5), SortedMfu(8, 0.5)
    for p in (ours, before):
        p._counts[2] = INT32_MAX - 3
    ours._bound = INT32_MAX - 3
    ids = np.array([2] * 10 + [5, 5])
    ours.observe(ids)
    before.observe(ids)
    assert np.array_equal(ours._counts, before._counts) and ours._counts[2] == INT32_MAX
    ours.observe(np.array([2, 6]))
    before.observe(np.array([2, 6]))
    assert np.array_equal(ours._counts, before._counts)


@pytest.mark.parametrize("policy", ["mfu", "ssu"])
def test_tracking_beside_the_lookups_saves_the_rows_inline_tracking_chooses(tmp_path, policy):
    """A shard whose tracker thread counts its lookups writes, in every incremental save,
    exactly the rows that a policy fed the same ids inline (in lookup order) selects."""
    plan = make_plan("table_wise", TABLE_ROWS, 2)
    k, seed = 1, 3
    prio = {"policy": policy, "r": 0.1, "sample_rate": 0.5, "full_every": 100}
    shard = EmbeddingShard(k, list(plan.shards[k]), DIM, 0.1, 1e-8, seed, microbatches_per_step=1, priority=prio)
    offsets = np.concatenate([[0], np.cumsum([s.num_rows for s in plan.shards[k]])])
    inline = make_policy(policy, int(offsets[-1]), prio["r"], prio["sample_rate"], seed + k, prio["full_every"])
    rng = np.random.default_rng(7)
    uri = str(tmp_path / "ckpt")
    step = 0
    for save in range(4):
        for _ in range(6):
            rows = _skewed(rng, 40, (32, 26))
            sb = plan.route(rows, k)
            shard.lookup(step, (step,), sb.lengths, sb.indices)
            inline.observe(shard_row_ids(sb.lengths, sb.indices, offsets))
            shard.push_grads(step, (step,), np.ones((32, len(plan.shards[k]) * DIM), dtype=np.float32))
            step += 1
        shard.save_checkpoint(uri, step, save_index=save + 1)
        written = shard.save_written(step)
        with pa.OSFile(str(tmp_path / "ckpt" / f"ckpt-{step:012d}" / written.entry.name)) as f:
            batch = pa.ipc.open_file(f).read_all()
        got = sorted(zip(batch.column("table").to_pylist(), batch.column("row").to_pylist()))
        chosen = inline.select(save + 1).rows
        slice_of = np.searchsorted(offsets, chosen, side="right") - 1
        tables = [plan.shards[k][i].table for i in slice_of]
        assert got == sorted(zip(tables, (chosen - offsets[slice_of]).tolist()))
        shard.confirm_save(step)
        inline.mark_saved(chosen)


def test_a_tracking_failure_is_raised_by_the_next_call_not_swallowed():
    def track(x):
        if x == 2:
            raise ValueError("bad ids")

    tracker = AccessTracker(track, "test")
    tracker.put(1)
    tracker.drain()
    tracker.put(2)
    with pytest.raises(RuntimeError, match="bad ids"):
        tracker.drain()
    with pytest.raises(RuntimeError, match="access tracking failed"):
        tracker.put(3)


def test_a_reset_forgets_a_tracking_failure_and_the_accesses_not_counted():
    """A load restarts the counts: a failure of the tracking before it must not fail every
    later lookup of the shard."""
    seen = []

    def track(x):
        if x == 2:
            raise ValueError("bad ids")
        seen.append(x)

    tracker = AccessTracker(track, "test")
    tracker.put(2)
    with pytest.raises(RuntimeError):
        tracker.drain()
    tracker.reset()
    tracker.put(3)
    tracker.drain()
    assert seen == [3]


def test_the_tracker_thread_does_not_keep_its_shard_alive():
    """The tracker's thread holds its owner weakly: a shard (and its tables) that nothing else
    refers to is freed (a benchmark making shards of 4 GB one after another ran out of memory)."""
    import gc
    import weakref

    class Owner:
        def __init__(self):
            self.seen = []
            self.tracker = AccessTracker(self.track, "owner")

        def track(self, x):
            self.seen.append(x)

    owner = Owner()
    owner.tracker.put(1)
    owner.tracker.drain()
    assert owner.seen == [1]
    ref = weakref.ref(owner)
    del owner
    gc.collect()
    assert ref() is None


def test_a_tracker_that_gets_no_cpu_counts_in_the_caller_past_a_backlog():
    """With its thread starved (held off here by the owner's lock), the ids of at most
    MAX_QUEUED steps wait; the next put counts them all, in order."""
    import threading

    from actors.tracking import MAX_QUEUED

    lock = threading.RLock()
    seen = []
    tracker = AccessTracker(seen.append, "starved", lock)
    with lock:  # the thread cannot count while this is held
        for i in range(MAX_QUEUED + 1):
            tracker.put(i)
        assert seen == list(range(MAX_QUEUED + 1))
