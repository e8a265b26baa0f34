"""The run report: ``report.json`` for machines and ``summary.txt`` for people, written
into the run directory at the end of every run.
"""

from __future__ import annotations

import json
from pathlib import Path

from app.config import RunConfig
from policies import expected_pls

__all__ = ["build_report", "write_report", "format_summary"]


def build_report(cfg: RunConfig, summary: dict, data: dict, wall: dict) -> dict:
    tr = cfg.training
    evaluation = summary.get("eval") or {}
    commits = summary.get("commits", {})
    # A run that stopped early has no evaluation: count the steps it committed.
    steps = evaluation.get("steps") or (max(int(s) for s in commits) + 1 if commits else summary.get("resumed_from_step") or 0)
    samples_per_step = tr.microbatches_per_step * tr.microbatch_rows
    resumed_from = summary.get("resumed_from_step") or 0
    samples = steps * samples_per_step
    samples_this_run = (steps - resumed_from) * samples_per_step
    ceiling = data.get("ceiling_auc")
    auc = evaluation.get("auc")
    failures = summary.get("failures", [])
    lost_samples = sum(f["lost_samples"] or 0.0 for f in failures)
    saves = [e for e in summary.get("events", []) if e["kind"] == "checkpoint_saved"]
    step_time_s = wall["training_s"] / max(steps - resumed_from, 1)
    shard_states = [st for st in summary.get("shards") or [] if "tracking_s" in st]
    policy = dict(summary.get("checkpoint_policy") or {})
    est = policy.get("estimates") or {}
    if policy.get("interval_s") and est:
        policy["expected_pls"] = expected_pls(policy["interval_s"], est["mtbf_s"], est["num_shards"])
    overhead_s = {
        "save": sum(e["duration_s"] for e in saves),
        "tracking": sum(st["tracking_s"] for st in shard_states),
        "load": sum(f["load_s"] for f in failures),
        "lost_computation": sum(f["lost_steps_recomputed"] or 0 for f in failures) * step_time_s,
        "rescheduling": sum(f["reschedule_s"] for f in failures),
    }
    counts = sorted({c["total"] for c in commits.values()})
    return {
        "run_id": summary["run_id"],
        "auc": auc,
        "log_loss": evaluation.get("log_loss"),
        "ceiling_auc": ceiling,
        "auc_fraction_of_ceiling": (auc / ceiling) if (auc is not None and ceiling) else None,
        "eval_rows": evaluation.get("eval_rows"),
        "steps": steps,
        "resumed_from_step": summary.get("resumed_from_step"),
        "samples_trained": samples,
        "samples_this_run": samples_this_run,
        "samples_per_s": samples_this_run / wall["training_s"] if wall["training_s"] > 0 else None,
        "bad_lines_skipped": data["train"].bad_lines + data["eval"].bad_lines,
        # The mode each failure used, as decided when it happened (not recomputed at the end).
        "recovery": summary.get("recovery_mode"),
        "state": summary.get("state"),
        "supervisor_restarts": summary.get("supervisor_restarts", 0),
        "faults_injected": summary.get("faults_injected", []),
        "failures": failures,
        "lost_samples": lost_samples,
        # Portion of lost samples: lost samples (weighted by the model fraction they touched)
        # over all samples trained.
        "pls": lost_samples / samples if samples else 0.0,
        "checkpoints_saved": len(saves),
        "incremental_checkpoints": sum(1 for e in saves if e.get("checkpoint_kind") == "incremental"),
        "checkpoint_policy": policy,
        "interval_changes": [e for e in summary.get("events", []) if e["kind"] == "interval_changed"],
        "trainer_failures": summary.get("trainer_failures", []),
        "all_trainers_failed": [e for e in summary.get("events", []) if e["kind"] == "all_trainers_failed"],
        # Microbatches that reached each committed dense step: M for every step, whatever
        # the number of live trainers (ReCoVer's invariant).
        "microbatches_per_committed_step": counts,
        "steps_with_fewer_trainers": sum(
            1 for c in commits.values() if c["participants"] < tr.num_trainers
        ),
        "commits": commits,
        "overhead_s": {k: round(v, 3) for k, v in overhead_s.items()},
        # MFU/SSU access tracking in the shards' lookup path, per training step (summed over shards).
        "tracking_s_per_step": overhead_s["tracking"] / max(steps - resumed_from, 1),
        "overhead_pct_of_wall": {k: round(100 * v / wall["total_s"], 2) for k, v in overhead_s.items()},
        "wall_time_s": {k: round(v, 3) for k, v in wall.items()},
        "shards": summary.get("shards"),
        "events": summary.get("events", []),
        "progress": summary.get("progress", []),
        "config": cfg.model_dump(),
    }


def format_summary(report: dict) -> str:
    w = report["wall_time_s"]
    ceiling = report["ceiling_auc"]
    lines = [
        f"run {report['run_id']}",
        (
            f"  held-out AUC      {report['auc']:.4f}"
            + (f"  ({report['auc_fraction_of_ceiling']:.1%} of the generator's ceiling {ceiling:.4f})" if ceiling else "")
            + f"\n  held-out log loss {report['log_loss']:.4f}  on {report['eval_rows']:,} rows"
            if report["auc"] is not None
            else "  held-out AUC      not evaluated (the run stopped before its end)"
        ),
        f"  samples trained   {report['samples_trained']:,} in {report['steps']} steps"
        + (f"  ({report['samples_per_s']:,.0f} samples/s)" if report["samples_per_s"] else ""),
        f"  bad lines skipped {report['bad_lines_skipped']}",
        f"  failures          {len(report['failures'])} shard ({_modes(report)}), "
        f"{len(report['faults_injected'])} kills injected, {report['supervisor_restarts']} supervisor restarts, "
        f"PLS {report['pls']:.5f} ({report['lost_samples']:,.0f} samples' updates lost), "
        f"{report['checkpoints_saved']} checkpoints ({report['incremental_checkpoints']} incremental, "
        f"policy {report['checkpoint_policy'].get('policy')}, every {report['checkpoint_policy'].get('interval_steps')} steps"
        + (f", expected PLS {report['checkpoint_policy']['expected_pls']:.5f}" if report["checkpoint_policy"].get("expected_pls") is not None else "")
        + ")",
        f"  recovery          requested {report['recovery']['requested']}; used {_modes(report)}",
        "  overhead          "
        + ", ".join(f"{k.replace('_', ' ')} {v:.2f}%" for k, v in report["overhead_pct_of_wall"].items())
        + " of wall time",
        f"  wall time         data {w['data_prep_s']:.1f}s, startup {w['startup_s']:.1f}s, "
        f"training {w['training_s']:.1f}s, evaluation {w['evaluation_s']:.1f}s, total {w['total_s']:.1f}s",
    ]
    if report["trainer_failures"]:
        lines.append(
            f"  trainer failures  {len(report['trainer_failures'])}; {report['steps_with_fewer_trainers']} steps ran "
            f"with fewer trainers; microbatches per committed step {report['microbatches_per_committed_step']}"
        )
    for e in report["all_trainers_failed"]:
        lines.append(
            f"    every trainer died: dense state and shards fell back to checkpoint step {e['fallback_step']} "
            f"({e['steps_lost']} steps redone)"
        )
    for t in report["trainer_failures"]:
        detect = f"{t['detection_s']}s" if t["detection_s"] is not None else "n/a (no survivor)"
        lines.append(
            f"    {t['actor']}: detected {detect}, {t['steps_with_fewer_trainers']} steps with fewer "
            f"trainers, replacement back after {t['rejoined_s']}s (state from a peer in {t['heal_s']}s), "
            f"joined at step {t['replacement_joined_at_step']}"
        )
    for f in report["failures"]:
        detect = f"{f['detection_s']:.2f}s" if f.get("detection_s") is not None else "n/a"
        lines.append(
            f"    {f['actor']}: {f['recovery']} recovery ({f['decision'].get('reason', '')[:60]}), detected {detect}, "
            f"recovered in {f['recovery_s']:.2f}s from step {f['restored_step']} (redone from {f['failed_at_step']}), "
            f"{f['rows_reloaded']:,} rows / {f['bytes_reloaded'] / 1e6:,.1f} MB reloaded, "
            f"{f['lost_samples'] or 0:,.0f} lost samples"
        )
    state = report.get("state") or {}
    if report.get("interrupted"):
        lines.insert(1, "  INTERRUPTED: stopped by a signal; continue with cpr train --resume")
    elif state.get("state") == "failed":
        lines.insert(1, f"  STOPPED: {state.get('reason')}")
    return "\n".join(lines)


def _modes(report: dict) -> str:
    used = report["recovery"].get("used") or []
    return ", ".join(f"{m} recovery" for m in used) if used else "no recovery needed"


def write_report(run_dir: Path, report: dict) -> None:
    run_dir = Path(run_dir)
    (run_dir / "report.json").write_text(json.dumps(report, indent=2, default=str))
    with open(run_dir / "events.jsonl", "w") as f:
        for e in report["events"]:
            f.write(json.dumps(e, default=str) + "\n")
    (run_dir / "summary.txt").write_text(format_summary(report) + "\n")
