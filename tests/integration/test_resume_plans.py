"""A run killed with its driver, resumed on another number of shards: the rows its two
row-wise shards saved go back onto three (each reading the files that hold its rows), the
run finishes, and ``cpr verify --replay`` recomputes the whole model from the data across
both plans, bit for bit. ``cpr export`` reads checkpoints of either plan."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
import yaml
from ray._common.test_utils import wait_for_condition

from core.checkpoint import CheckpointStore
from tests.integration.checks import verified

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

M, B = 4, 128


def _killed_run(ray_local, small_data, tmp_path, embeddings: dict, faults: dict):
    """A run killed with its driver once its checkpoint of step 60 is committed: (its directory,
    the driver's environment, the command, its checkpoint store, the last valid checkpoint)."""
    run_dir = tmp_path / "run"
    config = {
        "run_dir": str(run_dir),
        "seed": 5,
        "data": {"train": [small_data.train_path], "eval": [small_data.eval_path]},
        "model": {"embedding_dim": 8, "table_rows": 20_000, "dense_arch": [32, 8], "over_arch": [32, 1]},
        "embeddings": embeddings,
        "training": {"num_trainers": 2, "microbatch_rows": B, "microbatches_per_step": M, "epochs": 1},
        "checkpoint": {"every_steps": 30, "keep_last": 10},
        "faults": faults,
        "audit_log": True,
    }
    cfg_path = tmp_path / "c.yaml"
    cfg_path.write_text(yaml.safe_dump(config))
    env = dict(os.environ, RAY_ADDRESS=ray_local.get_runtime_context().gcs_address)
    cmd = [sys.executable, "-m", "app", "train", "--no-progress"]
    store = CheckpointStore(str(run_dir / "checkpoints"))
    with open(tmp_path / "first.out", "w") as out:
        first = subprocess.Popen(cmd + ["--config", str(cfg_path)], env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            wait_for_condition(lambda: any(s >= 60 for s in store.list_committed()), timeout=240,
                               retry_interval_ms=200)
        finally:
            first.send_signal(signal.SIGKILL)
            first.wait(timeout=30)
    assert not (run_dir / "report.json").exists()
    return run_dir, env, cmd, store, store.latest_valid()


def test_a_run_resumed_on_three_shards_finishes_and_verifies_across_both_plans(ray_local, small_data, tmp_path):
    run_dir, env, cmd, store, last = _killed_run(ray_local, small_data, tmp_path,
                                                 {"num_shards": 2, "sharding": "row_wise"}, {"max_failures": 0})
    assert store.plan(last).num_shards == 2

    resumed = subprocess.run(cmd + ["--resume", str(run_dir), "--set", "embeddings.num_shards=3"], env=env,
                             capture_output=True, text=True, timeout=400)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    report = json.loads((run_dir / "report.json").read_text())
    assert report["resumed_from_step"] == last.step and report["steps"] == 234
    [changed] = [e for e in report["events"] if e["kind"] == "plan_changed"]
    assert (changed["step"], changed["previous_shards"], changed["shards"]) == (last.step, 2, 3)
    assert changed["generation"] == changed["previous_generation"] + 1 == 1
    # Row-wise 2 -> 3: each table's rows re-split; half of them are read from another shard's file.
    assert changed["rows_moved"] == 26 * 10_000 and changed["bytes_moved"] == changed["rows_moved"] * 9 * 4
    said = [line for line in resumed.stdout.splitlines() if line.startswith("[plan]")]
    assert said == [f"[plan] resume on 3 row_wise shards (plan generation 1) from 2 row_wise at checkpoint step "
                    f"{last.step}: 260,000 rows (9.4 MB with their optimizer state) read from other shards' files"], \
        resumed.stdout[-3000:]
    final = store.info(234)
    assert final.shard_ids == [0, 1, 2] and store.plan(final).generation == 1
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["embeddings"]["num_shards"] == 3
    assert report["auc"] > 0.72

    verdict = verified(run_dir)
    assert verdict.sound, verdict.violations
    replayed = verdict.facts["replay"]
    assert replayed.exact and last.step in replayed.checkpoints and 234 in replayed.checkpoints

    for step in (last.step, 234):  # a checkpoint of either plan exports as one model
        done = subprocess.run([sys.executable, "-m", "app", "export", str(run_dir), "--step", str(step),
                               "--out", str(tmp_path / f"export-{step}")], env=env, capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]


def test_a_run_resumed_on_fewer_shards_counts_an_earlier_failure_over_the_rows_its_shard_held(
        ray_local, small_data, tmp_path):
    """Three table-wise shards, shard 2 killed and partially recovered, the driver killed; the
    run resumed on two: the failure's lost samples are those of the rows shard 2 held then (the
    plan now has no shard 2), and cpr verify walks shard 2 to the resume that retired it."""
    run_dir, env, cmd, store, last = _killed_run(ray_local, small_data, tmp_path,
                                                 {"num_shards": 3, "sharding": "table_wise"},
                                                 {"max_failures": 0, "at_steps": {"shard:2": [35]}})
    resumed = subprocess.run(cmd + ["--resume", str(run_dir), "--set", "embeddings.num_shards=2"], env=env,
                             capture_output=True, text=True, timeout=400)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    report = json.loads((run_dir / "report.json").read_text())
    [failure] = report["failures"]
    assert failure["actor"] == "shard:2" and failure["recovery"] == "partial"
    assert failure["lost_samples"] > 0 and failure["lost_samples_error"] is None
    assert store.info(234).shard_ids == [0, 1]
    verdict = verified(run_dir)
    assert verdict.sound, verdict.violations
    assert verdict.facts["partial_recoveries"] == 1 and verdict.facts["replay"].exact
