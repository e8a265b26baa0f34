"""The run report: ``report.json`` for machines, ``summary.txt`` for people (``app.summary``)
and the plots (``app.plots``), written into the run directory at the end of every run.
``cpr report`` renders them again from the run directory (``app.rebuild``).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from app.rebuild import REPORT_FILE, ReportError, load_run, rebuild_report
from app.summary import format_summary
from app.tallies import hosts_lost, mirrors_section, overhead_seconds, save_failures, save_split
from core.config import RunConfig
from core.data.sources import shown
from policies import expected_pls

__all__ = ["build_report", "write_report", "format_summary", "render", "load_run", "rebuild_report", "ReportError"]

logger = logging.getLogger(__name__)

SUMMARY_FILE = "summary.txt"


def data_section(data: dict) -> dict:
    """Which mapping the run used, its tables, and where and how its stores were made."""
    train, evaluation = data["train"], data["eval"]
    return {
        "mapping": train.mapping["kind"],
        "min_count": train.mapping["min_count"] if train.mapping["kind"] == "vocab" else None,
        "table_rows": list(train.mapping["table_rows"]),
        "embedding_rows": sum(train.mapping["table_rows"]),
        "train_rows": train.rows, "eval_rows": evaluation.rows,
        "train_store": shown(train.uri), "eval_store": shown(evaluation.uri),
        "reused": train.reused and evaluation.reused,
        "preprocessing": {"train": train.build, "eval": evaluation.build},
    }


def build_report(cfg: RunConfig, summary: dict, data: dict, wall: dict) -> dict:
    tr = cfg.training
    evaluation = summary.get("eval") or {}
    committed = summary.get("committed") or {}
    # A run that stopped early has no evaluation: count the steps it committed.
    steps = evaluation.get("steps") or committed.get("steps") or summary.get("resumed_from_step") or 0
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
    overhead_s = overhead_seconds(saves, failures, step_time_s, sum(st["tracking_s"] for st in shard_states))
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
        "data": data_section(data),
        # The mode each failure used, as decided when it happened (not recomputed at the end).
        "recovery": summary.get("recovery_mode"),
        "mirrors": mirrors_section(cfg, summary),
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
        # Saves that failed (storage, a shard), each retried after a backoff while training went on.
        "failed_saves": summary.get("save_failures") or save_failures(summary.get("events", [])),
        "checkpoint_policy": policy,
        "interval_changes": [e for e in summary.get("events", []) if e["kind"] == "interval_changed"],
        "trainer_failures": summary.get("trainer_failures", []),
        "hosts_lost": hosts_lost(summary.get("events", [])),
        "all_trainers_failed": [e for e in summary.get("events", []) if e["kind"] == "all_trainers_failed"],
        # Microbatches that reached each committed dense step: M for every step, whatever
        # the number of live trainers (ReCoVer's invariant). Each step's commit reports are in
        # the run's trainer_book.jsonl (actors.supervisor.step_records.read_commits).
        "microbatches_per_committed_step": list(committed.get("microbatches_per_step") or []),
        "steps_with_fewer_trainers": committed.get("steps_with_fewer_trainers", 0),
        "overhead_s": {k: round(v, 3) for k, v in overhead_s.items()},
        # MFU/SSU access tracking in the shards' lookup path, per training step (summed over shards).
        "tracking_s_per_step": overhead_s["tracking"] / max(steps - resumed_from, 1),
        "overhead_pct_of_wall": {k: round(100 * v / wall["total_s"], 2) for k, v in overhead_s.items()},
        "save_split_s": save_split(saves),
        "wall_time_s": {k: round(v, 3) for k, v in wall.items()},
        "shards": summary.get("shards"),
        "events": summary.get("events", []),
        "progress": summary.get("progress", []),
        "config": cfg.model_dump(),
    }


def write_report(run_dir: Path, report: dict) -> None:
    """Writes report.json, summary.txt and the plots (``events.jsonl`` is the supervisor's:
    its journal says how far the file reached, and a resumed run appends to it). A plot that
    cannot be drawn is logged, never fails the run: the report files are written first."""
    run_dir = Path(run_dir)
    (run_dir / REPORT_FILE).write_text(json.dumps(report, indent=2, default=str))
    render(run_dir, report)


def render(run_dir: Path, report: dict) -> list[Path]:
    """Writes summary.txt and the plots of ``report`` into ``run_dir``; returns the files
    written (a plot that failed is logged as a warning and left out)."""
    run_dir = Path(run_dir)
    (run_dir / SUMMARY_FILE).write_text(format_summary(report) + "\n")
    written = [run_dir / SUMMARY_FILE]
    try:
        # Plots last, and matplotlib with them: a broken one costs the plots, not the run, and its
        # import cost (0.26 s, measured) stays off cpr train's start, where app.job imports this module.
        from app.plots import write_plots

        written += write_plots(run_dir, report)
    except Exception as err:  # a picture is never worth a run: the numbers are on disk already
        logger.warning("could not draw the plots of %s: %r", run_dir, err)
    return written
