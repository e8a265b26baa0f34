"""A shard's side of the step protocol without Ray: a step applies only on a commit naming its
try, a request of an abandoned try changes nothing, and an apply that raises never drops the
step (before, the audit log said "applied" and ``steps_dropped`` counted it)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from actors.shard import EmbeddingShard
from core.errors import StaleRequest
from core.plan import make_plan
from core.records import PushResult
from core.step_protocol import StepId

pytestmark = pytest.mark.timeout(60)

DIM = 4
PLAN = make_plan("table_wise", [50] * 26, 1)


def _shard(tmp_path=None, m=2):
    return EmbeddingShard(0, list(PLAN.shards[0]), DIM, learning_rate=0.1, eps=1e-8, seed=3, microbatches_per_step=m,
                          audit_dir=str(tmp_path) if tmp_path is not None else None)


def _rows(seed):
    sb = PLAN.route(np.random.default_rng(seed).integers(0, 50, size=(8, 26)), 0)
    return sb.lengths, sb.indices


GRAD = np.ones((8, 26 * DIM), dtype=np.float32)


def _complete(shard, step, try_: StepId, commit: StepId | None = None):
    """Both microbatches of ``step`` looked up and pushed in try ``try_``."""
    for mb in (0, 1):
        shard.lookup(step, (2 * step + mb,), *_rows(10 * step + mb), attempt=try_, commit=commit)
    results = [shard.push_grads(step, (2 * step + mb,), GRAD, attempt=try_) for mb in (0, 1)]
    assert results[-1] == PushResult(applied=True)


def test_a_step_applies_only_on_a_commit_that_names_its_try():
    shard = _shard()
    t0 = StepId(1, 0, 0)
    _complete(shard, 0, t0)
    # The first request of step 1 used to apply step 0 whatever it said.
    for commit in (None, StepId(1, 0, 1)):
        with pytest.raises(StaleRequest, match="holds step 0 complete"):
            shard.lookup(1, (2,), *_rows(20), attempt=StepId(1, 1, 0), commit=commit)
        assert shard.applied_step == -1 and shard._complete == 0
    assert shard.commits_refused == 2
    shard.lookup(1, (2,), *_rows(20), attempt=StepId(1, 1, 0), commit=t0)
    assert shard.applied_step == 0 and [s for s, _ in shard.applied_microbatches] == [0]


def test_a_commit_of_a_later_step_applies_the_earlier_one_too():
    """A partial recovery between two steps: the next lookups name the newest committed try,
    which a new fleet generation may have reached; steps commit in order."""
    shard = _shard()
    _complete(shard, 0, StepId(1, 0, 0))
    shard.lookup(2, (4,), *_rows(40), attempt=StepId(2, 2, 0), commit=StepId(2, 1, 0))
    assert shard.applied_step == 0


def test_a_newer_try_replaces_the_step_and_an_older_one_is_refused():
    shard = _shard()
    old, new = StepId(1, 0, 0), StepId(1, 0, 1)
    shard.lookup(0, (0,), *_rows(0), attempt=old)
    shard.lookup(0, (1,), *_rows(1), attempt=new)  # the redo: every chunk of the old try goes
    assert shard.push_grads(0, (0,), GRAD, attempt=old) == PushResult(applied=False, stale=True)
    with pytest.raises(StaleRequest, match="older than the try"):
        shard.lookup(0, (0,), *_rows(0), attempt=old)  # a late lookup of the abandoned try
    shard.lookup(0, (0,), *_rows(0), attempt=new)
    assert shard.push_grads(0, (1,), GRAD, attempt=old) == PushResult(applied=False, stale=True)
    assert shard.push_grads(0, (0,), GRAD, attempt=new) == PushResult(applied=False)
    assert shard.push_grads(0, (1,), GRAD, attempt=new) == PushResult(applied=True)
    assert shard._pending.try_of(0) == (1, 1)


def test_an_apply_that_raises_ends_the_shard_and_never_drops_the_step(tmp_path, monkeypatch):
    shard = _shard(tmp_path)
    t0 = StepId(1, 0, 0)
    _complete(shard, 0, t0)

    class Fails:
        def backward(self, grad):
            raise MemoryError("out of memory in the kernel's update")

    class Exited(Exception):
        pass

    monkeypatch.setattr(shard, "_forward", lambda lengths, indices, grad: Fails())

    def exit_process(code):
        raise Exited(code)

    monkeypatch.setattr(shard, "_exit_process", exit_process)
    with pytest.raises(Exited):
        shard.lookup(1, (2,), *_rows(20), attempt=StepId(1, 1, 0), commit=t0)
    # Not applied, not dropped, not logged as applied: the process ends and is recovered.
    assert shard.applied_step == -1 and shard._complete == 0 and shard.steps_dropped == 0
    assert list(shard.applied_microbatches) == []
    events = [json.loads(line)["event"] for line in (tmp_path / "shard-0-g0.jsonl").read_text().splitlines()]
    assert "apply" not in events and events[-1] == "apply_failed"
