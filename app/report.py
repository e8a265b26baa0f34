"""The run report: ``report.json`` for machines, ``summary.txt`` for people and the plots
(``app.plots``), written into the run directory at the end of every run. ``cpr report``
renders them again from the run directory, rebuilding what it can for a run that crashed.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from core import accounting
from core.journal import EVENTS_FILE, PROGRESS_FILE, STATE_FILE
from core.config import RunConfig, load_config
from core.errors import CprError
from policies import expected_pls

__all__ = ["build_report", "write_report", "format_summary", "render", "load_run", "rebuild_report", "ReportError"]

logger = logging.getLogger(__name__)

REPORT_FILE = "report.json"
SUMMARY_FILE = "summary.txt"
CONFIG_FILE = "config.yaml"


class ReportError(CprError):
    """A run directory cannot be read back into a report: it does not exist, holds none of
    the run's files, or a file cannot be read. The message names the path."""


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
    overhead_s = _overhead_s(saves, failures, step_time_s, sum(st["tracking_s"] for st in shard_states))
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
        "hosts_lost": hosts_lost(summary.get("events", [])),
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
        "save_split_s": _save_split(saves),
        "wall_time_s": {k: round(v, 3) for k, v in wall.items()},
        "shards": summary.get("shards"),
        "events": summary.get("events", []),
        "progress": summary.get("progress", []),
        "config": cfg.model_dump(),
    }


def hosts_lost(events: list[dict]) -> list[dict]:
    """Each host (Ray node) of the run that Ray declared dead: its address, the run's actors
    it took, Ray's reason, and ``declared_dead_s``: from the first failed probe of its raylet
    (``actors.nodes.HostWatch``) to Ray's verdict, None when no probe failed before it."""
    out = []
    for e in events:
        if e.get("kind") != "host_lost":
            continue
        since = e.get("unreachable_since")
        out.append({
            "node_ip": e.get("node_ip"), "node_id": e.get("node_id"), "actors": e.get("actors", []),
            "reason": e.get("reason"), "declared_dead_at": e.get("declared_dead_at"), "unreachable_since": since,
            "declared_dead_s": round(e["declared_dead_at"] - since, 3) if since is not None else None,
        })
    return out


def _overhead_s(saves: list[dict], failures: list[dict], step_time_s: float, tracking_s: float | None) -> dict:
    """Seconds of wall time each fault-tolerance cost took (None where it was not measured)."""
    return {
        "save": sum(e.get("duration_s") or 0.0 for e in saves),
        "tracking": tracking_s,
        "load": sum(f.get("load_s") or 0.0 for f in failures),
        "lost_computation": sum(f.get("lost_steps_recomputed") or 0 for f in failures) * step_time_s,
        "rescheduling": sum(f.get("reschedule_s") or 0.0 for f in failures),
    }


def _save_split(saves: list[dict]) -> dict:
    """Seconds the saves held the training path (the snapshot) and ran in the background
    (write, hash, sync, commit): only the first is an overhead of training."""
    return {
        "training_path": round(sum(e.get("hold_s", e.get("duration_s")) or 0.0 for e in saves), 3),
        "background": round(sum(e.get("background_s") or 0.0 for e in saves), 3),
    }


def _fmt(value, spec: str, unit: str = "", missing: str = "n/a") -> str:
    return missing if value is None else format(value, spec) + unit


def _decision(decision: dict) -> tuple[str, str]:
    """A recovery decision's reason as (why, the cost model's numbers): the policy writes
    ``"<why> (<numbers>)"``; the numbers go on a line of their own."""
    reason = decision.get("reason") or decision.get("mode") or ""
    why, sep, numbers = reason.rpartition(" (full: ")
    if not sep or not numbers.endswith(")"):
        return reason, ""
    return why, "full: " + numbers[:-1]


def format_summary(report: dict) -> str:
    """The run in a dozen lines. Works for a full report and for one rebuilt from the files of
    a run that did not finish (unknown numbers read ``n/a``)."""
    w = report.get("wall_time_s") or {}
    ceiling = report.get("ceiling_auc")
    policy = report.get("checkpoint_policy") or {}
    overhead_pct = report.get("overhead_pct_of_wall") or {}
    samples = report.get("samples_trained")
    lines = [
        f"run {report.get('run_id')}",
        (
            f"  held-out AUC      {report['auc']:.4f}"
            + (f"  ({report['auc_fraction_of_ceiling']:.1%} of the generator's ceiling {ceiling:.4f})" if ceiling else "")
            + f"\n  held-out log loss {report['log_loss']:.4f}  on {report['eval_rows']:,} rows"
            if report.get("auc") is not None
            else "  held-out AUC      not evaluated (the run stopped before its end)"
        ),
        f"  samples trained   {_fmt(samples, ',', missing='unknown (no config)')} in {report.get('steps')} steps"
        + (f"  ({report['samples_per_s']:,.0f} samples/s)" if report.get("samples_per_s") else ""),
        f"  bad lines skipped {_fmt(report.get('bad_lines_skipped'), '')}",
        f"  failures          {len(report.get('failures') or [])} shard ({_modes(report)}), "
        f"{len(report.get('faults_injected') or [])} kills injected, {report.get('supervisor_restarts') or 0} supervisor restarts, "
        f"PLS {_fmt(report.get('pls'), '.5f')} ({report.get('lost_samples') or 0:,.0f} samples' updates lost), "
        f"{report.get('checkpoints_saved', 0)} checkpoints ({report.get('incremental_checkpoints', 0)} incremental, "
        f"policy {_fmt(policy.get('policy'), '')}, every {_fmt(policy.get('interval_steps'), '')} steps"
        + (f", expected PLS {policy['expected_pls']:.5f}" if policy.get("expected_pls") is not None else "")
        + ")",
        f"  recovery          requested {(report.get('recovery') or {}).get('requested') or 'n/a'}; used {_modes(report)}",
        "  overhead          "
        + ", ".join(f"{k.replace('_', ' ')} {_fmt(v, '.2f', '%')}" for k, v in overhead_pct.items())
        + " of wall time"
        + (
            f" (saves held training {split['training_path']:.2f}s; wrote for {split['background']:.2f}s in the background)"
            if (split := report.get("save_split_s"))
            else ""
        ),
        f"  wall time         data {_fmt(w.get('data_prep_s'), '.1f', 's')}, startup {_fmt(w.get('startup_s'), '.1f', 's')}, "
        f"training {_fmt(w.get('training_s'), '.1f', 's')}, evaluation {_fmt(w.get('evaluation_s'), '.1f', 's')}, "
        f"total {_fmt(w.get('total_s'), '.1f', 's')}",
    ]
    if emu := report.get("emulation"):
        lines.append(
            f"  emulated          {emu['params']['duration_h']:g} h on {emu['params']['nodes']} hosts (job MTBF "
            f"{emu['mtbf_s'] / 3600:.1f} h, {emu['step_s']:.0f} s a step); {emu['recovery']} recovery, checkpoint every "
            f"{emu['every_steps']} steps ({emu['interval_s'] / 3600:.2f} h); {len(emu['kills'])} failures; overhead "
            f"{emu['overhead_total_pct']:.2f}% of failure-free time ("
            + ", ".join(f"{k.replace('_', ' ')} {v:.2f}%" for k, v in emu["overhead_pct"].items())
            + f"; first-order model {emu['expected_overhead_pct']:.2f}%)"
        )
    trainer_failures = report.get("trainer_failures") or []
    if trainer_failures:
        lines.append(
            f"  trainer failures  {len(trainer_failures)}; {_fmt(report.get('steps_with_fewer_trainers'), '')} steps ran "
            f"with fewer trainers; microbatches per committed step {_fmt(report.get('microbatches_per_committed_step'), '')}"
        )
    for h in report.get("hosts_lost") or []:
        lines.append(
            f"  host lost         {h['node_ip']} with {', '.join(h['actors'])}; Ray declared its node dead "
            + (f"{h['declared_dead_s']:.2f}s after it stopped answering" if h.get("declared_dead_s") is not None
               else "(no failed probe before that)")
        )
    for e in report.get("all_trainers_failed") or []:
        lines.append(
            f"    every trainer died: dense state and shards fell back to checkpoint step {e['fallback_step']} "
            f"({e['steps_lost']} steps redone)"
        )
    for t in trainer_failures:
        # A rebuilt report lacks the commits that time a detection; a full one lacks it only
        # when no trainer survived to notice.
        detect = _fmt(t.get("detection_s"), "", "s", "n/a" if report.get("rebuilt") else "n/a (no survivor)")
        lost = f" (lost with its {t['cause'][:-5]})" if (t.get("cause") or "").startswith("host ") else ""
        lines.append(
            f"    {t['actor']}{lost}: detected {detect}, {_fmt(t.get('steps_with_fewer_trainers'), '')} steps with fewer "
            f"trainers, replacement back after {_fmt(t.get('rejoined_s'), '', 's')} (state from a peer in "
            f"{_fmt(t.get('heal_s'), '', 's')}), joined at step {_fmt(t.get('replacement_joined_at_step'), '')}"
        )
    for f in report.get("failures") or []:
        detect = f"{f['detection_s']:.2f}s" if f.get("detection_s") is not None else "n/a"
        why, numbers = _decision(f.get("decision") or {})
        how = f"spare {f['spare']} adopted" if f.get("spare") else "new process"
        lines.append(
            f"    {f['actor']}: {f['recovery']} recovery ({why}), detected {detect}, {how} in "
            f"{_fmt(f.get('adoption_s', f.get('reschedule_s')), '.2f', 's')}, loaded in {_fmt(f.get('load_s'), '.2f', 's')}, "
            f"serving {_fmt(f.get('serving_s'), '.2f', 's')} after the kill; "
            f"recovered in {f['recovery_s']:.2f}s from step {f['restored_step']} (redone from {_fmt(f.get('failed_at_step'), '')}), "
            f"{f['rows_reloaded']:,} rows / {f['bytes_reloaded'] / 1e6:,.1f} MB reloaded, "
            f"{_fmt(f.get('lost_samples'), ',.0f', missing='uncounted')} lost samples"
        )
        if numbers:
            lines.append(f"      cost model: {numbers}")
    state = report.get("state") or {}
    rebuilt = report.get("rebuilt")
    if rebuilt:
        notes = [
            "  CRASHED: the run did not finish (no report.json: its driver was killed, or it is still running); "
            f"rebuilt from {', '.join(rebuilt['from'])}",
            f"  last record       {_fmt(rebuilt.get('last_record_s'), '.1f', 's')} after the run began, "
            f"step {report.get('steps')} of {_fmt(rebuilt.get('total_steps'), '')}, "
            f"supervisor state {state.get('state') or 'unknown'}",
        ]
        notes += [f"  note: {n}" for n in rebuilt.get("notes", [])]
        lines[1:1] = notes
    elif report.get("interrupted"):
        lines.insert(1, "  INTERRUPTED: stopped by a signal; continue with cpr train --resume")
    elif state.get("state") == "failed":
        lines.insert(1, f"  STOPPED: {state.get('reason')}")
    return "\n".join(lines)


def _modes(report: dict) -> str:
    used = (report.get("recovery") or {}).get("used") or []
    return ", ".join(f"{m} recovery" for m in used) if used else "no recovery needed"


def write_report(run_dir: Path, report: dict) -> None:
    """Writes report.json, events.jsonl, summary.txt and the plots. A plot that cannot be
    drawn is logged, never fails the run: the report files are written first."""
    run_dir = Path(run_dir)
    (run_dir / REPORT_FILE).write_text(json.dumps(report, indent=2, default=str))
    with open(run_dir / EVENTS_FILE, "w") as f:
        for e in report["events"]:
            f.write(json.dumps(e, default=str) + "\n")
    render(run_dir, report)


def render(run_dir: Path, report: dict) -> list[Path]:
    """Writes summary.txt and the plots of ``report`` into ``run_dir``; returns the files
    written (a plot that failed is logged as a warning and left out)."""
    run_dir = Path(run_dir)
    (run_dir / SUMMARY_FILE).write_text(format_summary(report) + "\n")
    written = [run_dir / SUMMARY_FILE]
    try:
        from app.plots import write_plots

        written += write_plots(run_dir, report)
    except Exception as err:  # a picture is never worth a run: the numbers are on disk already
        logger.warning("could not draw the plots of %s: %r", run_dir, err)
    return written


def load_run(run_dir: str | Path) -> dict:
    """The report of a run directory: its report.json when the run finished (normally, on a
    budget, or interrupted), else one rebuilt from the files the run wrote as it went.
    Raises ReportError when the directory holds nothing a report can be read from."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ReportError(f"{run_dir}: no such run directory")
    path = run_dir / REPORT_FILE
    problem = None
    if path.exists():
        try:
            report = json.loads(_read(path))
            if isinstance(report, dict) and "events" in report:
                return report
            problem = f"{REPORT_FILE} is not a run report"
        except json.JSONDecodeError as err:  # a driver killed while writing it
            problem = f"{REPORT_FILE} is not valid JSON ({err})"
    return rebuild_report(run_dir, [problem] if problem else [])


def rebuild_report(run_dir: str | Path, notes: list[str] | None = None) -> dict:
    """A report, as far as the files allow, for a run that wrote no report.json (its driver
    died): config.yaml, events.jsonl, progress.jsonl and supervisor_state.json (the
    supervisor's journal). Numbers that only the driver knew are None; ``rebuilt`` says
    which files it came from and what is missing."""
    run_dir = Path(run_dir)
    notes = list(notes or [])
    used = []
    journal = {}
    if (run_dir / STATE_FILE).exists():
        try:
            journal = json.loads(_read(run_dir / STATE_FILE))
        except json.JSONDecodeError as err:
            notes.append(f"{STATE_FILE} is not valid JSON ({err}); left out")
        if isinstance(journal, dict) and journal:
            used.append(STATE_FILE)
        else:
            journal = {}
    events = _merge(_read_jsonl(run_dir / EVENTS_FILE, notes, used), journal.get("events") or [])
    progress = _merge(_read_jsonl(run_dir / PROGRESS_FILE, notes, used), journal.get("progress") or [])
    if not used:
        raise ReportError(
            f"{run_dir}: no {REPORT_FILE}, {EVENTS_FILE}, {PROGRESS_FILE} or {STATE_FILE} "
            "to read a report from; is it a run directory?" + (f" ({'; '.join(notes)})" if notes else "")
        )
    cfg = None
    if (run_dir / CONFIG_FILE).exists():
        try:
            cfg = load_config(run_dir / CONFIG_FILE)
            used.insert(0, CONFIG_FILE)
        except CprError as err:
            notes.append(f"{CONFIG_FILE} left out: {err}")
    else:
        notes.append(f"no {CONFIG_FILE}: samples and the checkpoint policy are unknown")

    def of(kind: str) -> list[dict]:
        return [e for e in events if e.get("kind") == kind]

    def strip(e: dict) -> dict:
        return {k: v for k, v in e.items() if k not in ("time", "kind")}

    first = _first_time(events, progress)
    last = max([e["time"] for e in events] + [p["time"] for p in progress], default=None)
    started = next((e.get("wall_time", e["time"]) for e in of("training_started")), None)
    finished = next((e.get("wall_time", e["time"]) for e in of("training_finished")), None)
    evaluated = next((e for e in of("evaluated")), None)
    training_s = ((finished or last) - started) if started is not None else None
    wall = {
        "data_prep_s": None,
        "startup_s": started - first if started is not None else None,
        "training_s": training_s,
        "evaluation_s": evaluated["time"] - finished if (evaluated and finished) else None,
        "total_s": last - first if first is not None else None,
    }
    evaluation = journal.get("eval") or (strip(evaluated) if evaluated else {})
    resumed_from = journal.get("resume_step") or 0
    steps = evaluation.get("steps") or max(
        [p.get("step") or 0 for p in progress] + [e.get("step") or 0 for e in of("training_finished")] + [resumed_from]
    )
    samples_per_step = cfg.training.microbatches_per_step * cfg.training.microbatch_rows if cfg else None
    samples = steps * samples_per_step if cfg else None
    samples_this_run = (steps - resumed_from) * samples_per_step if cfg else None
    failures = journal.get("failures") or [strip(e) for e in of("shard_recovered")]
    kills = journal.get("kills") or [
        {"target": e.get("target"), "time": e.get("at", e["time"]), "pid": e.get("pid"), "trigger": e.get("trigger")}
        for e in of("fault_injected")
    ]
    saves = of("checkpoint_saved")
    step_time_s = (training_s or 0.0) / max(steps - resumed_from, 1)
    overhead_s = _overhead_s(saves, failures, step_time_s, None)
    lost_samples = sum(f.get("lost_samples") or 0.0 for f in failures)
    state = journal.get("state") or next(
        ({"state": e.get("state"), "reason": e.get("reason")} for e in reversed(of("state_changed"))), {}
    )
    intervals = of("interval_changed")
    interval_steps = (
        intervals[-1].get("interval_steps") if intervals
        else (journal.get("schedule") or {}).get("interval_steps_in_use") or (cfg.checkpoint.every_steps if cfg else None)
    )
    trainer_failures = []
    if cfg is not None:
        # Commits are not journalled: detection and the steps with fewer trainers are not known.
        heals = journal.get("heals") or [
            {"rank": e.get("rank"), "step": e.get("step"), "heal_s": e.get("heal_s") or 0.0, "time": e["time"]}
            for e in of("trainer_healed")
        ]
        trainer_failures = accounting.trainer_failures(kills, [], {}, heals, cfg.training.num_trainers)
        for t in trainer_failures:
            t["detection_s"] = t["steps_with_fewer_trainers"] = None
    total_steps = next((p["total_steps"] for p in reversed(progress) if p.get("total_steps") is not None), None)
    return {
        "run_id": journal.get("run_id") or _run_id(run_dir),
        "auc": evaluation.get("auc"),
        "log_loss": evaluation.get("log_loss"),
        "ceiling_auc": None,
        "auc_fraction_of_ceiling": None,
        "eval_rows": evaluation.get("eval_rows"),
        "steps": steps,
        "resumed_from_step": journal.get("resume_step"),
        "samples_trained": samples,
        "samples_this_run": samples_this_run,
        "samples_per_s": samples_this_run / training_s if (samples_this_run and training_s) else None,
        "bad_lines_skipped": None,
        "recovery": {
            "requested": cfg.recovery if cfg else None,
            "used": sorted({f["recovery"] for f in failures if f.get("recovery")}),
            "decisions": [{"actor": f.get("actor"), **(f.get("decision") or {})} for f in failures],
        },
        "state": state,
        "supervisor_restarts": journal.get("supervisor_restarts", len(of("supervisor_restarted"))),
        "faults_injected": kills,
        "failures": failures,
        "lost_samples": lost_samples,
        "pls": lost_samples / samples if samples else None,
        "checkpoints_saved": len(saves),
        "incremental_checkpoints": sum(1 for e in saves if e.get("checkpoint_kind") == "incremental"),
        "checkpoint_policy": {"policy": cfg.checkpoint.policy if cfg else None, "interval_steps": interval_steps},
        "interval_changes": intervals,
        "trainer_failures": trainer_failures,
        "hosts_lost": hosts_lost(events),
        "all_trainers_failed": of("all_trainers_failed"),
        "microbatches_per_committed_step": None,
        "steps_with_fewer_trainers": None,
        "commits": {},
        "overhead_s": {k: None if v is None else round(v, 3) for k, v in overhead_s.items()},
        "tracking_s_per_step": None,
        "save_split_s": _save_split(saves),
        "overhead_pct_of_wall": {
            k: round(100 * v / wall["total_s"], 2) if (v is not None and wall["total_s"]) else None
            for k, v in overhead_s.items()
        },
        "wall_time_s": {k: None if v is None else round(v, 3) for k, v in wall.items()},
        "shards": None,
        "events": events,
        "progress": progress,
        "config": cfg.model_dump() if cfg else None,
        "interrupted": False,
        "rebuilt": {
            "from": used,
            "notes": notes,
            "total_steps": total_steps,
            "last_record_s": round(last - first, 3) if last is not None else None,
        },
    }


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError) as err:
        raise ReportError(f"{path}: cannot read it ({err.__class__.__name__}: {err})") from None


def _read_jsonl(path: Path, notes: list[str], used: list[str]) -> list[dict]:
    """The records of a JSON-lines file the run appends to. A line that does not parse (the
    last one, torn by a kill mid-write) is skipped and counted in ``notes``."""
    if not path.exists():
        return []
    records, bad = [], 0
    for line in _read(path).splitlines():
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            bad += 1
            continue
        if isinstance(record, dict) and isinstance(record.get("time"), (int, float)):
            records.append(record)
        else:
            bad += 1
    if bad:
        notes.append(f"{bad} unreadable line(s) of {path.name} skipped")
    used.append(path.name)
    return records


def _merge(*sources: list[dict]) -> list[dict]:
    """The union of records from several files, each once, in time order (the journal and
    the JSON-lines files hold overlapping copies of the same records)."""
    seen, out = set(), []
    for record in (r for source in sources for r in source if isinstance(r.get("time"), (int, float))):
        key = json.dumps(record, sort_keys=True, default=str)
        if key not in seen:
            seen.add(key)
            out.append(record)
    return sorted(out, key=lambda r: r["time"])


def _first_time(events: list[dict], progress: list[dict]) -> float | None:
    """When the run began, as far as its records tell: the shards' start before their
    ``shards_ready`` event, else the first record."""
    times = [e["time"] - (e.get("startup_s") or 0.0) if e.get("kind") == "shards_ready" else e["time"] for e in events]
    times += [p["time"] for p in progress]
    return min(times, default=None)


def _run_id(run_dir: Path) -> str:
    try:
        return json.loads((run_dir / "run.json").read_text())["run_id"]
    except (OSError, ValueError, KeyError, TypeError):
        return run_dir.name
