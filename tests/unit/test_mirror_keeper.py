"""The supervisor's mirror keeper (``actors.supervisor.mirrors``) without Ray: a shard whose
mirror cannot be placed waits its turn while the others' mirrors are built, only its first try
may use a warm spare, and training that starts with a shard unprotected says so."""

from __future__ import annotations

import threading

import pytest

import actors.supervisor.mirrors as mirrors_module
from actors.supervisor.events import EventLog
from actors.supervisor.hooks import HookList
from actors.supervisor.mirrors import MirrorSet

pytestmark = pytest.mark.timeout(30)


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 20.0  # every read moves time on: a retry is due at the next pass
        return self.now


def _mirrors(n=2):
    lock = threading.RLock()
    events = EventLog(lock, HookList(), lambda: None)
    mirrors = MirrorSet(lock, events, lambda: None, fleet=None, primary=lambda k: (None, None), occupied=list,
                        running=lambda: True, num_shards=n, enabled=True, run_id="r1", timeout_s=1.0,
                        start_timeout_s=1.0, start_thread=lambda *a: None, hooks=HookList())
    return mirrors, events


def test_one_shard_whose_mirror_cannot_be_placed_does_not_stop_the_others(monkeypatch):
    # Before, the keeper retried the first missing shard forever (shard 1 never got a mirror),
    # and every failed try could use up a warm spare.
    monkeypatch.setattr(mirrors_module.time, "monotonic", Clock())
    mirrors, _ = _mirrors()
    mirrors._wake.set()
    calls = []

    def build(k, name, use_spare=True):  # as MirrorSet._build ends: not building any more; ready if it worked
        calls.append((k, use_spare))
        mirrors._building.pop(k, None)
        if k == 1:
            mirrors._ready[1] = name
        if len(calls) >= 4:
            mirrors._stop.set()
        mirrors._wake.set()
        return k == 1

    mirrors._build = build
    mirrors._keep()
    assert calls[:2] == [(0, True), (1, True)], calls  # shard 1 is built while shard 0 waits its turn
    assert all(k == 0 and not spare for k, spare in calls[2:]), calls  # retries spawn, spares stay for recoveries
    assert mirrors.ready() == {1: "cpr-shard-r1-mirror1"}


def test_training_that_starts_with_a_shard_unprotected_says_so_once():
    mirrors, events = _mirrors()
    mirrors._ready, mirrors._tried = {1: "m1"}, {0, 1}
    assert mirrors.wait_first(0.1) and mirrors.wait_first(0.1)
    [missing] = [e for e in events.recent() if e["kind"] == "mirrors_missing"]
    assert missing["shards"] == [0]
