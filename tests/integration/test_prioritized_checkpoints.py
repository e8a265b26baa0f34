"""CPR's mechanisms end to end: MFU prioritized (incremental) checkpoints at an interval
chosen by the cost model, a shard killed and restored from a full checkpoint plus its
incrementals, lost samples counted per row."""

from __future__ import annotations

import numpy as np
import pytest

from actors.checkpoint import CheckpointStore
from app.config import config_from_dict

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
    after_recovery = _looked_up(job, cfg, plan, range(states[1]["first_step_after_load"], 234))
    for i, s in enumerate(plan.shards[1]):
        mask = restored.tables == s.table
        local = restored.rows[mask] - s.row_start
        keep = ~np.isin(local, _local(after_recovery[s.table], s))
        w, m = rows[1][i]
        assert np.array_equal(w[local[keep]], restored.weights[mask][keep])
        assert np.array_equal(m[local[keep]], restored.momentum[mask][keep])
