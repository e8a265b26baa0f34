"""``cpr soak``: train under random SIGKILLs of every kind, then check the run with ``cpr
verify`` (``verify.verify_run``): from the fault injector's own log, the audit logs written by
the shards and trainers, the data cache and the checkpoint files, never from the supervisor's
own bookkeeping; then ``cpr verify --replay`` (``verify.replay``): the model recomputed in one
process and compared with every checkpoint the run left. A finding of either keeps the run whole.
"""

from __future__ import annotations

import logging
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import ray

from app.job import TrainingJob
from app.rebuild import ReportError, load_run
from app.rayenv import connect_ray
from app.soak_check import keep_or_clean, must_keep, promoted_then_killed, scheduled_outcomes
from app.soak_plan import scheduled_faults, soak_config, soak_faults
from core.config import load_config
from verify import verify_run

__all__ = ["run_soak", "soak_config", "soak_faults", "written_report", "soak_result", "Replayed", "replay_soak_run",
           "replay_violations", "replay_entry"]

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
    replayed = replay_soak_run(run_dir)  # before soak_result: a sound run then loses its checkpoints
    return soak_result(seed, run_dir, verdict, report or {}, violations, wedged, scheduled_faults(cfg.faults),
                       kept_root or str(Path(run_dir).parent / "kept"), keep_all, checkpoints, replay=replayed)


@dataclass
class Replayed:
    """A soak run's replay (``verify.replay``): its ``ReplayResult`` and the loads of the run's
    history (a shard's rows or the dense model set to a checkpoint's), or the exception that
    stopped it; ``wall_s`` counts reading the run's files too, not only the recomputation."""

    result: object | None = None  # verify.replay.engine.ReplayResult
    shard_loads: int | None = None
    dense_loads: int | None = None
    error: str | None = None
    wall_s: float = 0.0
    loads_by_why: dict[str, int] = field(default_factory=dict)  # "shard recovery", "dense resume", ...


def replay_soak_run(run_dir: str | Path) -> Replayed:
    """``cpr verify --replay`` on the run: never raises (an exception is the soak's violation)."""
    t0 = time.perf_counter()
    try:
        from verify.replay.engine import replay_dir  # import cost: torch and fbgemm, 3-5 s; only the replay needs them

        result = replay_dir(run_dir)
    except Exception as err:  # noqa: BLE001 - reported as a violation, the soak goes on with the next seed
        logger.exception("the replay of %s raised", run_dir)
        return Replayed(error=repr(err), wall_s=time.perf_counter() - t0)

    def count(kind: str) -> int:
        return sum(n for why, n in result.loads.items() if why.startswith(kind))

    return Replayed(result, count("shard "), count("dense "), wall_s=time.perf_counter() - t0, loads_by_why=result.loads)


def replay_violations(replayed: Replayed | None) -> list[str]:
    """The replay's findings and what it could not replay, as the soak's violations."""
    if replayed is None:
        return []
    if replayed.error is not None:
        return [f"replay raised {replayed.error}"]
    return [f"replay: {f}" for f in replayed.result.findings] + [f"not replayed: {g}" for g in replayed.result.gaps]


def replay_entry(replayed: Replayed, report: dict, steps: int | None, finished: bool) -> tuple[dict, bool | None]:
    """The result line's ``replay`` (what was replayed, how long it took beside the training)
    and ``failure_free_equal``: with no partial recovery in the run's history (every shard
    recovery a promotion; every load a rollback of every shard and the dense model, or none) the
    replay computes the failure-free run's model: up to the first rollback it is that run, and a
    rollback loads a checkpoint the replay matched bit for bit with its own state at that step.
    So a sound, exact replay that matched the final checkpoint says the run's final model is the
    failure-free run's bit for bit. None where a shard was recovered alone from a checkpoint
    (its lost updates make another model, by design) or the replay raised."""
    train_s = (report.get("wall_time_s") or {}).get("training_s")
    entry: dict = {"train_seconds": None if train_s is None else round(float(train_s), 1),
                   "wall_s": round(replayed.wall_s, 1)}
    r = replayed.result
    if r is None:
        return {**entry, "error": replayed.error}, None
    entry |= {"steps": r.steps, "checkpoints": len(r.checkpoints), "exact": r.exact, "seconds": round(r.seconds, 1),
              "findings": len(r.findings), "gaps": len(r.gaps), "shard_loads": replayed.shard_loads,
              "dense_loads": replayed.dense_loads, "loads_by_why": replayed.loads_by_why}
    if any(why.startswith("shard ") and why != "shard rollback" for why in replayed.loads_by_why):
        return entry, None
    return entry, bool(finished and r.sound and r.exact and steps is not None and steps in r.checkpoints)


def soak_result(seed: int, run_dir: str, verdict, report: dict, violations: list[str], wedged: bool,
                scheduled: list[dict], kept_root: str, keep_all: bool, checkpoints: str | None,
                extra: tuple = (), replay: Replayed | None = None) -> dict:
    """A soak run's line of the results: the faults it met (the injector's log, as ``cpr verify``
    counted them), each scheduled fault and what happened, the violations (the replay's
    findings and gaps among them), the replay beside the training time, and where the run is
    kept when it is (``app.soak_check.must_keep``). ``replay`` None: the run was not replayed
    (no ``replay`` entry)."""
    violations = violations + verdict.violations + replay_violations(replay)
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
    if replay is not None:
        out["replay"], out["failure_free_equal"] = replay_entry(replay, report, out["steps"] or report.get("steps"),
                                                                finished)
    scenario = promoted_then_killed(outcomes)
    if scenario is not None:
        out["promoted_shard_killed_before_new_mirror"] = scenario
    return out
