"""Trainer deaths on a real local Ray (Ray Train + torchft, traffic on 127.0.0.1): the
survivors go on, every step keeps its M microbatches, a replacement heals from a live peer,
and every microbatch id reaches an optimizer update exactly once."""

from __future__ import annotations

import pytest
from ray._common.test_utils import wait_for_condition

from actors.supervisor.step_records import read_commits
from app.chaos import kill_target
from core.journal import BOOK_FILE, AppendLog, Journal
from core.config import config_from_dict
from app.job import TrainingJob

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

M, B = 4, 128


def _config(tmp_path, data, trainers, checkpoint_every=None, epochs=1.0, max_steps=None):
    return config_from_dict(
        {
            "run_dir": str(tmp_path / "run"),
            "seed": 2,
            "data": {"train": [data.train_path], "eval": [data.eval_path], "cache_dir": str(tmp_path / "cache")},
            "model": {"embedding_dim": 8, "table_rows": 20_000, "dense_arch": [32, 8], "over_arch": [32, 1]},
            "embeddings": {"num_shards": 2},
            "training": {
                "num_trainers": trainers, "microbatch_rows": B, "microbatches_per_step": M, "epochs": epochs,
                "collective_timeout_s": 30, "max_steps": max_steps,
            },
            "checkpoint": {"every_steps": checkpoint_every} if checkpoint_every else {},
        }
    )


def _run_with_kills(ray, cfg, kill_plan):
    """Trains while ``kill_plan(job)`` kills trainers; returns the report and shard logs."""
    job = TrainingJob(cfg, show_progress=False)
    try:
        job.start(wait=False)
        training = job.fit_in_background()
        kill_plan(job)
        training.join(timeout_s=550)
        report = job.finish()
        shards = ray.get(job.supervisor.shard_handles.remote(), timeout=30)
        logs = ray.get([s.applied_log.remote() for s in shards], timeout=30)
        return report, logs
    finally:
        job.close()


def _progress_at_least(ray, job, step):
    def check():
        p = ray.get(job.supervisor.progress.remote(), timeout=10)
        return p is not None and p.step >= step

    return check


def _assert_every_microbatch_once(report, logs, total_steps, run_dir):
    expected = {s: [s * M + m for m in range(M)] for s in range(total_steps)}
    # Each step's commit reports, from the run's trainer book (the report holds their tally).
    commits = read_commits(AppendLog.iter(run_dir / BOOK_FILE), Journal(run_dir).load()["trainers"]["prunes"])
    # Every committed dense step summed exactly M microbatches (counted in its all-reduce).
    assert sorted(commits) == list(range(total_steps))
    assert report["microbatches_per_committed_step"] == [M]
    trainers = report["config"]["training"]["num_trainers"]
    assert report["steps_with_fewer_trainers"] == sum(1 for c in commits.values() if c.participants < trainers)
    for s, c in commits.items():
        # The trainers' own reports: a dying trainer may not report its share, but no id
        # is ever reported twice or for the wrong step.
        assert len(c.microbatches) == len(set(c.microbatches)) and set(c.microbatches) <= set(expected[s])
    # The shards' logs are the ground truth of embedding updates: each id exactly once.
    for log in logs:
        per_step = {}
        for step, mbs in log:
            assert step not in per_step, f"step {step} applied twice on a shard"
            per_step[step] = sorted(mbs)
        assert per_step == expected


def test_killing_a_trainer_then_another_while_the_first_heals(ray_local, small_data, tmp_path):
    # No checkpoints: nothing can be loaded, a replacement can only heal from a live peer.
    # Two epochs: long enough for the second replacement (about 15 s to start) to heal too.
    cfg = _config(tmp_path, small_data, trainers=3, epochs=2)

    def plan(job):
        wait_for_condition(_progress_at_least(ray_local, job, 20), timeout=300, retry_interval_ms=100)
        old = kill_target(job.supervisor, "trainer:1")

        def replacement_started():
            t = ray_local.get(job.supervisor.targets.remote(), timeout=10)["trainer:1"]
            return t.pid != old["pid"]

        wait_for_condition(replacement_started, timeout=300, retry_interval_ms=50)
        kill_target(job.supervisor, "trainer:2")

    report, logs = _run_with_kills(ray_local, cfg, plan)
    # Two epochs overfit this generator's rare ids a little (a failure-free 1-epoch run: 0.75).
    assert report["steps"] == 468 and report["auc"] > 0.68
    _assert_every_microbatch_once(report, logs, 468, tmp_path / "run")
    first, second = report["trainer_failures"]
    assert (first["actor"], second["actor"]) == ("trainer:1", "trainer:2")
    # The survivors went on without the dead trainer until its replacement healed from them:
    # a survivor left waiting inside the broken all-reduce walks away (sum_over_trainers)
    # instead of holding the next quorum until the replacement arrives (1 run in 5 before).
    # Not asserted for the second kill: it lands as the first replacement's quorum forms,
    # sometimes while the new group connects, and that costs every trainer gloo's connect
    # retries (about 5 x connect_timeout_s), longer than the next replacement takes to start.
    assert first["detection_s"] is not None and first["detection_s"] < 30
    assert first["steps_with_fewer_trainers"] >= 1
    assert first["heal_s"] is not None and first["replacement_joined_at_step"] > 20
    assert second["heal_s"] is not None
    # One replacement each: a replacement whose first group failed to connect (the second
    # kill) used to take that for "every trainer died", clash with the survivor and die too.
    starts = [e["rank"] for e in report["events"] if e["kind"] == "trainer_started"]
    assert sorted(starts) == [0, 1, 1, 2, 2], starts
    # No periodic save: the one checkpoint is the final one, after the last step.
    assert report["all_trainers_failed"] == [] and report["checkpoints_saved"] == 1
    assert [(e["step"], e["final"]) for e in report["events"] if e["kind"] == "checkpoint_saved"] == [(468, True)]
    assert report["failures"] == []


def test_all_trainers_dead_falls_back_to_the_checkpoint(ray_local, small_data, tmp_path):
    cfg = _config(tmp_path, small_data, trainers=2, checkpoint_every=25, max_steps=150)

    def plan(job):
        wait_for_condition(_progress_at_least(ray_local, job, 60), timeout=300, retry_interval_ms=100)
        for t in ("trainer:0", "trainer:1"):
            kill_target(job.supervisor, t)

    report, logs = _run_with_kills(ray_local, cfg, plan)
    assert report["steps"] == 150
    [fallback] = report["all_trainers_failed"]
    assert fallback["fallback_step"] % 25 == 0 and fallback["fallback_step"] >= 50
    assert fallback["steps_lost"] >= 1
    _assert_every_microbatch_once(report, logs, 150, tmp_path / "run")
    assert "fell back to checkpoint step" in (tmp_path / "run" / "summary.txt").read_text()


def test_trainers_failing_past_their_budget_still_write_the_report(ray_local, small_data, tmp_path):
    # Before, Ray Train's WorkerGroupError (not a ControllerError) escaped the driver: no
    # finish(), no report.json.
    import json

    from core.errors import RunFailed

    raw = _config(tmp_path, small_data, trainers=2, checkpoint_every=10, max_steps=60).model_dump()
    raw["budgets"] = {"max_trainer_failures": 0}
    raw["faults"] = {"max_failures": 0, "at_steps": {"trainer:1": [15]}}
    job = TrainingJob(config_from_dict(raw), show_progress=False)
    try:
        job.start(wait=False)
        error = None
        try:
            job.fit_in_background().join(timeout_s=300)
        except Exception as err:  # what run_training hands to finish()
            error = err
        assert error is not None, "Ray Train gave up on the trainers"
        with pytest.raises(RunFailed, match=r"budgets\.max_trainer_failures: 1 \(max 0\)"):
            job.finish(training_error=error)
    finally:
        job.close()
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["state"]["state"] == "failed"
    assert "budgets.max_trainer_failures: 1 (max 0)" in report["state"]["reason"]
    assert [k["target"] for k in report["faults_injected"]] == ["trainer:1"]
