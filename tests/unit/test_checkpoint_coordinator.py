"""The checkpoint coordinator without Ray: the save schedule after a rollback, fencing of
the abandoned timeline on real files, and the cost model's clock in quiet stretches."""

from __future__ import annotations

import json

import numpy as np
import pytest
import ray

from core.checkpoint import FULL, INCREMENTAL, CheckpointStore, DataPosition, ShardRows, write_blob, write_shard_file
from actors.supervisor.checkpoints import CheckpointCoordinator
from actors.supervisor.costs import SharedCosts
from actors.supervisor.guard import start_guarded
from actors.supervisor.hooks import HookList, RunHooks
from core.config import config_from_dict
from core.records import SaveRequest, SaveResult
from policies import FailurePolicy, OnlineCostModel

pytestmark = pytest.mark.timeout(60)


def _cfg(tmp_path, **checkpoint):
    return config_from_dict({
        "run_dir": str(tmp_path), "data": {"train": ["x"], "eval": ["y"]},
        "checkpoint": {"keep_last": 100, **checkpoint},
    })


def _commit(store, uri, step, kind=FULL, base=None, save_index=0):
    rows = ShardRows(np.zeros(1, np.int32), np.zeros(1, np.int64), np.zeros((1, 4), np.float32), np.zeros(1, np.float32))
    entries = [write_shard_file(uri, step, 0, rows), write_blob(uri, step, "dense.pt", b"d")]
    store.commit(step, entries, kind=kind, base_step=base, meta={"save_index": save_index})


POSITION = DataPosition(next_step=0, microbatches_per_step=4, microbatch_rows=8, num_microbatches=100, seed=0,
                        samples_trained=0)


def _coordinator(cfg, clock=lambda: 0.0, mtbf_s=100.0, start_s=0.0, hooks: RunHooks = HookList(), crashes=None):
    costs = SharedCosts(OnlineCostModel(mtbf_s=mtbf_s, save_cost_s=1.0, load_cost_s=1.0, reschedule_cost_s=1.0,
                                        start_s=start_s))
    events = []
    crashes = [] if crashes is None else crashes

    def start_thread(name, fn, *args):
        return start_guarded(name, fn, lambda thread, err: crashes.append((thread, err)), *args)

    c = CheckpointCoordinator(cfg, _plan(cfg), costs, lambda kind, **f: events.append({"kind": kind, **f}), lambda: 0.1,
                              hooks, start_thread, clock=clock, policy=FailurePolicy(cfg.budgets.limits()),
                              fail=lambda reason: crashes.append(("fail", reason)))
    return c, events


def test_rollback_fences_newer_checkpoints_and_restarts_the_schedule(tmp_path):
    # Defect 5: after a rollback to step 20, the checkpoints of steps 30 and 40 (abandoned
    # timeline) must never be loaded and the schedule restarts from 20.
    cfg = _cfg(tmp_path, every_steps=10, policy="mfu", r=0.5, full_every=2)
    uri = cfg.checkpoint_uri
    store = CheckpointStore(uri)
    _commit(store, uri, 10, save_index=0)
    _commit(store, uri, 15, INCREMENTAL, 10, save_index=1)
    _commit(store, uri, 20, save_index=2)
    _commit(store, uri, 25, INCREMENTAL, 20, save_index=3)
    _commit(store, uri, 30, save_index=4)
    (tmp_path / "checkpoints" / "ckpt-000000000035").mkdir()  # a crashed save of that timeline
    c, _ = _coordinator(cfg)
    c.start(0)
    c.last_checkpoint_step, c.next_checkpoint_step, c.save_index, c.last_full_step = 30, 35, 5, 30

    fenced = c.restart_timeline(20, [20])
    assert fenced == [25, 30, 35]
    assert store.list_committed() == [10, 15, 20]
    assert store.chain_steps() == [20]  # the incremental 25 of the abandoned timeline is gone
    assert (c.last_checkpoint_step, c.next_checkpoint_step) == (20, 25)
    assert (c.save_index, c.last_full_step) == (3, 20)  # next save builds on the restored full
    assert c.restart_timeline(20, [20]) == []  # idempotent


def test_a_quiet_stretch_lengthens_the_auto_interval(tmp_path):
    # Defect 7: one early failure must not pin the interval short for the rest of the run.
    cfg = _cfg(tmp_path, auto_interval=True, mtbf_s=100.0)
    now = [0.0]
    c, events = _coordinator(cfg, clock=lambda: now[0])
    c.costs.observe_failure(10.0)
    now[0] = 10.0
    short = c.after(0) - 0
    now[0] = 10_000.0  # hours without a failure
    long = c.after(0) - 0
    assert long > 2 * short
    assert events[-1]["kind"] == "interval_changed" and events[-1]["mtbf_s"] > 1000


def test_saves_that_are_not_due_are_refused(tmp_path):
    cfg = _cfg(tmp_path, every_steps=10)
    c, _ = _coordinator(cfg)
    c.start(0)
    out = c.save(SaveRequest(5, b""), [], "r", POSITION)
    assert out == SaveResult(False, 10, 0.0)
    assert json.dumps(c.doc())


def test_a_save_snapshotted_when_the_supervisor_died_is_due_again_at_once(tmp_path):
    cfg = _cfg(tmp_path, every_steps=20)
    seen = {}

    class KillAtSnapshot(RunHooks):
        def at_point(self, point):
            if point == "save.snapshotted":
                seen["doc"] = c.doc()  # what the journal holds when a kill fires here
                raise ray.exceptions.RayError("killed")  # the background thread goes no further

    c, events = _coordinator(cfg, hooks=KillAtSnapshot())
    c.start(0)
    out = c.save(SaveRequest(20, b"dense"), [], "r", POSITION)
    assert out.saved and out.next_step == 40
    c.drain()
    assert seen["doc"]["in_flight_step"] == 20
    restarted, _ = _coordinator(cfg)
    restarted.load(seen["doc"])
    # The restarted supervisor never commits step 20: the next save is due right away.
    assert restarted.next_checkpoint_step == 21 and restarted.in_flight_step is None
    assert CheckpointStore(cfg.checkpoint_uri).list_committed() == []


def _plan(cfg):
    """The plan of a run of ``cfg`` on two shards (the manifests record it)."""
    from core.plan import make_plan

    return make_plan(cfg.embeddings.sharding, cfg.model.rows_per_table, 2)
