"""``cpr soak``: train under random SIGKILLs of every kind, then check the run with ``cpr
verify`` (``verify.verify_run``): from the fault injector's own log, the audit logs written by
the shards and trainers, the data cache and the checkpoint files, never from the supervisor's
own bookkeeping.
"""

from __future__ import annotations

import logging
import shutil

import numpy as np
import ray

from app.job import TrainingJob
from app.rebuild import ReportError, load_run
from app.rayenv import connect_ray
from core.config import RunConfig, config_from_dict, load_config
from verify import verify_run

__all__ = ["run_soak", "soak_config", "soak_faults", "written_report"]

logger = logging.getLogger(__name__)


def soak_config(base: RunConfig, run_dir: str, seed: int, kills: int, mtbf_s: float) -> RunConfig:
    """``base`` with random kills of shards, trainers, every trainer and the supervisor (``kills``
    of them, ``mtbf_s`` apart on average), kills aimed at a save, a recovery and a rollback,
    faults other than kills drawn from ``seed`` (``soak_faults``), and the audit log on."""
    raw = base.model_dump()
    raw.update(run_dir=run_dir, audit_log=True)
    raw["data"]["cache_dir"] = base.cache_dir
    raw["checkpoint"]["keep_last"] = 1000  # the PLS recount reads every incremental back
    if base.recovery == "replica":
        # Young/Daly's interval at the soak's 6 s MTBF is a save every step or two, and the soak
        # keeps them all: 26 GB in 850 steps filled this disk once. With mirrors saves serve only
        # the fallback: MFU saves every 20 steps, a full one every 80 (about 6 GB kept).
        raw["checkpoint"].update(auto_interval=False, every_steps=100)
    # Every kill may be a trainer's (all_trainers counts each): the budget must not end the soak.
    raw["budgets"]["max_trainer_failures"] = max(raw["budgets"]["max_trainer_failures"], 3 * kills)
    mirrors = ["mirrors"] if base.recovery == "replica" else []  # a mirror's death, and its shard's after
    raw["faults"] = {
        "targets": ["shards", "trainers", "supervisor", "all_trainers", *mirrors], "distribution": "exponential",
        "mtbf_s": mtbf_s, "seed": seed, "max_failures": kills,
        "at_points": [{"at": "save.files_written", "kill": "shard:0"}, {"at": "recovery.spawned", "kill": "supervisor"},
                      {"at": "rollback.loaded", "kill": "supervisor", "after_step": 200}],
        "inject": soak_faults(base, seed),
    }
    return config_from_dict(raw)


def soak_faults(base: RunConfig, seed: int) -> list[dict]:
    """Two stalls (a shard and a trainer, SIGSTOP for 5-25 s at a random step of the first
    half), a corrupted file met by the next recovery and a truncated one met by the next
    rollback (each after a random step of the first quarter), from ``seed``."""
    rng = np.random.default_rng([seed, 24])
    last = base.training.max_steps or 1000
    shards, trainers = base.embeddings.num_shards, base.training.num_trainers

    def step(part: int = 2) -> int:
        return int(rng.integers(20, max(21, last // part)))

    return [
        {"kind": "stall", "target": f"shard:{int(rng.integers(shards))}", "after_step": step(),
         "seconds": round(float(rng.uniform(5, 25)), 1)},
        {"kind": "stall", "target": f"trainer:{int(rng.integers(trainers))}", "after_step": step(),
         "seconds": round(float(rng.uniform(5, 25)), 1)},
        {"kind": "corrupt_checkpoint", "target": f"shard:{int(rng.integers(shards))}", "at": "recovery.spawned",
         "after_step": step(4)},
        {"kind": "truncate_checkpoint", "target": f"shard:{int(rng.integers(shards))}", "at": "rollback.spawned",
         "after_step": step(4)},
    ]


def written_report(run_dir) -> dict | None:
    """The run's report (``cpr report``'s reading: its report.json, or one rebuilt from its
    files when the driver died first); None when the directory holds nothing to read."""
    try:
        return load_run(run_dir)
    except ReportError:
        return None


def run_soak(config_path: str, run_dir: str, seed: int, kills: int, mtbf_s: float, timeout_s: float = 1200.0,
             overrides: dict | None = None) -> dict:
    """One soak run: train ``config_path`` (with ``overrides``, as ``--set``) under the soak's
    faults, then check it. A run that does not finish within ``timeout_s`` counts as wedged."""
    shutil.rmtree(run_dir, ignore_errors=True)
    cfg = soak_config(load_config(config_path, overrides or {}), run_dir, seed, kills, mtbf_s)
    started_ray = connect_ray(cfg)  # owned here, so the leftover check can still ask Ray
    job = TrainingJob(cfg, show_progress=False)
    report, wedged, error, failed = None, False, None, None
    try:
        job.start(wait=False)
        training = job.fit_in_background()
        try:
            training.join(timeout_s=timeout_s)
        except TimeoutError:
            wedged = True
        except Exception as err:  # reported as a violation, the soak goes on with the next seed
            error, failed = repr(err), err
        try:
            report = job.finish(training_error=failed)  # the report then says failed, and why
        except Exception as err:  # RunFailed: the report is written all the same
            error = error or repr(err)
            report = written_report(run_dir)
    finally:
        job.close()
    violations = [f"wedged: not finished within {timeout_s:.0f}s"] if wedged else []
    if error:
        violations.append(f"training raised {error}")
    verdict = verify_run(run_dir, wait_s=30.0)  # while connected: named actors are checked too
    violations += verdict.violations
    kinds, others = verdict.facts.get("kills_by_kind", {}), verdict.facts.get("other_faults", {})
    if started_ray:
        ray.shutdown()
    if cfg.checkpoint.storage is None:
        # The run's own store keeps every incremental for the recount (keep_last, about
        # 10 GB an hour of soak); once checked, they go.
        shutil.rmtree(cfg.checkpoint_uri, ignore_errors=True)
    report = report or {}
    return {
        "seed": seed, "kills": sum(kinds.values()), "kills_by_kind": kinds,
        "other_faults": others, "faults": sum(kinds.values()) + sum(others.values()),
        "shard_recoveries": len(report.get("failures", [])),
        "supervisor_restarts": report.get("supervisor_restarts", 0),
        "fallbacks": len(report.get("all_trainers_failed", [])), "finished": report.get("auc") is not None,
        "wedged": wedged, "violations": violations, "pls": report.get("pls", 0.0), "auc": report.get("auc"),
        "steps": verdict.facts.get("steps"), "lost_samples": verdict.facts.get("lost_samples"),
        "checkpoints_verified": verdict.facts.get("checkpoints_verified"),
    }
