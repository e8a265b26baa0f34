"""A step's update is the same bits however the trainers split it (its microbatches apply in
id order), and MFU/SSU tracking counts a step's rows once, when it is applied, not once per
lookup (a redone step looked up twice). Shards without Ray, as in test_shard."""

import numpy as np
import pytest

from core.plan import make_plan, shard_row_ids
from core.records import PushResult
from actors.shard import EmbeddingShard
from actors.shard_chunks import merge_chunks

pytestmark = pytest.mark.timeout(120)

TABLE_ROWS = [50] * 26
DIM, M, ROWS = 4, 4, 8  # ROWS: each microbatch's rows
PLAN = make_plan("table_wise", TABLE_ROWS, 1)
MFU = {"policy": "mfu", "r": 0.1, "sample_rate": 1.0, "full_every": 100}


@pytest.fixture(autouse=True)
def _no_ray(monkeypatch):
    monkeypatch.setattr("ray.get_runtime_context", lambda: type("C", (), {"get_node_id": lambda self: "n"})())


def _shard(**kw):
    return EmbeddingShard(0, list(PLAN.shards[0]), DIM, 0.1, 1e-8, 3, microbatches_per_step=M, **kw)


def _microbatches(seed):
    """M microbatches' rows and pooled gradients; few distinct ids, so that every row is in
    several microbatches and the order its gradients are summed in matters."""
    rng = np.random.default_rng(seed)
    rows = rng.integers(0, 3, size=(M, ROWS, 26))
    grads = rng.standard_normal((M, ROWS, 26 * DIM)).astype(np.float32) * 10.0 ** rng.integers(-3, 3, size=(M, ROWS, 1))
    return rows, grads.astype(np.float32)


def _run(shard, step, split, rows, grads, push_order=None):
    """Step ``step`` as the trainers would send it, split into chunks of positions ``split``."""
    chunks = [tuple(step * M + i for i in part) for part in split]
    for part, chunk in zip(split, chunks):
        sb = PLAN.route(np.concatenate([rows[i] for i in part]), 0)
        shard.lookup(step, chunk, sb.lengths, sb.indices)
    results = [shard.push_grads(step, chunks[j], np.concatenate([grads[i] for i in split[j]]))
               for j in (push_order or range(len(split)))]
    assert results[-1] == PushResult(applied=True)


def _same(a, b) -> bool:
    return all(np.array_equal(x[0], y[0]) and np.array_equal(x[1], y[1]) for x, y in zip(a.get_rows(), b.get_rows()))


def test_a_step_split_among_trainers_applies_the_same_bits_as_one_whole_chunk():
    """One trainer sends chunk (0,1,2,3); two send (0,2) and (1,3) (positions by rank); four
    send one each; a whole chunk out of order: every shard ends with the same weights and
    Adagrad state, bit for bit."""
    splits = [[(0, 1, 2, 3)], [(0, 2), (1, 3)], [(1, 3), (0, 2)], [(0,), (1,), (2,), (3,)], [(0, 3), (1,), (2,)],
              [(2, 0, 3, 1)]]
    shards = [_shard() for _ in splits]
    for step in range(3):
        rows, grads = _microbatches(step)
        for shard, split in zip(shards, splits):
            _run(shard, step, split, rows, grads, push_order=range(len(split))[::-1])
    whole = shards[0]
    initial = _shard()
    assert not _same(whole, initial), "the steps changed the rows"
    for shard, split in zip(shards[1:], splits[1:]):
        assert _same(whole, shard), f"split {split} applied other bits than one whole chunk"


def test_the_merged_batch_is_in_microbatch_order_whatever_the_split():
    """What the kernel (and a mirror, fed the same merge) gets: the whole step's ids and
    gradient rows in microbatch-id order."""
    rows, grads = _microbatches(9)
    whole, split = _shard(), _shard()
    _run(whole, 0, [(0, 1, 2, 3)], rows, grads)
    _run(split, 0, [(0, 2), (1, 3)], rows, grads)
    a, b = merge_chunks(whole._pending.ordered(0)), merge_chunks(split._pending.ordered(0))
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    sb = PLAN.route(rows.reshape(M * ROWS, 26), 0)
    assert np.array_equal(b[0], sb.lengths) and np.array_equal(b[1], sb.indices)
    assert np.array_equal(b[2], grads.reshape(M * ROWS, -1))


def _counts(shard) -> np.ndarray:
    shard._ckpt._tracker.drain()
    return shard._ckpt.priority._counts.copy()


def _expected(shard, *batches) -> np.ndarray:
    offsets = np.concatenate([[0], np.cumsum([s.num_rows for s in shard.slices])])
    ids = np.concatenate([shard_row_ids(sb.lengths, sb.indices, offsets) for sb in batches])
    return np.bincount(ids, minlength=int(offsets[-1]))


def test_tracking_counts_a_redone_step_once_at_its_apply():
    """A step looked up twice (the first attempt failed elsewhere and is redone) counts its
    rows once, and only once applied: a step never applied counts nothing."""
    shard = _shard(priority=MFU)
    rows, grads = _microbatches(4)
    sb = PLAN.route(rows.reshape(M * ROWS, 26), 0)
    chunk = tuple(range(M))
    shard.lookup(0, chunk, sb.lengths, sb.indices)
    shard.lookup(0, chunk, sb.lengths, sb.indices)  # the redo
    assert not _counts(shard).any(), "looked up, not applied: nothing counted yet"
    assert shard.push_grads(0, chunk, grads.reshape(M * ROWS, -1)) == PushResult(applied=True)
    shard.get_rows()  # commits step 0: it applies
    assert np.array_equal(_counts(shard), _expected(shard, sb))


def test_tracking_counts_a_split_step_once_and_a_mirror_counts_nothing():
    primary = _shard(priority=MFU)
    mirror = EmbeddingShard(None, None, DIM, 0.1, 1e-8, 3, microbatches_per_step=M, priority=MFU, spare="x-spare0")
    mirror.become_mirror(0, list(PLAN.shards[0]))
    w, st = primary.tbe.split_embedding_weights(), primary.tbe.split_optimizer_states()
    mirror.sync_base(0, primary.applied_step, [x.numpy() for x in w], [s[0].numpy() for s in st])
    batches = []
    for step in range(2):
        rows, grads = _microbatches(step)
        _run(primary, step, [(0, 2), (1, 3)], rows, grads)
        mirror.replicate(step, *merge_chunks(primary._pending.ordered(step)))
        batches.append(PLAN.route(rows.reshape(M * ROWS, 26), 0))
    with mirror._lock:
        mirror._apply_committed()  # step 0, as the mirror's thread would
    assert mirror.applied_step == 0 and not _counts(mirror).any()
    assert primary.applied_step == 0 and np.array_equal(_counts(primary), _expected(primary, batches[0]))
    primary.get_rows()
    assert np.array_equal(_counts(primary), _expected(primary, *batches))
