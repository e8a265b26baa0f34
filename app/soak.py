"""``cpr soak``: train under random SIGKILLs of every kind, then check the run with ``cpr
verify`` (``verify.verify_run``): from the fault injector's own log, the audit logs written by
the shards and trainers, the data cache and the checkpoint files, never from the supervisor's
own bookkeeping.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import ray

from app.job import TrainingJob
from app.rebuild import ReportError, load_run
from app.rayenv import connect_ray
from app.soak_check import keep_or_clean, must_keep, promoted_then_killed, scheduled_outcomes
from app.soak_plan import scheduled_faults, soak_config, soak_faults
from core.config import load_config
from verify import verify_run

__all__ = ["run_soak", "soak_config", "soak_faults", "written_report", "soak_result"]

logger = logging.getLogger(__name__)


def written_report(run_dir) -> dict | None:
    """The run's report (``cpr report``'s reading: its report.json, or one rebuilt from its
    files when the driver died first); None when the directory holds nothing to read."""
    try:
        return load_run(run_dir)
    except ReportError:
        return None


def run_soak(config_path: str, run_dir: str, seed: int, kills: int, mtbf_s: float, timeout_s: float = 1200.0,
             overrides: dict | None = None, kept_root: str | None = None, keep_all: bool = False) -> dict:
    """One soak run: train ``config_path`` (with ``overrides``, as ``--set``) under the soak's
    faults, then check it. A run that does not finish within ``timeout_s`` counts as wedged. A
    run with a finding is moved whole to ``kept_root`` (default: ``kept`` beside the run)."""
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
    if started_ray:
        ray.shutdown()
    # The run's own store keeps every incremental for the recount (keep_last, about 10 GB an
    # hour of soak); a sound run loses it once checked. Elsewhere (checkpoint.storage) it stays.
    checkpoints = cfg.checkpoint_uri if cfg.checkpoint.storage is None else None
    return soak_result(seed, run_dir, verdict, report or {}, violations, wedged, scheduled_faults(cfg.faults),
                       kept_root or str(Path(run_dir).parent / "kept"), keep_all, checkpoints)


def soak_result(seed: int, run_dir: str, verdict, report: dict, violations: list[str], wedged: bool,
                scheduled: list[dict], kept_root: str, keep_all: bool, checkpoints: str | None,
                extra: tuple = ()) -> dict:
    """A soak run's line of the results: the faults it met (the injector's log, as ``cpr verify``
    counted them), each scheduled fault and what happened, the violations, and where the run
    is kept when it is (``app.soak_check.must_keep``)."""
    violations = violations + verdict.violations
    kinds, others = verdict.facts.get("kills_by_kind", {}), verdict.facts.get("other_faults", {})
    outcomes = scheduled_outcomes(run_dir, scheduled)  # before the run directory may move
    finished = report.get("auc") is not None
    kept = keep_or_clean(run_dir, kept_root, keep_all or must_keep(violations, finished, wedged), checkpoints, extra)
    for path in map(str, extra if kept else ()):  # a violation naming the driver's log names where it went
        violations = [v.replace(path, str(Path(kept) / Path(path).name)) for v in violations]
    out = {
        "seed": seed, "kills": sum(kinds.values()), "kills_by_kind": kinds,
        "other_faults": others, "faults": sum(kinds.values()) + sum(others.values()),
        "shard_recoveries": len(report.get("failures", [])),
        "supervisor_restarts": report.get("supervisor_restarts", 0),
        "fallbacks": len(report.get("all_trainers_failed", [])), "finished": finished,
        "wedged": wedged, "violations": violations, "pls": report.get("pls", 0.0), "auc": report.get("auc"),
        "steps": verdict.facts.get("steps"), "lost_samples": verdict.facts.get("lost_samples"),
        "checkpoints_verified": verdict.facts.get("checkpoints_verified"),
        "scheduled": outcomes, "kept": kept,
    }
    scenario = promoted_then_killed(outcomes)
    if scenario is not None:
        out["promoted_shard_killed_before_new_mirror"] = scenario
    return out
