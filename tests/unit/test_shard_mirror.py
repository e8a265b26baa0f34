"""A shard's step applies at its commit, and a mirror fed the primary's complete steps holds
the same rows and Adagrad state bit for bit, takes its place with nothing lost, and refuses to
when it missed a step (``actors.shard_mirror``). Without Ray: the feed is called by hand, or
through a fake handle. A stalled mirror is the one killed, and an act that outlasts the
shard's lease fences the shard."""

import time

import numpy as np
import pytest
import ray

from core.plan import make_plan
from core.records import PushResult
from actors.lease import Fenced, LeaseSpec, shard_place
from actors.shard import EmbeddingShard
from actors.shard_chunks import merge_chunks
from actors.shard_mirror import MirrorMissed

pytestmark = pytest.mark.timeout(120)

DIM, M = 4, 2
PLAN = make_plan("table_wise", [60] * 26, 2)


@pytest.fixture(autouse=True)
def _no_ray(monkeypatch):
    monkeypatch.setattr("ray.get_runtime_context", lambda: type("C", (), {"get_node_id": lambda self: "n"})())


def _shard(**kw):
    return EmbeddingShard(0, list(PLAN.shards[0]), DIM, 0.1, 1e-8, 3, microbatches_per_step=M, **kw)


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

        def check_act(self, act, ended=None):
            pass

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


def _lookups(shard, step, seed=None):
    rng = np.random.default_rng(step if seed is None else seed)
    for mb in (0, 1):
        sb = PLAN.route(rng.integers(0, 60, size=(8, 26)), 0)
        shard.lookup(step, (step * M + mb,), sb.lengths, sb.indices)
    return [rng.standard_normal((8, len(PLAN.shards[0]) * DIM)).astype(np.float32) for _ in (0, 1)]


class _StalledMirror:
    """A mirror's handle whose replicate calls are never answered (a stalled process)."""

    class _Method:
        def __init__(self, name):
            self.name = name

        def remote(self, *args):
            return self.name

    sync_base, replicate = _Method("sync_base"), _Method("replicate")


def test_a_stalled_mirror_is_killed_before_its_trainer_gives_up_on_the_primary(monkeypatch):
    """Defect 5 of issue 39: the primary waited for its mirror as long as its trainer waits for
    the push (T), and the trainer's wait began first: the trainer gave up and reported the
    healthy primary. Now the primary gives up on the mirror well within T, kills it and answers
    the push (stale: the step is redone without the mirror), and the redo applies here alone."""
    T = 8.0  # embeddings.call_timeout_s: the trainer's wait for push_grads
    mirror, waited, killed = _StalledMirror(), [], []

    def get(refs, timeout=None):
        if refs == "replicate":
            waited.append(timeout)  # Ray waits this long, then gives up
            raise ray.exceptions.GetTimeoutError(f"no answer in {timeout}s")
        return None  # the base's copy arrived

    context = type("C", (), {"namespace": "ns", "get_node_id": lambda self: "n"})()
    monkeypatch.setattr("ray.get_runtime_context", lambda: context)
    monkeypatch.setattr("ray.get_actor", lambda name, namespace=None: mirror)
    monkeypatch.setattr("ray.get", get)
    monkeypatch.setattr("ray.kill", lambda handle, no_restart=True: killed.append(handle))
    primary, alone = _shard(call_timeout_s=T), _shard(call_timeout_s=T)
    primary.attach_mirror("mirror", T)
    for shard in (primary, alone):
        grads = _lookups(shard, 0)
        assert shard.push_grads(0, (1,), grads[1]) == PushResult(applied=False)
    assert primary.push_grads(0, (0,), grads[0]) == PushResult(applied=False, stale=True)
    assert killed == [mirror] and len(waited) == 1
    # What the push waited at most (its lease's confirmation, then the mirror) is under T.
    assert waited[0] + primary.deadlines.lock_wait_s < T, (waited, T)
    for shard in (primary, alone):  # the step redone: applied here, without the mirror
        grads = _lookups(shard, 0)
        assert shard.push_grads(0, (1,), grads[1]) == PushResult(applied=False)
        assert shard.push_grads(0, (0,), grads[0]) == PushResult(applied=True)
        _step(shard, 1)
    assert len(waited) == 1 and primary.applied_step == 0 and _same(primary, alone)


def _cut_off_lease(shard, clock):
    """A real lease on shard 0's place, renewed once at ``clock[0]`` (held one term from then),
    then cut off from the GCS; returns the fences it calls (the process would exit)."""
    fenced, reachable = [], [True]

    def read(key, timeout_s):
        if not reachable[0]:
            raise TimeoutError("GCS unreachable")
        return None  # the key unset: held by this reader

    shard._lease = LeaseSpec("run", 1.0).lease(shard_place(0, 0), read=read, clock=lambda: clock[0],
                                               on_fenced=lambda holder, why: fenced.append(why))
    shard._lease.renew()
    reachable[0] = False
    return fenced


def test_an_apply_that_outlasts_its_lease_fences_the_shard_instead_of_serving_on(monkeypatch):
    """Defect 7 of issue 39: hold() promised that the apply after it ends within the lease, and
    nothing checked it. An apply that ends after the lease ran out may have overlapped the
    successor's: the shard is fenced (it exits) instead of answering and serving on."""
    clock, shard = [100.0], _shard()
    _step(shard, 0)
    fenced = _cut_off_lease(shard, clock)  # held until 101.0
    apply = shard._apply

    def slow_apply(step):
        record = apply(step)
        clock[0] += 1.5  # the apply outlasted the lease
        return record

    monkeypatch.setattr(shard, "_apply", slow_apply)
    with pytest.raises(Fenced):
        _step(shard, 1)  # step 1's first lookup commits step 0
    assert fenced == ["held no lease when shard 0's apply of step 0 ended (it may have overlapped a successor)"]
    with pytest.raises(Fenced):
        shard._lease.hold(timeout_s=0)


def test_a_push_whose_mirror_outlasted_the_lease_is_not_answered_complete():
    """The other act under hold(): answering a push as complete. A mirror's receipt that came
    after the lease ran out fences the shard; the trainer never hears the step is complete."""
    clock, shard = [100.0], _shard()
    fenced = _cut_off_lease(shard, clock)

    class _SlowFeed:
        name = "mirror"

        def send(self, step, *inputs):
            clock[0] += 1.5  # the mirror answered after the lease ran out
            return True

    shard._feed = _SlowFeed()
    grads = _lookups(shard, 0)
    assert shard.push_grads(0, (1,), grads[1]) == PushResult(applied=False)
    with pytest.raises(Fenced):
        shard.push_grads(0, (0,), grads[0])
    assert fenced == ["held no lease when shard 0's completion of step 0 ended (it may have overlapped a successor)"]


def _audit(tmp_path):
    import json
    return [json.loads(line) for line in (tmp_path / "shard-0-g0.jsonl").read_text().splitlines()]


def test_an_apply_fenced_at_its_end_leaves_no_apply_record_in_the_audit_log(tmp_path, monkeypatch):
    """Soak seed 7 (soak-7-20261127T210826): generation 3 of shard 0 was stopped (a 19.3 s
    stall) after hold() and before its apply of step 1076; generation 4 took over meanwhile.
    Resumed, it applied the step in its own memory, and check_act fenced it (it exited, nothing
    answered), but the audit log already said "apply", so ``cpr verify`` saw generation 3 apply a
    step after generation 4 took over. An apply is recorded only once it is known to have ended
    within the lease, stamped with the moment it ended."""
    clock, shard = [100.0], _shard(audit_dir=str(tmp_path))
    _step(shard, 0)
    fenced = _cut_off_lease(shard, clock)  # held until 101.0
    apply = shard._apply

    def stalled_apply(step):
        clock[0] += 19.3  # stopped between hold() and the apply: the successor took over
        return apply(step)

    monkeypatch.setattr(shard, "_apply", stalled_apply)
    with pytest.raises(Fenced):
        _step(shard, 1)  # step 1's first lookup commits step 0
    assert fenced == ["held no lease when shard 0's apply of step 0 ended (it may have overlapped a successor)"]
    assert [r["event"] for r in _audit(tmp_path)] == ["open", "complete"]


def test_an_apply_within_its_lease_is_recorded_with_the_moment_it_ended(tmp_path, monkeypatch):
    """The record of an apply that held its lease carries the moment the apply ended, not the
    moment it was written (after the check): a stall between the two cannot date it after the
    successor's load."""
    clock, shard = [100.0], _shard(audit_dir=str(tmp_path))
    _step(shard, 0)
    _cut_off_lease(shard, clock)
    wall = [1000.0]
    monkeypatch.setattr("actors.shard.time.time", lambda: wall[0])
    check = shard._lease.check_act

    def stalled_check(act, ended=None):
        check(act, ended)
        wall[0] += 30.0  # stopped after the check, before the record was written

    monkeypatch.setattr(shard._lease, "check_act", stalled_check)
    _step(shard, 1)
    applies = [r for r in _audit(tmp_path) if r["event"] == "apply"]
    assert [(r["step"], r["t"]) for r in applies] == [(0, 1000.0)]


def test_a_primary_that_cannot_confirm_its_place_kills_no_mirror(monkeypatch):
    """A primary cut off from the cluster, whose mirror was promoted meanwhile, came back and
    timed out feeding it: before, it killed the mirror, which was the shard by then."""
    from actors.shard_mirror import MirrorFeed

    killed = []
    monkeypatch.setattr(ray, "kill", lambda handle, no_restart=True: killed.append(handle))
    assert not MirrorFeed("mirror", "m", 1.0, may_act=lambda: False).kill() and killed == []
    assert MirrorFeed("mirror", "m", 1.0, may_act=lambda: True).kill() and killed == ["mirror"]
