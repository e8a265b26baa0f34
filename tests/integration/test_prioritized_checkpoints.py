"""CPR's mechanisms end to end: MFU prioritized (incremental) checkpoints at an interval
chosen by the cost model, a shard killed and restored from a full checkpoint plus its
incrementals, lost samples counted per row."""

from __future__ import annotations

import numpy as np
import pytest

from core.checkpoint import CheckpointStore
from core.config import config_from_dict

from .test_shard_recovery import _local, _looked_up, _run

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

M, B = 4, 128


def test_mfu_checkpoints_auto_interval_and_chain_restore(ray_local, small_data, tmp_path):
    cfg = config_from_dict(
        {
            "run_dir": str(tmp_path / "run"),
            "seed": 4,
            "data": {"train": [small_data.train_path], "eval": [small_data.eval_path], "cache_dir": str(tmp_path / "cache")},
            "model": {"embedding_dim": 8, "table_rows": 20_000, "dense_arch": [32, 8], "over_arch": [32, 1]},
            "training": {"num_trainers": 2, "microbatch_rows": B, "microbatches_per_step": M, "epochs": 1},
            "checkpoint": {
                "policy": "mfu", "r": 0.2, "full_every": 4, "auto_interval": True,
                "mtbf_s": 20, "pls_target": 0.02, "keep_last": 100,
            },
            "recovery": "partial",
        }
    )
    store = CheckpointStore(cfg.checkpoint_uri)
    report, rows, states, before, after, plan, job = _run(ray_local, cfg, kill="shard:1", kill_after_step=40)

    assert report["steps"] == 234 and report["auc"] > 0.70
    # The interval came from the cost model: PLS-target interval, scaled by r for MFU.
    changes = report["interval_changes"]
    assert changes and changes[0]["mode"] == "partial" and "MTBF" in changes[0]["reason"]
    assert report["checkpoint_policy"]["policy"] == "mfu" and report["checkpoint_policy"]["expected_pls"] > 0
    assert report["incremental_checkpoints"] > 0
    assert report["overhead_s"]["tracking"] > 0

    [failure] = report["failures"]
    chain = failure["chain"]
    assert store.info(chain[0]).kind == "full"
    assert all(store.info(s).kind == "incremental" and store.info(s).base_step == chain[0] for s in chain[1:])
    # Per-row accounting: never more than if every row had been saved only at the full.
    coarse = (failure["failed_at_step"] - chain[0]) * M * B * plan.shard_fraction(1)
    assert 0 <= failure["lost_samples"] <= coarse

    # The respawned shard holds the chain's rows except where trained after recovery.
    restored = store.read_chain(1, chain)
    after_recovery = _looked_up(job, cfg, plan, range(states[1].first_step_after_load, 234))
    for i, s in enumerate(plan.shards[1]):
        mask = restored.tables == s.table
        local = restored.rows[mask] - s.row_start
        keep = ~np.isin(local, _local(after_recovery[s.table], s))
        w, m = rows[1][i]
        assert np.array_equal(w[local[keep]], restored.weights[mask][keep])
        assert np.array_equal(m[local[keep]], restored.momentum[mask][keep])


def test_emulation_kills_shards_on_the_emulated_clock_and_charges_production_costs(ray_local, small_data, tmp_path):
    """``cpr emulate``'s run: the interval the policy picks for the production costs, real
    shard kills at the seed's failure times on the emulated clock, each recovered, and the
    emulated costs added up once."""
    from app.emulation import Emulation

    steps = 80
    cfg = config_from_dict(
        {
            "run_dir": str(tmp_path / "run"),
            "seed": 5,
            "data": {"train": [small_data.train_path], "eval": [small_data.eval_path], "cache_dir": str(tmp_path / "cache")},
            "model": {"embedding_dim": 8, "table_rows": 20_000, "dense_arch": [32, 8], "over_arch": [32, 1]},
            "training": {"num_trainers": 2, "microbatch_rows": B, "microbatches_per_step": M, "epochs": 1, "max_steps": steps},
            "checkpoint": {"pls_target": 0.1, "keep_last": 100},
            "recovery": "partial",
            # A job MTBF of 30 h over 100 h of training: three failures, a checkpoint every 12 h.
            "emulation": {"node_mtbf_h": 30, "nodes": 1, "duration_h": 100, "seed": 3, "max_failures": 3,
                          "save_s": 60, "load_s": 120, "reschedule_s": 30},
        }
    )
    expected = Emulation.of(cfg, steps)
    scheduled = expected.failure_times_s()
    assert len(scheduled) == 3 and scheduled[-1] < 0.9 * expected.duration_s  # all three fall inside the run
    report, *_ = _run(ray_local, cfg)

    emu = report["emulation"]
    assert emu["every_steps"] == expected.every_steps == int(2 * 0.1 * 30 * 2 / (100 / steps))
    assert report["checkpoint_policy"]["interval_steps"] == expected.every_steps
    # One real kill per scheduled failure, each when the clock had reached its time, in order.
    kills = emu["kills"]
    assert [k["scheduled_s"] for k in kills] == [round(t, 1) for t in scheduled]
    assert all(k["emulated_s"] >= k["scheduled_s"] for k in kills)
    assert [k["step"] for k in kills] == sorted(k["step"] for k in kills)
    assert all(k["step"] >= t / expected.step_s - 1 for k, t in zip(kills, scheduled))
    assert len(report["failures"]) == 3 and {f["recovery"] for f in report["failures"]} == {"partial"}
    assert report["pls"] > 0 and report["auc"] > 0.6
    # The costs: saves by the rows they wrote, a partial recovery by the dead shard's rows.
    saves = [e for e in report["events"] if e["kind"] == "checkpoint_saved" and not e.get("final")]
    assert emu["saves"] == len(saves) > 0
    assert emu["overhead_s"]["save"] == pytest.approx(60 * len(saves), rel=1e-3)
    assert 0 < emu["overhead_s"]["load"] < 3 * 120 and emu["overhead_s"]["rescheduling"] == 90
    assert emu["overhead_s"]["lost_computation"] == 0
    assert emu["overhead_total_pct"] == pytest.approx(sum(emu["overhead_pct"].values()), abs=0.01)
