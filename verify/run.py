"""``cpr verify RUN_DIR``: a finished run checked from what other processes wrote.

It reads the fault injector's own log, the audit logs of the shards and trainers, the data
cache and the checkpoint files, and checks the supervisor's report against them; it never
takes the report's word for anything.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from verify.files import RunFiles, load_run
from verify.kills import (check_damage_unused, check_hosts, check_kills, counts_by_kind, crashed_attempt_pids,
                          host_faults, host_victims, landed_kills, planted_damage, stalled_pids)
from verify.leftovers import leftovers
from verify.lost import check_replicas, recount_lost
from verify.replay.data import DataCache, train_store
from verify.replay.schedule import Schedule
from verify.retention import check_removed
from verify.store import Store
from verify.timeline import applies_committed, torn_lines, walk_dense, walk_shard

__all__ = ["Verdict", "verify_run"]


@dataclass
class Verdict:
    run_dir: str
    violations: list[str] = field(default_factory=list)
    facts: dict = field(default_factory=dict)

    @property
    def sound(self) -> bool:
        return not self.violations

    def summary(self) -> str:
        f = self.facts
        return (f"{self.run_dir}: sound: {f.get('steps')} steps, {f.get('kills', 0)} kills, "
                f"{f.get('partial_recoveries', 0)} partial recoveries, {f.get('lost_samples', 0.0):.1f} lost samples, "
                f"{f.get('checkpoints_verified', 0)} checkpoints verified")


def _checkpoint_uri(run: RunFiles) -> str:
    storage = run.config["checkpoint"].get("storage")
    return storage if storage else str(run.run_dir.resolve() / "checkpoints")


def verify_run(run_dir: str | Path, wait_s: float = 10.0) -> Verdict:
    run = load_run(run_dir)
    verdict = Verdict(str(run_dir))
    v = verdict.violations
    report = run.report
    if report is None:
        v.append("no report.json: the run ended without its report")
        report = {}
    kills, problems = landed_kills(run)
    kinds, others = counts_by_kind(run, kills)
    verdict.facts = {"kills_by_kind": dict(sorted(kinds.items())), "other_faults": dict(sorted(others.items()))}
    cache_path = train_store(run)
    if cache_path is None:
        v.append("the training data cache of this run is not found (run.json names none, and no cache in "
                 "data.cache_dir lists the run's train files)")
        return verdict
    cache = DataCache(cache_path)
    schedule = Schedule.for_run(run.config, len(cache))
    total = schedule.total_steps
    state = (report.get("state") or {}).get("state")
    if state != "finished" or report.get("auc") is None:
        v.append(f"the run did not finish: the report says state {state!r}, AUC {report.get('auc')}")
    if report.get("steps") != total:
        v.append(f"the report says {report.get('steps')} steps, the run has {total}")
    hosts = host_faults(run)
    v += problems + check_kills(run, kills) + check_hosts(run, hosts)
    # A writer killed (alone or with its host), or stalled and then killed by the product, may
    # leave a torn last line.
    stalled = stalled_pids(run)
    killed = {k.pid for k in kills} | stalled | host_victims(run, hosts) | crashed_attempt_pids(run, report)
    every_file = [f for files in run.shards.values() for f in files] + run.trainers
    v += torn_lines(every_file, killed)
    spans = []
    shards_now = int(run.config["embeddings"]["num_shards"])
    for k in sorted(set(range(shards_now)) | set(run.shards)):  # a resume on fewer shards retired the others
        if k not in run.shards:
            v.append(f"shard {k} has no audit log (is audit_log on?)")
            continue
        retired_at = None if k < shards_now else _resumed_after(run, k)
        if k >= shards_now and retired_at is None:
            v.append(f"shard {k} is not in the run's last plan ({shards_now} shards), and no resume followed its "
                     "last line")
            continue
        found, shard_spans = walk_shard(k, run.shards[k], run.m, total, retired_at)
        v += found
        spans += shard_spans
    if not run.trainers:
        v.append("no trainer audit log (is audit_log on?)")
    v += walk_dense(run.trainers, run.m, total, killed)
    v += applies_committed(run.shards, run.trainers)
    store = Store(_checkpoint_uri(run))
    lost = _check_lost(run, report, spans, store, cache, schedule, v)
    v += check_replicas(run.shards, report)
    v += _contradictions(report)
    committed = store.committed()
    damage = planted_damage(run)
    planted = {(d.step, d.file) for d in damage}
    shards = int(run.config["embeddings"]["num_shards"])
    for step in committed:
        v += [p for p in store.problems(step, shards=shards)
              if not any(p.startswith(f"checkpoint {s}: file {f} ") for s, f in planted)]
    v += check_removed(run, planted)
    v += check_damage_unused(run, damage, store.commit_time, lambda step: store.plan_in(store._path(step)))
    if run.config["checkpoint"].get("final", True) and state == "finished" and total not in committed:
        v.append(f"the final checkpoint (step {total}) is not committed")
    v += leftovers(run, wait_s)
    verdict.facts |= {"steps": total, "kills": len(kills), "partial_recoveries": len(spans), "lost_samples": lost,
                     "checkpoints_verified": len(committed), "damaged_checkpoints": len(damage), "stalls": len(stalled),
                     "host_faults": len(hosts)}
    return verdict


def _resumed_after(run: RunFiles, k: int) -> int | None:
    """The step the trainers resumed from after shard ``k``'s last line (their audit logs' first
    "resume" load after it), or None."""
    last = max((r["t"] for f in run.shards[k] if f.kind != "mirror" for r in f.records), default=None)
    steps = [int(r["step"]) for f in run.trainers for r in f.records
             if r.get("event") == "load" and r.get("why") == "resume" and last is not None and r["t"] > last]
    return min(steps) if steps else None


def _contradictions(report: dict) -> list[str]:
    """Where a recovery found the supervisor's books saying something else than the processes
    confirmed (its ``books_corrected`` events of kind contradiction): the run went on from the
    processes' answers, but books that contradict them are a defect to find."""
    return [f"the supervisor's books contradicted what the processes confirmed ({e.get('subject')}): {e.get('detail')}"
            for e in report.get("events", []) if e.get("kind") == "books_corrected"
            and e.get("finding") == "contradiction"]


def _check_lost(run: RunFiles, report: dict, spans, store: Store, cache: DataCache, schedule, v: list[str]) -> float:
    """The report's lost samples, per failure and in total, against the recount."""
    slices = {}  # (shard, generation) -> the rows it held: a resume on another plan changes them
    for k, files in run.shards.items():
        for f in files:
            opened = [r["slices"] for r in f.records if r.get("event") == "open" and f.kind != "mirror"]
            if opened:
                slices.setdefault((k, f.gen or 0), opened[0])
    mine: dict[tuple[int, int], float] = defaultdict(float)
    for span in spans:
        # A promoted mirror's generation opened no shard log: it held its primary's rows.
        before = [g for k, g in slices if k == span.shard and g <= span.generation]
        held = slices[(span.shard, max(before))] if before else None
        if held is None:
            v.append(f"shard {span.shard} generation {span.generation} wrote no open line naming its rows: its lost "
                     "samples cannot be recounted")
            continue
        try:
            mine[(span.shard, span.generation)] = recount_lost(span, held, store, cache, schedule,
                                                              run.config["model"])
        except (OSError, ValueError, KeyError) as err:
            v.append(f"shard {span.shard} generation {span.generation}: its lost samples cannot be recounted "
                     f"({type(err).__name__}: {err})")
    theirs: dict[tuple[int, int], float] = defaultdict(float)
    for f in report.get("failures", []):
        if f.get("recovery") == "partial":
            theirs[(f["shard"], f["generation"])] += float(f.get("lost_samples") or 0.0)
    for key in sorted(set(mine) | set(theirs)):
        a, b = theirs.get(key, 0.0), mine.get(key, 0.0)
        if not math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-6):
            v.append(f"shard {key[0]} generation {key[1]}: the report says {a:.3f} lost samples, recounted {b:.3f}")
    total = sum(mine.values())
    if not math.isclose(float(report.get("lost_samples", 0.0)), total, rel_tol=1e-9, abs_tol=1e-6):
        v.append(f"the report says {report.get('lost_samples')} lost samples in all, recounted {total:.3f}")
    return total
