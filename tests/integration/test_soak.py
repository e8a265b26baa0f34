"""A short soak in the suite: eleven SIGKILLs of every kind in one run (two shards, both
trainers one at a time, every trainer at once, the supervisor twice, a shard in the middle
of a save, the supervisor in the middle of a recovery), tied to training steps and named
points so the run sees all of them on a machine of any speed. The invariants are the
soak's own (``app.soak.check_run``), read from the run's files: it finished, every step had
M microbatches, every microbatch reached each shard and the dense optimizer exactly once
(a rolled-back step exactly once more), every checkpoint verifies, the PLS recounts.
``benchmarks/soak.py`` runs the long, random version."""

from __future__ import annotations

import pytest

from core.config import config_from_dict
from app.job import TrainingJob
from app.soak import check_run, leftovers

pytestmark = [pytest.mark.integration, pytest.mark.timeout(500)]

M, STEPS = 4, 185
# 75 steps between trainer:1's kill and every trainer's: its replacement (7-15 s to start)
# is back by then on a slower machine too, so both kills land on live processes.
KILLS = {
    "shard:0": [15],
    "trainer:1": [30],
    "supervisor": [45, 150],
    "shard:1": [60],
    "all_trainers": [105],
    "trainer:0": [135],
    "shard": [165],
}
POINTS = [{"at": "save.files_written", "kill": "shard:1"}, {"at": "recovery.spawned", "kill": "supervisor"}]


def test_short_soak_eleven_kills_of_every_kind(ray_local, small_data, tmp_path):
    cfg = config_from_dict({
        "run_dir": str(tmp_path / "run"),
        "seed": 5,
        "data": {"train": [small_data.train_path], "eval": [small_data.eval_path],
                 "cache_dir": str(tmp_path.parent / "cache")},
        "model": {"embedding_dim": 8, "table_rows": 20_000, "dense_arch": [32, 8], "over_arch": [32, 1]},
        "embeddings": {"num_shards": 2, "sharding": "row_wise", "call_timeout_s": 30},
        "training": {"num_trainers": 2, "microbatch_rows": 128, "microbatches_per_step": M, "max_steps": STEPS,
                     "progress_every_steps": 5, "collective_timeout_s": 30},
        "checkpoint": {"policy": "mfu", "r": 0.2, "full_every": 3, "every_steps": 10, "keep_last": 1000},
        "recovery": "partial",
        "audit_log": True,
        "faults": {"max_failures": 0, "seed": 3, "at_steps": KILLS, "at_points": POINTS},
    })
    job = TrainingJob(cfg, show_progress=False)
    try:
        job.start(wait=False)
        job.fit_in_background().join(timeout_s=450)
        report = job.finish()
        import ray

        pids = ray.get(job.supervisor.targets.remote(), timeout=60)
    finally:
        job.close()

    kills = report["faults_injected"]
    summary = {k: report.get(k) for k in ("steps", "state", "supervisor_restarts", "all_trainers_failed")}
    kinds = [k["target"].split(":")[0] for k in kills]  # every trainer at once: one kill per trainer
    assert (kinds.count("supervisor"), kinds.count("shard"), kinds.count("trainer")) == (3, 4, 4), (kills, summary)
    assert report["supervisor_restarts"] == 3, summary
    assert len(report["all_trainers_failed"]) == 1, summary
    assert len(report["failures"]) == 4 and {f["shard"] for f in report["failures"]} == {0, 1}, report["failures"]
    violations = check_run(cfg, report, [], job.data["train"].path)
    violations += leftovers(pids, job.run_id, cfg.ray.namespace)
    assert violations == [], (violations, summary)
