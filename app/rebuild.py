"""Reading a run directory back into a report (``cpr report``): its ``report.json`` when the
run finished, else a report rebuilt, as far as they allow, from the files a run writes as it
goes (config, events, progress and the supervisor's journal) when its driver died.
"""

from __future__ import annotations

import json
from pathlib import Path

from app.tallies import hosts_lost, overhead_seconds, save_failures, save_split
from core import accounting
from core.config import RunConfig, load_config
from core.errors import CprError
from core.codec import decode, encode
from actors.supervisor.step_records import StepRecords
from core.journal import BOOK_FILE, EVENTS_FILE, PROGRESS_FILE, STATE_FILE, AppendLog, Journal, flat_view
from core.books import KillRecord
from core.records import Heal

__all__ = ["load_run", "rebuild_report", "ReportError", "REPORT_FILE", "CONFIG_FILE"]

REPORT_FILE = "report.json"
CONFIG_FILE = "config.yaml"


class ReportError(CprError):
    """A run directory cannot be read back into a report: it does not exist, holds none of
    the run's files, or a file cannot be read. The message names the path."""


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
    used: list[str] = []
    journal = _read_journal(run_dir, notes, used)
    events = _merge(_read_jsonl(run_dir / EVENTS_FILE, notes, used), journal.get("events") or [])
    progress = _merge(_read_jsonl(run_dir / PROGRESS_FILE, notes, used), journal.get("progress") or [])
    if not used:
        raise ReportError(
            f"{run_dir}: no {REPORT_FILE}, {EVENTS_FILE}, {PROGRESS_FILE} or {STATE_FILE} "
            "to read a report from; is it a run directory?" + (f" ({'; '.join(notes)})" if notes else "")
        )
    cfg = _read_config(run_dir, notes, used)
    wall, first, last = _wall(events, progress)
    outcome = _outcome(run_dir, cfg, journal, events, progress, wall["training_s"])
    steps_this_run = outcome["steps"] - (journal.get("resume_step") or 0)
    failures = journal.get("failures") or [_strip(e) for e in _of(events, "shard_recovered")]
    withdrawn = {(e.get("target"), e.get("pid"), e.get("at")) for e in _of(events, "fault_withdrawn")}
    kills = journal.get("kills") or [
        {"target": e.get("target"), "time": e.get("at", e["time"]), "pid": e.get("pid"), "trigger": e.get("trigger")}
        for e in _of(events, "fault_injected") if (e.get("target"), e.get("pid"), e.get("at")) not in withdrawn
    ]
    total_steps = next((p["total_steps"] for p in reversed(progress) if p.get("total_steps") is not None), None)
    # The sections in the order of report.json's entries (a dict keeps its insertion order).
    return {
        **outcome,
        **_failures(cfg, journal, events, failures, kills, outcome["samples_trained"]),
        **_checkpoints(cfg, journal, events),
        **_trainers(run_dir, cfg, journal, events, kills, notes),
        **_costs(events, failures, wall, steps_this_run),
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


def _read_journal(run_dir: Path, notes: list[str], used: list[str]) -> dict:
    """The supervisor's journal, or {} when there is none or it does not parse."""
    journal = {}
    if (run_dir / STATE_FILE).exists():
        try:
            journal = Journal(run_dir).load()
        except ValueError as err:
            notes.append(f"{STATE_FILE} is not valid JSON ({err}); left out")
        except OSError as err:
            raise ReportError(f"{run_dir / STATE_FILE}: cannot read it ({err.__class__.__name__}: {err})") from None
        if isinstance(journal, dict) and journal:
            used.append(STATE_FILE)
        else:
            journal = {}
    return flat_view(journal)


def _read_config(run_dir: Path, notes: list[str], used: list[str]) -> RunConfig | None:
    """The run's config, None (and a note) when it is missing or invalid."""
    if not (run_dir / CONFIG_FILE).exists():
        notes.append(f"no {CONFIG_FILE}: samples and the checkpoint policy are unknown")
        return None
    try:
        cfg = load_config(run_dir / CONFIG_FILE)
    except CprError as err:
        notes.append(f"{CONFIG_FILE} left out: {err}")
        return None
    used.insert(0, CONFIG_FILE)
    return cfg


def _of(events: list[dict], kind: str) -> list[dict]:
    return [e for e in events if e.get("kind") == kind]


def _strip(e: dict) -> dict:
    return {k: v for k, v in e.items() if k not in ("time", "kind")}


def _wall(events: list[dict], progress: list[dict]) -> tuple[dict, float | None, float | None]:
    """Seconds of each phase as far as the records time them (unrounded; the data
    preparation only the driver knew), and the times of the first and the last record."""
    first = _first_time(events, progress)
    last = max([e["time"] for e in events] + [p["time"] for p in progress], default=None)
    started = next((e.get("wall_time", e["time"]) for e in _of(events, "training_started")), None)
    finished = next((e.get("wall_time", e["time"]) for e in _of(events, "training_finished")), None)
    evaluated = next(iter(_of(events, "evaluated")), None)
    wall = {
        "data_prep_s": None,
        "startup_s": started - first if started is not None else None,
        "training_s": ((finished or last) - started) if started is not None else None,
        "evaluation_s": max(0.0, evaluated.get("wall_time", evaluated["time"]) - finished) if (evaluated and finished) else None,
        "total_s": last - first if first is not None else None,
    }
    return wall, first, last


def _outcome(
    run_dir: Path, cfg: RunConfig | None, journal: dict, events: list[dict], progress: list[dict],
    training_s: float | None,
) -> dict:
    """The report's first entries: evaluation, steps and samples (unknown without a config)."""
    evaluated = next(iter(_of(events, "evaluated")), None)
    evaluation = journal.get("eval") or (_strip(evaluated) if evaluated else {})
    resumed_from = journal.get("resume_step") or 0
    steps = evaluation.get("steps") or max(
        [p.get("step") or 0 for p in progress]
        + [e.get("step") or 0 for e in _of(events, "training_finished")]
        + [resumed_from]
    )
    samples_per_step = cfg.training.microbatches_per_step * cfg.training.microbatch_rows if cfg else None
    samples = steps * samples_per_step if cfg else None
    samples_this_run = (steps - resumed_from) * samples_per_step if cfg else None
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
    }


def _failures(
    cfg: RunConfig | None, journal: dict, events: list[dict], failures: list[dict], kills: list[dict],
    samples: int | None,
) -> dict:
    """Recovery, the supervisor's state, the kills and the shard failures with their lost samples."""
    lost_samples = sum(f.get("lost_samples") or 0.0 for f in failures)
    state = journal.get("state") or next(
        ({"state": e.get("state"), "reason": e.get("reason")} for e in reversed(_of(events, "state_changed"))), {}
    )
    return {
        "recovery": {
            "requested": cfg.recovery if cfg else None,
            "used": sorted({f["recovery"] for f in failures if f.get("recovery")}),
            "decisions": [{"actor": f.get("actor"), **(f.get("decision") or {})} for f in failures],
        },
        "state": state,
        "supervisor_restarts": journal.get("supervisor_restarts", len(_of(events, "supervisor_restarted"))),
        "faults_injected": kills,
        "failures": failures,
        "lost_samples": lost_samples,
        "pls": lost_samples / samples if samples else None,
    }


def _checkpoints(cfg: RunConfig | None, journal: dict, events: list[dict]) -> dict:
    """The saves, the failed ones, and the checkpoint interval last in use."""
    saves = _of(events, "checkpoint_saved")
    intervals = _of(events, "interval_changed")
    schedule = journal.get("schedule") or {}
    interval_steps = (
        intervals[-1].get("interval_steps") if intervals
        else schedule.get("interval_steps_in_use") or (cfg.checkpoint.every_steps if cfg else None)
    )
    return {
        "checkpoints_saved": len(saves),
        "incremental_checkpoints": sum(1 for e in saves if e.get("checkpoint_kind") == "incremental"),
        "failed_saves": (
            {"failed": schedule["failed_saves"], "longest_in_a_row": schedule.get("longest_failed_in_a_row") or 0}
            if schedule.get("failed_saves") is not None else save_failures(events)
        ),
        "checkpoint_policy": {"policy": cfg.checkpoint.policy if cfg else None, "interval_steps": interval_steps},
        "interval_changes": intervals,
    }


def _trainers(run_dir: Path, cfg: RunConfig | None, journal: dict, events: list[dict], kills: list[dict],
              notes: list[str]) -> dict:
    """Trainer failures and hosts lost, and the committed steps' tally, from the trainer book
    (``trainer_book.jsonl``) replayed as the supervisor does. Without it the detection of a
    trainer failure, the steps with fewer trainers and the microbatches per step are unknown."""
    out = {"trainer_failures": [], "hosts_lost": hosts_lost(events),
           "all_trainers_failed": _of(events, "all_trainers_failed"),
           "microbatches_per_committed_step": None, "steps_with_fewer_trainers": None}
    if cfg is None:
        return out
    heals = journal.get("heals") or [
        {"rank": e.get("rank"), "step": e.get("step"), "heal_s": e.get("heal_s") or 0.0, "time": e["time"]}
        for e in _of(events, "trainer_healed")
    ]
    kill_records = [decode(KillRecord, k) for k in kills]
    if (run_dir / BOOK_FILE).exists():
        book = StepRecords(None, lambda: kill_records, cfg.training.num_trainers)
        try:
            book.load({"heals": heals, "attempt_starts": journal.get("attempt_starts") or [],
                       "prunes": journal.get("prunes") or []}, AppendLog.iter(run_dir / BOOK_FILE), history_only=True)
        except (ValueError, KeyError, TypeError) as err:
            notes.append(f"{BOOK_FILE} left out: {err}")
        else:
            tally = book.tally()
            return {**out, "trainer_failures": [encode(t) for t in book.failures()],
                    "microbatches_per_committed_step": list(tally.microbatches_per_step),
                    "steps_with_fewer_trainers": tally.steps_with_fewer_trainers}
    found = accounting.trainer_failures(kill_records, [], {}, [decode(Heal, h) for h in heals],
                                        cfg.training.num_trainers)
    return {**out, "trainer_failures": [{**encode(t), "detection_s": None, "steps_with_fewer_trainers": None}
                                        for t in found]}


def _costs(events: list[dict], failures: list[dict], wall: dict, steps_this_run: int) -> dict:
    """The fault-tolerance overheads (shard tracking is not journalled) and the wall time."""
    saves = _of(events, "checkpoint_saved")
    step_time_s = (wall["training_s"] or 0.0) / max(steps_this_run, 1)
    overhead_s = overhead_seconds(saves, failures, step_time_s, None)
    return {
        "overhead_s": {k: None if v is None else round(v, 3) for k, v in overhead_s.items()},
        "tracking_s_per_step": None,
        "save_split_s": save_split(saves),
        "overhead_pct_of_wall": {
            k: round(100 * v / wall["total_s"], 2) if (v is not None and wall["total_s"]) else None
            for k, v in overhead_s.items()
        },
        "wall_time_s": {k: None if v is None else round(v, 3) for k, v in wall.items()},
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
