"""A shard's step applies at its commit, and a mirror fed the primary's complete steps holds
the same rows and Adagrad state bit for bit, takes its place with nothing lost, and refuses to
when it missed a step (``actors.shard_mirror``). Without Ray: the feed is called by hand."""

import time

import numpy as np
import pytest

from core.plan import make_plan
from core.records import PushResult
from actors.shard import EmbeddingShard
from actors.shard_chunks import merge_chunks
from actors.shard_mirror import MirrorMissed

pytestmark = pytest.mark.timeout(120)

DIM, M = 4, 2
PLAN = make_plan("table_wise", [60] * 26, 2)


@pytest.fixture(autouse=True)
def _no_ray(monkeypatch):
    monkeypatch.setattr("ray.get_runtime_context", lambda: type("C", (), {"get_node_id": lambda self: "n"})())


def _shard():
    return EmbeddingShard(0, list(PLAN.shards[0]), DIM, 0.1, 1e-8, 3, microbatches_per_step=M)


def _mirror(primary):
    mirror = EmbeddingShard(None, None, DIM, 0.1, 1e-8, 3, microbatches_per_step=M, spare="x-spare0")
    mirror.become_mirror(0, list(PLAN.shards[0]))
    rows = primary.tbe.split_embedding_weights(), primary.tbe.split_optimizer_states()
    mirror.sync_base(0, primary.applied_step, [w.numpy() for w in rows[0]], [s[0].numpy() for s in rows[1]])
    return mirror


def _step(shard, step, mirror=None, seed=None):
    """One step of two one-microbatch chunks; the mirror gets it as the primary's feed would."""
    rng = np.random.default_rng(step if seed is None else seed)
    pooled = []
    for mb in (0, 1):
        sb = PLAN.route(rng.integers(0, 60, size=(8, 26)), 0)
        pooled.append(shard.lookup(step, (step * M + mb,), sb.lengths, sb.indices))
    for mb in (1, 0):
        grad = rng.standard_normal((8, len(PLAN.shards[0]) * DIM)).astype(np.float32)
        result = shard.push_grads(step, (step * M + mb,), grad)
    assert result == PushResult(applied=True)
    if mirror is not None:
        mirror.replicate(step, *merge_chunks(shard._pending.ordered(step)))
    return pooled


def _same(a, b) -> bool:
    return all(np.array_equal(x[0], y[0]) and np.array_equal(x[1], y[1]) for x, y in zip(a.get_rows(), b.get_rows()))


def test_a_step_applies_at_its_commit_so_a_redo_finds_the_rows_of_the_first_attempt():
    shard = _shard()
    first = _step(shard, 0)
    assert shard.applied_step == -1, "complete, not committed yet"
    again = _step(shard, 0)  # the step failed elsewhere and is redone: same ids, same rows
    assert all(np.array_equal(a, b) for a, b in zip(first, again))
    _step(shard, 1)  # a request for step 1: step 0 is committed
    assert shard.applied_step == 0 and [s for s, _ in shard.applied_microbatches] == [0]
    assert shard.applied_log() == [(0, (0, 1)), (1, (2, 3))]


def test_a_mirror_fed_every_step_is_bit_identical_and_takes_over_with_nothing_lost():
    primary = _shard()
    _step(primary, 0)
    _step(primary, 1)
    mirror = _mirror(primary)  # attached mid-run: base after step 0, step 1 complete
    mirror.replicate(1, *merge_chunks(primary._pending.ordered(1)))
    for step in range(2, 6):
        _step(primary, step, mirror)
    _step(primary, 5, mirror, seed=99)  # step 5 redone with other gradients: replaced on both
    deadline = time.monotonic() + 5
    while mirror.applied_step < 4 and time.monotonic() < deadline:
        time.sleep(0.01)  # the mirror applies committed steps on its own thread
    assert mirror.applied_step == 4 and primary.applied_step == 4
    info = mirror.adopt(0, list(PLAN.shards[0]), 1, committed=5)
    assert info.shard_id == 0 and info.generation == 1
    # Both at 5 committed steps with step 5 complete; step 6 commits it on each.
    _step(primary, 6)
    _step(mirror, 6)
    assert _same(primary, mirror)


def test_a_mirror_that_missed_a_step_refuses_to_serve():
    primary = _shard()
    mirror = _mirror(primary)
    _step(primary, 0, mirror)
    _step(primary, 1)  # not sent: the feed failed
    with pytest.raises(MirrorMissed, match="got step 2 after step 0"):
        _step(primary, 2, mirror)
    with pytest.raises(MirrorMissed, match="cannot serve"):
        mirror.adopt(0, list(PLAN.shards[0]), 1)

    behind = _mirror(_shard())
    _step(_shard(), 0, behind)
    with pytest.raises(MirrorMissed, match="holds steps up to 0 but 3 steps are committed"):
        behind.adopt(0, list(PLAN.shards[0]), 1, committed=3)


def test_a_shard_cut_off_from_the_cluster_applies_no_committed_step():
    """The commit of a step is shown by the next step's request; a shard whose place is not
    confirmed then (a host cut off: its successor may hold it) applies nothing and says so, and
    applies the step once its lease holds again. (Seen on the namespace cluster: a cut-off shard
    applied a step after its successor took over.)"""
    from core.errors import StaleLease

    class Lease:
        term_s, ok = 0.01, False

        def hold(self, timeout_s=None):
            return self.ok

    shard = _shard()
    _step(shard, 0)
    lease = shard._lease = Lease()
    lease.ok = True
    _step(shard, 1)  # step 0 applied: the place is held
    lease.ok = False
    with pytest.raises(StaleLease, match="step 1 is not applied"):
        _step(shard, 2)
    assert shard.applied_step == 0
    lease.ok = True
    _step(shard, 2)
    assert shard.applied_step == 1
