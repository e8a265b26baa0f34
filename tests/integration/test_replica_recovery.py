"""Replica recovery on a real local Ray (``recovery: replica``): a killed shard's mirror takes
its place with nothing read and nothing lost, and the run ends bit-identical to one without the
failure; with the mirror killed too, the shard comes back from its checkpoint (partial) and the
run says so."""

from __future__ import annotations

import numpy as np
import pytest
from ray._common.test_utils import wait_for_condition

from app.chaos import kill_target
from core.checkpoint import CheckpointStore
from app.job import TrainingJob
from core.config import config_from_dict
from tests.integration.test_shard_recovery import _config

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]


def _replica_config(tmp_path, data, name):
    raw = _config(tmp_path, data, "replica", name).model_dump()
    raw["embeddings"]["spares"] = 0  # a fallback starts a process: the mirrors are the only standbys
    return config_from_dict(raw)


def _run(ray, cfg, kills: list[str], at_step: int):
    """Trains; once both mirrors are in sync and ``at_step`` steps committed, kills ``kills``
    at once. Returns the report, the shards' rows, the events and the targets before the kill."""
    job = TrainingJob(cfg, show_progress=False)
    try:
        job.start(wait=False)
        training = job.fit_in_background()
        job.await_start()

        store = CheckpointStore(cfg.checkpoint_uri)

        def ready() -> bool:
            targets = ray.get(job.supervisor.targets.remote(), timeout=30)
            progress = ray.get(job.supervisor.progress.remote(), timeout=30)
            return ({"mirror:0", "mirror:1"} <= set(targets) and progress is not None and progress.step >= at_step
                    and bool(store.list_committed()))  # a fallback has a checkpoint to go to

        wait_for_condition(ready, timeout=300, retry_interval_ms=50)
        before = ray.get(job.supervisor.targets.remote(), timeout=30)
        for target in kills:
            kill_target(job.supervisor, target)
        training.join(timeout_s=500)
        report = job.finish()
        shards = ray.get(job.supervisor.shard_handles.remote(), timeout=30)
        rows = ray.get([s.get_rows.remote() for s in shards], timeout=120)
        events = ray.get(job.supervisor.events_since.remote(0), timeout=30)
        after = ray.get(job.supervisor.targets.remote(), timeout=30)
        return report, rows, events, (before, after)
    finally:
        job.close()


def _same_rows(a, b) -> bool:
    return all(np.array_equal(wa, wb) and np.array_equal(ma, mb)
               for sa, sb in zip(a, b) for (wa, ma), (wb, mb) in zip(sa, sb))


def test_a_killed_shard_is_served_by_its_mirror_and_the_run_equals_one_without_failures(
        ray_local, small_data, tmp_path, clean_run):
    clean_cfg, (clean, clean_rows, *_) = clean_run
    cfg = _replica_config(tmp_path, small_data, "replica")
    report, rows, events, (before, after) = _run(ray_local, cfg, ["shard:0"], at_step=60)
    [failure] = report["failures"]
    assert failure["recovery"] == "replica" and failure["lost_samples"] == 0
    assert failure["bytes_reloaded"] == 0 and failure["chain"] == []
    assert failure["spare"].rsplit("-", 1)[-1].startswith("mirror")
    assert after["shard:0"].pid == before["mirror:0"].pid, "the mirror's process serves the shard"
    assert failure["failed_at_step"] is not None and failure["lost_steps_recomputed"] == 0
    kinds = [e["kind"] for e in events]
    # Two mirrors at the start, and a new one for the shard whose mirror took its place.
    assert kinds.count("mirror_ready") >= 3
    assert report["steps"] == clean["steps"]
    assert _same_rows(clean_rows, rows), "rows and Adagrad state differ from the run without failures"
    assert report["auc"] == clean["auc"]


def test_a_shard_and_its_mirror_killed_together_fall_back_to_the_checkpoint(ray_local, small_data, tmp_path):
    cfg = _replica_config(tmp_path, small_data, "both")
    report, _, events, _ = _run(ray_local, cfg, ["mirror:0", "shard:0"], at_step=60)
    [failure] = report["failures"]
    assert failure["recovery"] == "partial" and failure["bytes_reloaded"] > 0
    assert failure["chain"] and failure["lost_samples"] > 0, "restored from its checkpoint, with its PLS"
    reasons = [e.get("reason", "") for e in events if e["kind"] == "state_changed"]
    assert any("mirror" in r for r in reasons), reasons
