"""A Ray that outlives a run keeps worker processes waiting for the next run (``app.warm``):
the next run's trainers and Ray Train's controller take processes started before it began,
in the environment Ray Train gives them, instead of starting their own."""

from __future__ import annotations

import json
import time

import pytest
import ray  # noqa: F401 - before psutil: Ray ships it (ray/thirdparty_files) and puts it on the path
from ray._common.test_utils import wait_for_condition
import psutil  # noqa: E402

from app.job import TrainingJob
from app.warm import run_processes

from .small_runs import small_run_config, train_to_report

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def _config(tmp_path, data, name: str, address: str):
    """A short run that joins the session's Ray as a cluster (ray.address): one that outlives it."""
    cfg = small_run_config(tmp_path / name, data, seed=5, steps=4, microbatches=2, call_timeout_s=30,
                           collective_timeout_s=30, checkpoint={"every_steps": None, "final": False}, faults={})
    return cfg.model_copy(update={"ray": cfg.ray.model_copy(update={"warm_pool_s": 600.0, "address": address})})


def test_the_next_run_takes_worker_processes_started_before_it(ray_local, small_data, tmp_path):
    address = ray_local.get_runtime_context().gcs_address
    first = _config(tmp_path, small_data, "first", address)
    train_to_report(first)  # its end starts the next run's processes
    # As a user's next run comes: once they wait (they start together, in seconds on 2 cores).
    raylet = psutil.Process(ray_local._private.worker.global_worker.node.all_processes["raylet"][0].process.pid)
    wanted = sum(here + with_cpus for here, with_cpus, _ in run_processes(first).values())
    wait_for_condition(lambda: sum(c.cmdline()[:1] == ["ray::IDLE"] for c in raylet.children()) >= wanted,
                       timeout=60, retry_interval_ms=200)

    cfg = _config(tmp_path, small_data, "second", address)
    began = time.time()
    job = TrainingJob(cfg, show_progress=False)
    try:
        job.start(wait=False)
        training = job.fit_in_background()
        events = lambda: [json.loads(x) for x in (job.run_dir / "events.jsonl").read_text().splitlines()]  # noqa: E731
        wait_for_condition(lambda: any(e["kind"] == "training_started" for e in events()), timeout=120,
                           retry_interval_ms=100)
        run = {"RayTrainWorker", "TrainController"}
        born = {(a["ActorClassName"], a["Pid"]): psutil.Process(a["Pid"]).create_time()
                for a in ray_local._private.state.actors().values()
                if a["State"] == "ALIVE" and a["ActorClassName"] in run and a.get("StartTime", 0) / 1000 >= began}
        training.join(timeout_s=240)
        assert job.finish()["steps"] == 4
    finally:
        job.close()
    assert sorted(name for name, _ in born) == ["RayTrainWorker", "RayTrainWorker", "TrainController"], born
    late = {k: round(t - began, 2) for k, t in born.items() if t >= began}
    assert not late, f"started their own process after the run began (s after): {late}"
