"""The trainer's client of the shards without Ray: a call that fails on several shards
drops every one of their shared-memory slabs (a call still running there may write into
its slab later), not only the first one's."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

import actors.trainer.shards as shards_module
from actors.trainer.shards import ShardCallFailed, ShardClient

pytestmark = pytest.mark.timeout(30)


class _Slab:
    def __init__(self):
        self.closed = False

    def close(self):
        self.closed = True


class _ActorError(Exception):
    pass


def test_every_failed_shard_loses_its_slab(monkeypatch):
    fake_ray = SimpleNamespace(
        wait=lambda refs, num_returns, timeout: (refs[:1], refs[1:2]),  # shard 1 does not answer in time
        get=lambda ref: (_ for _ in ()).throw(_ActorError()) if ref == "r2" else ref,
        exceptions=SimpleNamespace(RayActorError=_ActorError, ObjectLostError=_ActorError),
    )
    monkeypatch.setattr(shards_module, "ray", fake_ray)
    client = ShardClient([], plan=None, dim=4, timeout_s=0.01)
    slabs = {k: _Slab() for k in range(3)}
    client._slabs = dict(slabs)
    with pytest.raises(ShardCallFailed) as failed:
        client._gather(["r0", "r1", "r2"])
    assert failed.value.shard == 1
    assert [k for k, s in slabs.items() if s.closed] == [1, 2] and list(client._slabs) == [0]
