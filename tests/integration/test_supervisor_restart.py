"""Kill the supervisor mid-run with `cpr chaos`: Ray restarts it, it rebuilds its state from
its state file, the live shards and the checkpoint store, training finishes, and no
checkpoint is lost."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from ray._common.test_utils import wait_for_condition

from actors.checkpoint import CheckpointStore
from app.config import config_from_dict
from app.job import TrainingJob

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]


def test_supervisor_killed_mid_run(ray_local, small_data, tmp_path):
    cfg = config_from_dict(
        {
            "run_dir": str(tmp_path / "run"),
            "seed": 5,
            "data": {"train": [small_data.train_path], "eval": [small_data.eval_path], "cache_dir": str(tmp_path / "cache")},
            "model": {"embedding_dim": 8, "table_rows": 20_000, "dense_arch": [32, 8], "over_arch": [32, 1]},
            "training": {"num_trainers": 2, "microbatch_rows": 128, "microbatches_per_step": 4, "epochs": 1},
            "checkpoint": {"every_steps": 25, "keep_last": 100},
        }
    )
    job = TrainingJob(cfg, show_progress=False)
    try:
        job.start()
        pid_before = ray_local.get(job.supervisor.targets.remote(), timeout=30)["supervisor"]["pid"]
        training = job.fit_in_background()
        store = CheckpointStore(cfg.checkpoint_uri)
        wait_for_condition(lambda: len(store.list_committed()) >= 2, timeout=300, retry_interval_ms=100)
        committed_before = store.list_committed()
        env = dict(os.environ, RAY_ADDRESS=ray_local.get_runtime_context().gcs_address)
        chaos = subprocess.run(
            [sys.executable, "-m", "app", "chaos", "--run", cfg.run_dir, "kill", "supervisor"],
            env=env, capture_output=True, text=True, timeout=120,
        )
        assert chaos.returncode == 0, chaos.stderr[-2000:]
        assert "killed supervisor" in chaos.stdout
        training.join(timeout_s=500)
        report = job.finish()
        pid_after = ray_local.get(job.supervisor.targets.remote(), timeout=30)["supervisor"]["pid"]
    finally:
        job.close()

    assert pid_after != pid_before
    assert report["steps"] == 234 and report["auc"] > 0.72
    restarted = [e for e in report["events"] if e["kind"] == "supervisor_restarted"]
    assert len(restarted) == 1 and restarted[0]["shards_found"] == 2
    # No checkpoint lost: every one committed before the kill still verifies, and saving
    # went on after the restart, every 25 steps.
    final = CheckpointStore(cfg.checkpoint_uri)
    for step in committed_before:
        final.verify(step)
    assert final.list_committed() == list(range(25, 234, 25))
    assert report["failures"] == []
