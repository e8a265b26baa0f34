"""A mirror on its primary's node is fed over its link, the step's arrays in a shared-memory
slab (``actors.shard_mirror``, ``actors.shm``): the same rows as a mirror fed by Ray calls, the
same deadline, no slab file left behind, and Ray calls where there is no shared memory. Real
shards and a real link in this process; Ray's calls are stubbed."""

import time
from pathlib import Path

import numpy as np
import pytest

from core.records import PushResult
from tests.unit.test_shard_mirror import DIM, M, PLAN, _mirror, _same, _shard, _step

pytestmark = pytest.mark.timeout(120)


def test_a_mirror_on_the_primarys_node_takes_its_steps_over_its_link(monkeypatch):
    """A mirror on the primary's node is fed over its link, the arrays in a shared-memory slab
    (a Ray call carrying them cost most of a demo step): the mirror holds the primary's rows bit
    for bit, through a redo; a mirror that refuses a step over the link is killed, and the step
    is redone without it. Neither leaves its slab file behind."""
    primary, mirror, killed = _linked_pair(monkeypatch)
    run = f"t{time.monotonic_ns()}"
    assert primary.attach_mirror("mirror", 5.0, run, mirror._link.address)["linked"]
    for step in range(4):
        _step(primary, step)
    _step(primary, 3, seed=99)  # redone with other gradients: replaced on the mirror too
    deadline = time.monotonic() + 5
    while mirror.applied_step < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert mirror.applied_step == 2 and mirror._shm.reads == 3 * 5  # 5 steps sent, 3 arrays each
    slabs = lambda: sorted(Path("/dev/shm").glob(f"cpr-{run}-mirror0-*"))  # noqa: E731
    assert len(slabs()) == 1
    feed, primary._feed = primary._feed, None  # the primary's death: its slab file stays behind
    feed._link.close()
    mirror.adopt(0, list(PLAN.shards[0]), 1, committed=4)
    assert slabs() == [], "the promoted mirror removes its dead primary's slab"
    _step(primary, 4)
    _step(mirror, 4)
    assert _same(primary, mirror) and not killed

    other = _mirror(primary)
    assert primary.attach_mirror("mirror2", 5.0, run, other._link.address)["linked"]
    other._mirror.broken = "lost a step"  # it refuses the next step
    last = _half_pushed(primary, 5)
    assert primary.push_grads(5, (5 * M,), last) == PushResult(applied=False, stale=True)
    assert len(killed) == 1 and primary._feed is None
    assert slabs() == [], "a killed mirror's slab goes with its feed"


def _half_pushed(shard, step: int) -> np.ndarray:
    """Step ``step`` looked up and its second chunk pushed; returns the first chunk's gradient,
    whose push completes the step."""
    rng = np.random.default_rng(step)
    for mb in (0, 1):
        sb = PLAN.route(rng.integers(0, 60, size=(8, 26)), 0)
        shard.lookup(step, (step * M + mb,), sb.lengths, sb.indices)
    grads = [rng.standard_normal((8, len(PLAN.shards[0]) * DIM)).astype(np.float32) for _ in (0, 1)]
    assert shard.push_grads(step, (step * M + 1,), grads[1]) == PushResult(applied=False)
    return grads[0]


def _linked_pair(monkeypatch, **kw):
    """A primary (``_shard(**kw)``) feeding a real mirror in this process over the mirror's link."""
    from actors.shard_link import link_supported
    from actors.shm import shm_available

    if not (link_supported() and shm_available()):
        pytest.skip("needs Linux's abstract Unix sockets and /dev/shm")
    killed = []
    handle = type("Handle", (), {"sync_base": type("R", (), {"remote": staticmethod(lambda *a: None)})})
    context = type("C", (), {"namespace": "ns", "get_node_id": lambda self: "n"})()
    monkeypatch.setattr("ray.get_runtime_context", lambda: context)
    monkeypatch.setattr("ray.get_actor", lambda name, namespace=None: handle)
    monkeypatch.setattr("ray.get", lambda refs, timeout=None: None)
    monkeypatch.setattr("ray.kill", lambda h, no_restart=True: killed.append(h))
    primary = _shard(**kw)
    mirror = _mirror(primary)
    return primary, mirror, killed


def test_a_mirror_stalled_on_its_link_is_killed_within_the_primarys_deadline(monkeypatch):
    """The link keeps the Ray path's budget: a mirror that does not answer a step is killed and
    the push answered (stale: redone without it) within the lease's wait and ``mirror_feed_s``,
    one deadline for the send and the receipt, well before the trainer's T."""
    import threading

    T = 2.0
    primary, mirror, killed = _linked_pair(monkeypatch, call_timeout_s=T)
    assert primary.attach_mirror("mirror", 5.0, f"t{time.monotonic_ns()}", mirror._link.address)["linked"]
    _step(primary, 0)
    release = threading.Event()
    held = threading.Thread(target=lambda: (mirror._lock.acquire(), release.wait(10), mirror._lock.release()))
    held.start()  # the mirror is stalled: its replicate waits for its lock
    try:
        last = _half_pushed(primary, 1)
        t0 = time.monotonic()
        assert primary.push_grads(1, (1 * M,), last) == PushResult(applied=False, stale=True)
        waited = time.monotonic() - t0
    finally:
        release.set()
        held.join()
    assert len(killed) == 1 and primary._feed is None
    assert primary.deadlines.mirror_feed_s - 0.1 <= waited < primary.deadlines.mirror_feed_s + 0.5 < T, waited


def test_without_shared_memory_a_mirror_on_the_node_is_fed_by_ray_calls(monkeypatch):
    primary, mirror, _ = _linked_pair(monkeypatch)
    monkeypatch.setattr("actors.shard_mirror.shm_available", lambda: False)
    assert not primary.attach_mirror("mirror", 5.0, "r", mirror._link.address)["linked"]
    assert primary._feed._link is None
