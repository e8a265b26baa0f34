"""Nothing fails silently: an unexpected exception in any background thread of the supervisor
(raised there through a fault point, as a bug would) ends the run as Failed with a reason that
names the thread and the error, the report is written, and ``cpr train`` exits non-zero within
30 s. Before, the shard watcher, the executor's handler and the spare keeper died on their
first exception and the run wedged."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import yaml

from app.job import TrainingJob
from core.config import config_from_dict
from core.errors import RunFailed
from core.points import THREADS

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

# Where each background thread of the supervisor raises: a few steps into training for the
# save pipeline (it runs at the first save) and the spare keeper (once training started,
# through the command line); at their first pass for the others, which run from the shards'
# start. The lost-samples thread's crash is tested without Ray, in tests/unit/test_supervisor_books.py.
MID_TRAINING, THROUGH_CLI = "save-pipeline", "spare-keeper"
FROM_THE_START = ("shard-watch", "host-watch", "recovery-executor")


def test_every_background_thread_is_covered():
    assert {MID_TRAINING, THROUGH_CLI, *FROM_THE_START, "lost-samples"} == set(THREADS)


def _raw(tmp_path, small_data, thread: str) -> dict:
    return {
        "run_dir": str(tmp_path / "run"), "seed": 5,
        "data": {"train": [small_data.train_path], "eval": [small_data.eval_path]},
        "model": {"embedding_dim": 8, "table_rows": 20_000, "dense_arch": [32, 8], "over_arch": [32, 1]},
        "training": {"num_trainers": 1, "microbatch_rows": 128, "microbatches_per_step": 4, "epochs": 1},
        "checkpoint": {"every_steps": 10},
        "embeddings": {"spares": 1 if thread == "spare-keeper" else 0},
        "faults": {"max_failures": 0, "at_points": [{"at": f"thread.{thread}", "error": "planted", "after_step": 12}]},
    }


def _crash_time(report: dict) -> float:
    [failed] = [e for e in report["events"] if e["kind"] == "state_changed" and e["state"] == "failed"]
    return failed["time"]


def test_a_thread_that_raises_mid_training_fails_the_run_naming_it(ray_local, small_data, tmp_path):
    thread = MID_TRAINING
    cfg = config_from_dict(_raw(tmp_path, small_data, thread))
    job = TrainingJob(cfg, show_progress=False)
    try:
        job.start(wait=False)
        training = job.fit_in_background()
        training.join(timeout_s=200)
        ended = time.time()
        with pytest.raises(RunFailed, match=f"thread {thread} crashed: InjectedFault: planted"):
            job.finish()
    finally:
        job.close()
    report = _failed_report(tmp_path, thread)
    assert report["steps"] < 234, "the run stopped instead of finishing"
    assert ended - _crash_time(report) < 30, "the trainers stopped within 30 s of the crash"


@pytest.mark.parametrize("thread", FROM_THE_START)
def test_a_watch_that_raises_fails_the_run_naming_it(ray_local, small_data, tmp_path, thread):
    # These threads run from the shards' start (the executor waits for work on its own
    # thread): the fault fires on their first pass, before any trainer (which would only
    # find the run over), so no trainer is started here.
    raw = _raw(tmp_path, small_data, thread)
    raw["faults"]["at_points"][0]["after_step"] = 0
    job = TrainingJob(config_from_dict(raw), show_progress=False)
    try:
        job.start(wait=True)
        deadline = time.time() + 30
        while not job.client.is_finished() and time.time() < deadline:
            time.sleep(0.2)
        with pytest.raises(RunFailed, match=f"thread {thread} crashed: InjectedFault: planted"):
            job.finish()
    finally:
        job.close()
    _failed_report(tmp_path, thread)


def _failed_report(tmp_path, thread: str) -> dict:
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["state"]["state"] == "failed"
    assert report["state"]["reason"].startswith(f"thread {thread} crashed: InjectedFault: planted"), report["state"]
    return report


def test_cpr_train_exits_non_zero_within_30_s_naming_the_thread(ray_local, small_data, tmp_path):
    # The spare keeper's case, through the command line: it starts once training runs.
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(_raw(tmp_path, small_data, THROUGH_CLI)))
    env = {**os.environ, "RAY_ADDRESS": ray_local.get_runtime_context().gcs_address}
    done = subprocess.run([sys.executable, "-m", "app", "train", "--no-progress", "--config", str(path)], env=env,
                          capture_output=True, text=True, timeout=240)
    exited = time.time()
    assert done.returncode == 2, done.stderr[-3000:]
    assert "thread spare-keeper crashed: InjectedFault: planted" in done.stderr, done.stderr[-3000:]
    report = _failed_report(tmp_path, "spare-keeper")
    assert report["steps"] < 234, "the run stopped instead of finishing"
    assert exited - _crash_time(report) < 30, "cpr train ended within 30 s of the crash"
