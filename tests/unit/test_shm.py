"""The shared-memory transport (actors.shm) without Ray: what a trainer writes is what a
shard reads, a grown or dropped slab never serves stale data, and a shard fed through shared
memory computes exactly what it computes from arrays in the call."""

import os
import uuid

import numpy as np
import pytest

from core.plan import make_plan
from actors.shard import EmbeddingShard
from actors.shm import SHM_DIR, ShmArray, ShmReader, ShmSlab, remove_run_files, shm_available

pytestmark = [pytest.mark.timeout(120), pytest.mark.skipif(not shm_available(), reason="no writable /dev/shm")]


@pytest.fixture
def run_id():
    rid = "test" + uuid.uuid4().hex[:8]
    yield rid
    remove_run_files(rid)


def test_reader_copies_what_the_slab_holds_and_writes_replies_back(run_id):
    slab = ShmSlab(run_id, "s0")
    ids = np.arange(10, dtype=np.int64)
    d_ids, d_out = slab.layout([(ids.shape, np.int64), ((2, 3), np.float32)])
    slab.view(d_ids)[...] = ids
    reader = ShmReader()
    got = reader.get(d_ids)
    assert np.array_equal(got, ids)
    slab.view(d_ids)[...] = -1  # the trainer reuses the slab for its next call
    assert np.array_equal(got, ids)  # the shard kept a private copy
    reply = np.arange(6, dtype=np.float32).reshape(2, 3)
    assert reader.put(d_out, reply) == d_out
    assert np.array_equal(slab.view(d_out), reply)
    with pytest.raises(ValueError, match="does not fit"):
        reader.put(d_out, np.zeros((3, 2), np.float32))
    assert reader.put(None, reply) is reply  # no slab: the reply travels in the call
    assert reader.get(ids) is ids
    assert reader.reads == 1
    slab.close()
    assert not os.path.exists(d_ids.path)


def test_a_grown_slab_is_a_new_file_and_the_reader_follows_it(run_id):
    slab = ShmSlab(run_id, "s1")
    (small,) = slab.layout([((4,), np.int64)])
    slab.view(small)[...] = 7
    reader = ShmReader()
    assert reader.get(small).tolist() == [7] * 4
    (big,) = slab.layout([((1 << 20,), np.int64)])  # 8 MB: more than the first file
    assert big.path != small.path and not os.path.exists(small.path)
    slab.view(big)[...] = 3
    assert int(reader.get(big).sum()) == 3 << 20
    assert len(reader._maps) == 1  # the old file's mapping was dropped
    slab.close()


def test_a_descriptor_beyond_the_file_is_refused(run_id):
    slab = ShmSlab(run_id, "s2")
    (d,) = slab.layout([((4,), np.int64)])
    bad = ShmArray(d.path, 1 << 30, d.dtype, d.shape)
    with pytest.raises(ValueError, match="beyond"):
        ShmReader().get(bad)
    slab.close()


def test_remove_run_files_removes_only_that_runs_files(run_id):
    mine, other = ShmSlab(run_id, "s0"), ShmSlab(run_id + "x", "s0")
    mine.layout([((4,), np.int64)])
    other.layout([((4,), np.int64)])
    try:
        assert remove_run_files(run_id) == 1
        assert not os.path.exists(mine.path) and os.path.exists(other.path)
    finally:
        other.close()
        mine.path = None
    assert not any(p.startswith(f"cpr-{run_id}-") for p in os.listdir(SHM_DIR))


@pytest.mark.parametrize("kind", ["table_wise", "row_wise"])
def test_shard_through_shared_memory_equals_shard_through_the_call(kind, run_id):
    """Two shards from the same seed, one fed arrays and one fed descriptors, over a few
    steps: identical pooled outputs and identical rows after the updates."""
    plan = make_plan(kind, [60] * 26, 2)

    def shard():
        return EmbeddingShard(1, list(plan.shards[1]), 4, learning_rate=0.1, eps=1e-8, seed=5, microbatches_per_step=1)

    direct, shared = shard(), shard()
    slab = ShmSlab(run_id, "s1")
    rng = np.random.default_rng(0)
    for step in range(4):
        rows = rng.integers(0, 60, size=(16, 26))
        sb = plan.route(rows, 1)
        width = sb.lengths.shape[0] * 4
        d_len, d_idx, d_out = slab.layout(
            [(sb.lengths.shape, np.int64), (sb.indices.shape, np.int64), ((16, width), np.float32)]
        )
        slab.view(d_len)[...] = sb.lengths
        slab.view(d_idx)[...] = sb.indices
        a = direct.lookup(step, (step,), sb.lengths, sb.indices)
        assert shared.lookup(step, (step,), d_len, d_idx, out=d_out) == d_out
        assert np.array_equal(slab.view(d_out), a)
        grad = rng.standard_normal(a.shape).astype(np.float32)
        (d_grad,) = slab.layout([(grad.shape, np.float32)])
        slab.view(d_grad)[...] = grad
        assert direct.push_grads(step, (step,), grad) == shared.push_grads(step, (step,), d_grad)
    for (w0, m0), (w1, m1) in zip(direct.get_rows(), shared.get_rows()):
        assert np.array_equal(w0, w1) and np.array_equal(m0, m1)
    assert shared.state().shm_reads == 4 * 3 and direct.state().shm_reads == 0
    slab.close()


def test_a_gradient_waiting_for_the_rest_of_its_step_is_a_copy(run_id):
    """With two chunks a step, the first chunk's gradient waits in the shard while the
    trainer reuses its slab: the update must use the gradient as it was pushed."""
    plan = make_plan("table_wise", [60] * 26, 2)

    def shard():
        return EmbeddingShard(0, list(plan.shards[0]), 4, learning_rate=0.1, eps=1e-8, seed=5, microbatches_per_step=2)

    direct, shared = shard(), shard()
    slab = ShmSlab(run_id, "s0")
    rng = np.random.default_rng(1)
    batches = [plan.route(rng.integers(0, 60, size=(8, 26)), 0) for _ in range(2)]
    grads = [rng.standard_normal((8, len(plan.shards[0]) * 4)).astype(np.float32) for _ in range(2)]
    for m, sb in enumerate(batches):
        direct.lookup(0, (m,), sb.lengths, sb.indices)
        shared.lookup(0, (m,), sb.lengths, sb.indices)
    for m, g in enumerate(grads):
        (d,) = slab.layout([(g.shape, np.float32)])
        slab.view(d)[...] = g
        assert direct.push_grads(0, (m,), g) == shared.push_grads(0, (m,), d)
        slab.view(d)[...] = np.nan  # the trainer's next use of its slab
    for (w0, m0), (w1, m1) in zip(direct.get_rows(), shared.get_rows()):
        assert np.array_equal(w0, w1) and np.array_equal(m0, m1)
    slab.close()


def test_a_new_slab_after_a_recovery_is_never_served_from_the_old_mapping(run_id):
    """After a failed call or new shard handles the trainer drops its slabs and makes new
    ones; a surviving shard must read the new file, not the one it had mapped (a bug once:
    the new slab reused the old file name, and the shard kept reading the unlinked file)."""
    reader = ShmReader()
    old = ShmSlab(run_id, "s0")
    (d_old,) = old.layout([((4,), np.int64)])
    old.view(d_old)[...] = 1
    assert reader.get(d_old).tolist() == [1] * 4
    old.close()
    new = ShmSlab(run_id, "s0")
    (d_new,) = new.layout([((4,), np.int64)])
    new.view(d_new)[...] = 2
    assert d_new.path != d_old.path
    assert reader.get(d_new).tolist() == [2] * 4
    assert len(reader._maps) == 1  # the old, unlinked file's mapping is gone
    new.close()


def test_a_dead_trainers_slabs_go_and_no_one_elses(tmp_path):
    # A killed trainer's slabs are removed when its replacement registers; only its own.
    if not shm_available():
        pytest.skip("no /dev/shm on this machine")
    ours, theirs = ShmSlab("rmtest", "s0"), ShmSlab("rmtest", "s1")
    for slab in (ours, theirs):
        slab.layout([((8,), np.float32)])
    other_pid = f"{SHM_DIR}/cpr-rmtest-s0-{os.getpid() + 1}-0-1"
    open(other_pid, "w").close()
    try:
        assert remove_run_files("rmtest", pid=os.getpid()) == 2
        assert os.path.exists(other_pid) and not os.path.exists(ours.path)
    finally:
        assert remove_run_files("rmtest") == 1
