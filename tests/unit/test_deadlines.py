"""Nested timeouts, read from the real values: the timeout every caller passes through
``SupervisorClient`` (recorded from its calls), against how long the supervisor's methods
really block before they answer or give up (measured on the trainer desk with fakes).
Before, the driver waited 2 T for ``restore`` (which waits up to 4 T) and trainers 5 T for
``await_final`` (2 T of draining, then 4 T)."""

from __future__ import annotations

import inspect
import threading
import time

import pytest

from actors.client import SupervisorClient
from actors.supervisor.desk import TrainerDesk
from actors.supervisor.events import EventLog
from actors.supervisor.hooks import HookList
from actors.supervisor.machine import RecoveringShards
from actors.supervisor.restore_targets import RestoreTargets
from core.deadlines import BLOCKING, Deadlines
from core.errors import ShardUnavailable
from core.records import TrainerSetup
from policies import BudgetLimits, FailurePolicy

pytestmark = pytest.mark.timeout(60)

T = 0.05  # embeddings.call_timeout_s, small so the desk gives up quickly


class _Remote:
    def __init__(self, name: str):
        self.name = name

    def remote(self, *args):
        return self.name


class _Handle:
    def __getattr__(self, name: str) -> _Remote:
        return _Remote(name)


def caller_timeouts(deadlines: Deadlines) -> dict[str, float]:
    """method -> the timeout each SupervisorClient method passes to ray.get."""
    seen: dict[str, float] = {}
    client = SupervisorClient(_Handle(), deadlines, get=lambda ref, timeout: seen.setdefault(ref, timeout))
    for name, method in inspect.getmembers(client, inspect.ismethod):
        if name.startswith("_") or name in ("wait", "status_ref", "start"):
            continue
        arity = len(inspect.signature(method).parameters)
        method(*[0] * arity)
    client.wait("start", "start")
    return seen


def test_every_caller_waits_longer_than_the_method_it_calls():
    d = Deadlines(shard_call_s=30.0)
    seen = caller_timeouts(d)
    assert set(BLOCKING) <= set(seen), "every blocking method is called through the client"
    for method, timeout in seen.items():
        assert timeout > d.inner_s(method), (method, timeout, d.inner_s(method))
    assert seen["await_final"] > d.save_drain_s + d.supervisor_wait_s
    assert seen["restore"] > d.supervisor_wait_s


class _StuckController:
    """A recovery that never settles, shards that started."""

    def __init__(self, started: bool = True):
        self.started = started
        self.changed = threading.Condition()

    def wait_started(self, timeout_s):
        if not self.started:
            time.sleep(timeout_s)
        return self.started, None

    def state_now(self):
        return RecoveringShards({0: 1}, (10,), (), None)

    def fleet(self):
        return 1, ("shard-0", "shard-1")

    def rollback_after(self, known):
        return None

    def resume_point(self):
        return None

    def wait_settled(self, timeout_s):
        time.sleep(timeout_s)
        return False

    def wait_generation_after(self, generation, timeout_s):
        time.sleep(timeout_s)


class _Trainers:
    def has_started(self):
        return False

    def live_established(self, rank, timeout_s):
        return {}

    def unpin(self, rank):
        pass


class _Checkpoints:
    store = None
    targets = RestoreTargets(lambda: None)

    def next_due(self):
        return None


def _desk(controller) -> TrainerDesk:
    lock = threading.RLock()
    events = EventLog(lock, HookList(), lambda: None)
    return TrainerDesk(lock, controller, _Checkpoints(), _Trainers(), events, FailurePolicy(BudgetLimits()),
                       Deadlines(T), TrainerSetup(finished=False), lambda step: None, True, "r")


def _blocked_s(call) -> float:
    t0 = time.monotonic()
    with pytest.raises(ShardUnavailable):
        call()
    return time.monotonic() - t0


@pytest.mark.parametrize("method, call", [
    ("await_shards", lambda desk: desk.await_shards(0, 5)),
    ("fallback_to_checkpoint", lambda desk: desk.fallback_to_checkpoint(5, 1)),
    ("trainer_setup", lambda desk: desk.trainer_setup(0)),
])
def test_a_supervisor_method_gives_up_before_its_caller_does(method, call):
    desk = _desk(_StuckController(started=method != "trainer_setup"))
    blocked_s = _blocked_s(lambda: call(desk))
    caller_s = caller_timeouts(Deadlines(T))[method]
    assert blocked_s <= Deadlines(T).inner_s(method) + 0.05, (method, blocked_s)
    assert caller_s > blocked_s, (method, caller_s, blocked_s)


@pytest.mark.parametrize("t", [0.05, 2.0, 10.0, 60.0, 3600.0])
def test_every_wait_inside_a_shard_call_is_shorter_than_what_its_caller_waits(t):
    """Issue 39: a primary waited for its mirror as long as its trainer waited for the primary,
    and a save waited for the previous write with no deadline at all; the healthy caller's
    callee was declared dead, not the slow party behind it. Every pair nests strictly now."""
    d = Deadlines(shard_call_s=t)
    pairs = d.nesting()
    callers = {outer for _, _, outer, _ in pairs}
    assert {"the trainer's push_grads", "the trainer's lookup", "the supervisor's save_checkpoint",
            "the supervisor's save_written"} <= callers
    for inner, inner_s, outer, outer_s in pairs:
        assert 0 < inner_s < outer_s, (inner, inner_s, outer, outer_s)
    # A push waits for its lease, then its mirror: together still inside the trainer's wait,
    # with room for a call queued behind another's waits under the lock.
    assert d.lock_wait_s + d.mirror_feed_s < d.shard_call_s
    assert d.written_s < d.shard_call_s and d.mirror_feed_s < d.shard_call_s


@pytest.mark.parametrize("t, c", [(0.05, 0.05), (2.0, 60.0), (60.0, 60.0), (60.0, 1.0), (3600.0, 3600.0)])
def test_every_wait_of_a_step_is_shorter_than_its_peers_wait_for_it(t, c):
    """Whatever embeddings.call_timeout_s (T) and training.collective_timeout_s (C) are: they
    need no relation to each other, each trainer's wait nests inside its peers' wait for it."""
    d = Deadlines(shard_call_s=t, collective_s=c)
    for inner, inner_s, outer, outer_s in d.step_nesting():
        assert 0 < inner_s < outer_s, (inner, inner_s, outer, outer_s)


def test_a_peer_waits_for_the_next_quorum_longer_than_the_saving_trainer_saves(monkeypatch):
    """Item 5: the saving trainer (the quorum's first participant) asks which save is due and
    saves after its commit, up to 7 T as its client waits (the previous save's drain, 2 T,
    among it), while its peer waited for the next quorum only the collective timeout (60 s,
    no retries): with two trainers the lighthouse forms no quorum without the saving one, so a
    background write over ~60 s restarted the peer. Read from the real values: the Manager's
    quorum_timeout as the trainer builds it, against the timeouts its client passes."""
    import ray
    import torchft
    import torchft.checkpointing.pg_transport as pg_transport

    import actors.gloo
    import actors.trainer.loop as loop
    from core.config import config_from_dict

    built = {}
    monkeypatch.setattr(torchft, "Manager", lambda **kwargs: built.update(kwargs))
    monkeypatch.setattr(pg_transport, "PGTransport", lambda *args, **kwargs: None)
    monkeypatch.setattr(actors.gloo, "ReconfigurableGloo", lambda *args: None)
    monkeypatch.setattr(loop, "use_node_interface", lambda: None)
    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: "127.0.0.1")
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "http://127.0.0.1:29510")
    cfg = config_from_dict({"data": {"train": ["t.tsv"], "eval": ["e.tsv"]}})
    loop._make_manager(0, cfg, None, None, {"lighthouse_host": "127.0.0.1"})
    quorum_s = built["quorum_timeout"].total_seconds()
    seen = caller_timeouts(Deadlines.of(cfg))
    assert quorum_s > seen["checkpoint_due"] + seen["save_checkpoint"], (quorum_s, seen["save_checkpoint"])
    assert quorum_s > cfg.training.collective_timeout_s  # and a peer merely slow to join, as before
