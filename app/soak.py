"""``cpr soak``: train under random SIGKILLs of every kind, then check the run's invariants
from its files (report, audit logs written by the shards and trainers themselves, the
checkpoint store), independently of the supervisor's own bookkeeping.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from collections import defaultdict
from pathlib import Path

import ray

from app.job import TrainingJob
from app.rayenv import connect_ray
from core.accounting import LostSpan, chain_rows, count_lost_samples
from core.cache import MicrobatchFile
from core.checkpoint import CheckpointStore
from core.config import RunConfig, config_from_dict, load_config
from core.plan import make_plan
from core.schedule import StepSchedule

__all__ = ["check_run", "leftovers", "soak_config"]

logger = logging.getLogger(__name__)


def soak_config(base: RunConfig, run_dir: str, seed: int, kills: int, mtbf_s: float) -> RunConfig:
    """``base`` with random kills of shards, trainers, every trainer and the supervisor,
    kills aimed at a save and at a recovery, and the audit log on."""
    raw = base.model_dump()
    raw.update(run_dir=run_dir, audit_log=True)
    raw["data"]["cache_dir"] = base.cache_dir
    raw["checkpoint"]["keep_last"] = 1000  # the PLS recount reads every incremental back
    raw["faults"] = {
        "targets": ["shards", "trainers", "supervisor", "all_trainers"], "distribution": "exponential",
        "mtbf_s": mtbf_s, "seed": seed, "max_failures": kills,
        "at_points": [{"at": "save.files_written", "kill": "shard:0"}, {"at": "recovery.spawned", "kill": "supervisor"}],
    }
    return config_from_dict(raw)


def _lines(path: Path) -> list[dict]:
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass  # a line torn by the SIGKILL of its writer
    return out


def check_run(cfg: RunConfig, report: dict, injected: list[dict], train_cache: str) -> list[str]:
    """Every invariant the run violated, as sentences; [] when it is sound."""
    v: list[str] = []
    run_dir = Path(cfg.run_dir)
    m = cfg.training.microbatches_per_step
    total = report.get("total_steps") or report["steps"]
    if (report.get("state") or {}).get("state") != "finished" or report.get("auc") is None:
        v.append(f"the run did not finish: state {report.get('state')}")
    if report["steps"] != total:
        v.append(f"the run stopped at step {report['steps']} of {total}")
    audit = run_dir / "audit"
    v += _check_shards(audit, cfg.embeddings.num_shards, m, total)
    v += _check_dense(audit, m, total)
    store = CheckpointStore(cfg.checkpoint_uri)
    for step in store.list_committed():
        try:
            store.verify(step)
        except Exception as err:
            v.append(f"checkpoint {step} does not verify: {err}")
    recorded = {(k["target"], round(k["time"], 3)) for k in report.get("faults_injected", [])}
    for kill in injected:
        if (kill["target"], round(kill["time"], 3)) not in recorded:
            v.append(f"the kill of {kill['target']} at {kill['time']:.3f} is not in the report")
    recount = _recount_lost(cfg, report, audit, train_cache)
    if abs(recount - report["lost_samples"]) > 1e-6 * max(1.0, recount):
        v.append(f"lost samples {report['lost_samples']:.3f} in the report, {recount:.3f} recounted from the audit")
    return v


def _shard_events(audit: Path, k: int) -> list[dict]:
    events = [e for p in sorted(audit.glob(f"shard-{k}-g*.jsonl")) for e in _lines(p)]
    return sorted(events, key=lambda e: e["t"])


def _check_shards(audit: Path, num_shards: int, m: int, total: int) -> list[str]:
    """Per shard: every step applied with its M microbatch ids; never twice unless a load
    reverted it in between (a redone or rolled-back step counts exactly once more); every
    step of the run applied at least once."""
    v = []
    for k in range(num_shards):
        in_state: set[int] = set()
        seen: set[int] = set()
        for e in _shard_events(audit, k):
            if e["event"] == "load":
                restored = e["chain"][-1] if e["chain"] else 0
                in_state = {s for s in in_state if s < restored}
            elif e["event"] == "apply":
                s = e["step"]
                if sorted(e["microbatches"]) != list(range(s * m, s * m + m)):
                    v.append(f"shard {k} applied step {s} with microbatches {e['microbatches']}")
                if s in in_state:
                    v.append(f"shard {k} applied step {s} twice without a rollback in between (gen {e['gen']})")
                in_state.add(s)
                seen.add(s)
        missing = sorted(set(range(total)) - seen)
        if missing:
            v.append(f"shard {k} never applied steps {missing[:10]}{'...' if len(missing) > 10 else ''}")
    return v


def _check_dense(audit: Path, m: int, total: int) -> list[str]:
    """Every commit of a step summed M microbatches; the trainers of one commit (one quorum)
    held disjoint shares of the step's ids; every step committed."""
    v = []
    groups: dict[tuple[int, int], list[dict]] = defaultdict(list)
    for p in sorted(audit.glob("trainer-*.jsonl")):
        for e in _lines(p):
            if e["event"] == "commit":
                groups[(e["step"], e["quorum"])].append(e)
    for (step, quorum), commits in groups.items():
        if any(c["total"] != m for c in commits):
            v.append(f"step {step} (quorum {quorum}) committed {[c['total'] for c in commits]} microbatches, not {m}")
        ids = [i for c in commits for i in c["microbatches"]]
        if len(ids) != len(set(ids)) or not set(ids) <= set(range(step * m, step * m + m)):
            v.append(f"step {step} (quorum {quorum}): trainers' shares {sorted(ids)} overlap or stray")
    missing = sorted(set(range(total)) - {s for s, _ in groups})
    if missing:
        v.append(f"dense steps never committed: {missing[:10]}")
    return v


def _recount_lost(cfg: RunConfig, report: dict, audit: Path, cache: str) -> float:
    """PLS numerator again, from the audit: a partially recovered actor's updates from its
    first applied step up to the first step its successors applied, minus what its chain saved."""
    partial = [f for f in report["failures"] if f["recovery"] == "partial"]
    if not partial:
        return 0.0
    plan = make_plan(cfg.embeddings.sharding, cfg.model.rows_per_table, cfg.embeddings.num_shards)
    tr = cfg.training
    schedule = StepSchedule.from_config(len(MicrobatchFile(cache)), tr.microbatches_per_step, tr.epochs, tr.max_steps, cfg.seed)
    store = CheckpointStore(cfg.checkpoint_uri)
    lost = 0.0
    for f in partial:
        k, gen = f["shard"], f["generation"]
        events = _shard_events(audit, k)
        mine = [e for e in events if e["gen"] == gen]
        last_load = max((i for i, e in enumerate(mine) if e["event"] == "load"), default=-1)
        first = next((e["step"] for e in mine[last_load + 1:] if e["event"] == "apply"), None)
        later = [e for e in events if e["gen"] > gen]
        redo = next((e["step"] for e in later if e["event"] == "apply"), report["steps"])
        # A rollback after the recovery makes trainers redo everything from its step: only
        # updates before it are lost.
        for e in later:
            if e["event"] == "load" and e.get("why") == "rollback":
                redo = min(redo, e["chain"][-1] if e["chain"] else 0)
        span = LostSpan(k, tuple(f["chain"]), first, redo)
        lost += count_lost_samples(cfg, plan, schedule, cache, span, chain_rows(plan, store, span))
    return lost


def run_soak(config_path: str, run_dir: str, seed: int, kills: int, mtbf_s: float, timeout_s: float = 1200.0) -> dict:
    """One soak run: train ``config_path`` under the soak's faults, then check it. A run that
    does not finish within ``timeout_s`` counts as wedged."""
    shutil.rmtree(run_dir, ignore_errors=True)
    cfg = soak_config(load_config(config_path), run_dir, seed, kills, mtbf_s)
    started_ray = connect_ray(cfg)  # owned here, so the leftover check can still ask Ray
    job = TrainingJob(cfg, show_progress=False)
    report, wedged, error = None, False, None
    try:
        job.start(wait=False)
        training = job.fit_in_background()
        try:
            training.join(timeout_s=timeout_s)
        except TimeoutError:
            wedged = True
        except Exception as err:  # reported as a violation, the soak goes on with the next seed
            error = repr(err)
        try:
            report = job.finish()
        except Exception as err:
            error = error or repr(err)
        pids = job.client.targets() if report else {}
    finally:
        job.close()
    violations = [f"wedged: not finished within {timeout_s:.0f}s"] if wedged else []
    if error:
        violations.append(f"training raised {error}")
    if report is not None:
        violations += check_run(cfg, report, [], job.data["train"].path)
        violations += leftovers(pids, job.run_id, cfg.ray.namespace)
    if started_ray:
        ray.shutdown()
    if cfg.checkpoint.storage is None:
        # The run's own store keeps every incremental for the recount (keep_last, about
        # 10 GB an hour of soak); once checked, they go.
        shutil.rmtree(cfg.checkpoint_uri, ignore_errors=True)
    report = report or {}
    return {
        "seed": seed, "kills": len(report.get("faults_injected", [])),
        "shard_recoveries": len(report.get("failures", [])),
        "trainer_kills": sum(1 for k in report.get("faults_injected", []) if k["target"].startswith("trainer:")),
        "supervisor_restarts": report.get("supervisor_restarts", 0),
        "fallbacks": len(report.get("all_trainers_failed", [])), "finished": report.get("auc") is not None,
        "wedged": wedged, "violations": violations, "pls": report.get("pls", 0.0), "auc": report.get("auc"),
    }


def leftovers(pids: dict, run_id: str, namespace: str, wait_s: float = 30.0) -> list[str]:
    """No process or named actor of the run may outlive it (checked on this node)."""
    deadline = time.monotonic() + wait_s
    while True:
        alive = []
        for target, info in pids.items():
            if target == "supervisor" or info.pid is None:
                continue
            try:
                os.kill(info.pid, 0)
                alive.append(f"{target} (pid {info.pid})")
            except ProcessLookupError:
                pass
        names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                 if a["namespace"] == namespace and run_id in a["name"]]
        if not alive and not names or time.monotonic() > deadline:
            break
        time.sleep(1.0)
    return [f"left behind after the run: {x}" for x in alive + names]
