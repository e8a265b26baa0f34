"""The run report from a supervisor summary, its pictures, and `cpr report` on a run's files, without Ray."""

from __future__ import annotations

import json
import logging
import sys

import matplotlib.image
import pytest
import yaml
from click.testing import CliRunner

from app.cli import main, run
from core.config import config_from_dict
from core.errors import CprError
from app.report import ReportError, build_report, format_summary, rebuild_report, write_report
from policies import CostInputs, decide_recovery

pytestmark = pytest.mark.timeout(30)


class _Cache:
    """What the report reads of a store (app.dataprep.StoreInfo)."""

    bad_lines = 0
    rows = 1000
    uri = "/tmp/cache/train-0"
    reused = False
    mapping = {"kind": "hash", "table_rows": [1000] * 26, "min_count": 0}
    build = {"engine": "Ray Data", "rows_per_s": 50_000, "seconds": 0.02, "chunks": 1, "hosts": {}}


def _failure(actor, mode, reason):
    return {
        "actor": actor, "recovery": mode, "decision": {"mode": mode, "requested": "auto", "reason": reason},
        "detection_s": 0.1, "recovery_s": 2.0, "restored_step": 10, "failed_at_step": 14, "rows_reloaded": 5,
        "bytes_reloaded": 100, "lost_samples": 3.0 if mode == "partial" else 0.0,
        "lost_steps_recomputed": 0 if mode == "partial" else 4, "load_s": 0.5, "reschedule_s": 1.0,
    }


def test_report_shows_the_mode_each_failure_used():
    # Defect 9: the report shows what each failure did, not a decision recomputed at the end.
    cfg = config_from_dict({"data": {"train": ["x"], "eval": ["y"]}, "recovery": "auto"})
    failures = [_failure("shard:0", "partial", "partial wins"), _failure("shard:1", "full", "MTBF fell")]
    summary = {
        "run_id": "r", "eval": {"steps": 20, "auc": 0.7, "log_loss": 0.5, "eval_rows": 10}, "failures": failures,
        "events": [], "committed": {}, "state": {"state": "finished", "how": "completed"},
        "recovery_mode": {"requested": "auto", "used": ["full", "partial"],
                          "decisions": [{"actor": f["actor"], **f["decision"]} for f in failures]},
        "faults_injected": [{"target": "shard:0"}, {"target": "shard:1"}],
    }
    data = {"train": _Cache(), "eval": _Cache(), "ceiling_auc": None}
    wall = {"data_prep_s": 1, "startup_s": 1, "training_s": 10, "evaluation_s": 1, "total_s": 13}
    report = build_report(cfg, summary, data, wall)
    assert [f["recovery"] for f in report["failures"]] == ["partial", "full"]
    assert report["recovery"]["used"] == ["full", "partial"]
    text = format_summary(report)
    assert "partial recovery (partial wins" in text and "full recovery (MTBF fell" in text
    assert "2 kills injected" in text


# ---------------------------------------------------------------- pictures and `cpr report`

T0 = 1_700_000_000.0
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _run_files():
    """What a small run with one shard kill, one trainer kill and a rollback writes as it goes:
    (config, events, progress, supervisor journal)."""
    raw = {"run_dir": "unused", "data": {"train": ["x"], "eval": ["y"]}, "recovery": "auto"}
    decision = decide_recovery("auto", CostInputs(30.0, 0.5, 1.0, 3.0, 2, 0.02))
    failure = {
        "actor": "shard:1", "shard": 1, "generation": 0, "cause": "ActorDiedError", "detected_at": T0 + 20.1,
        "killed_at": T0 + 20.0, "detection_s": 0.1, "first_step": 0, "recovery": decision.mode.value,
        "decision": {"mode": decision.mode.value, "requested": "auto", "reason": decision.reason},
        "generation_after": 1, "reschedule_s": 2.5, "load_s": 0.8, "recovery_s": 3.5, "restored_step": 20,
        "chain": [20], "rows_reloaded": 1000, "bytes_reloaded": 80_000, "failed_at_step": 26,
        "lost_samples": 512.0, "lost_steps_recomputed": 0,
    }
    events = [
        {"time": T0, "kind": "shards_ready", "shards": 2, "startup_s": 2.0},
        {"time": T0 + 5.0, "kind": "trainer_started", "rank": 0, "pid": 11, "starts": 1},
        {"time": T0 + 5.1, "kind": "training_started", "step": 0, "trainers": 2, "wall_time": T0 + 6.0},
        {"time": T0 + 12.0, "kind": "checkpoint_saved", "step": 10, "checkpoint_kind": "full", "duration_s": 0.4,
         "bytes": 10, "rows": 10},
        {"time": T0 + 15.0, "kind": "fault_injected", "target": "trainer:0", "pid": 11, "at": T0 + 15.0, "trigger": "at step 15"},
        {"time": T0 + 18.0, "kind": "checkpoint_saved", "step": 20, "checkpoint_kind": "incremental", "duration_s": 0.3,
         "bytes": 10, "rows": 10},
        {"time": T0 + 20.0, "kind": "fault_injected", "target": "shard:1", "pid": 12, "at": T0 + 20.0, "trigger": "at step 25"},
        {"time": T0 + 20.1, "kind": "state_changed", "previous": "running", "state": "recovering_shards", "reason": "shard 1 died"},
        {"time": T0 + 22.0, "kind": "trainer_healed", "rank": 0, "step": 26, "heal_s": 1.2},
        {"time": T0 + 23.6, "kind": "shard_recovered", **failure},
        {"time": T0 + 30.0, "kind": "all_trainers_failed", "fallback_step": 20, "steps_lost": 8, "fenced": [],
         "rows_reloaded": 0, "load_s": 0.0},
        {"time": T0 + 31.0, "kind": "checkpoint_fallback", "step": 20, "reason": "step 30 corrupt"},
    ]
    progress = [
        {"time": T0 + 6.0 + 2.0 * i, "step": 5 * (i + 1), "total_steps": 80, "loss": 0.7 - 0.02 * i,
         "samples_per_s": 20_000.0 - 500 * i, "trainers": 1 if 4 <= i <= 7 else 2, "phase_s": {"dense": 0.1}}
        for i in range(14)
    ]
    journal = {
        "run_id": "crashed1", "state": {"state": "running"}, "events": events[:6], "failures": [failure],
        "resume_step": None, "supervisor_restarts": 0, "eval": None,
        "kills": [{"target": e["target"], "time": e["at"], "pid": e["pid"], "trigger": e["trigger"]}
                  for e in events if e["kind"] == "fault_injected"],
        "heals": [{"rank": 0, "step": 26, "heal_s": 1.2, "time": T0 + 22.0}], "failed_steps": [],
        "progress": progress[-3:],
    }
    return raw, events, progress, journal


def _full_report(interrupted: bool = False, **summary_fields) -> dict:
    raw, events, progress, journal = _run_files()
    steps = progress[-1]["step"]
    summary = {
        "run_id": "finished1", "eval": None if interrupted else {"steps": steps, "auc": 0.71, "log_loss": 0.5, "eval_rows": 100},
        "failures": journal["failures"], "events": events, "progress": progress,
        "committed": {"steps": steps, "microbatches_per_step": [4], "steps_with_fewer_trainers": 0},
        "state": {"state": "stopped" if interrupted else "finished", "how": "interrupted" if interrupted else "completed"},
        "recovery_mode": {"requested": "auto", "used": [f["recovery"] for f in journal["failures"]], "decisions": []},
        "faults_injected": journal["kills"], "checkpoint_policy": {"policy": "full", "interval_steps": 10},
        "shards": [{"tracking_s": 0.2}, {"tracking_s": 0.3}], **summary_fields,
    }
    data = {"train": _Cache(), "eval": _Cache(), "ceiling_auc": 0.8}
    wall = {"data_prep_s": 1.0, "startup_s": 6.0, "training_s": 28.0, "evaluation_s": 1.0, "total_s": 36.0}
    report = build_report(config_from_dict(raw), summary, data, wall)
    report["interrupted"] = interrupted
    return report


def _assert_png(path):
    assert path.read_bytes()[:8] == PNG_SIGNATURE, f"{path} is not a PNG"
    height, width, _ = matplotlib.image.imread(path).shape
    assert width > 600 and height > 300


def _write_crashed_run(run_dir, with_journal: bool):
    raw, events, progress, journal = _run_files()
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(yaml.safe_dump(raw))
    # The driver died mid-append: the last line of each file is torn.
    (run_dir / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events) + '{"time": 17000')
    (run_dir / "progress.jsonl").write_text("".join(json.dumps(p) + "\n" for p in progress[:-3]) + '{"ti')
    if with_journal:
        (run_dir / "supervisor_state.json").write_text(json.dumps(journal))


def test_write_report_draws_the_timeline_and_the_overhead(tmp_path):
    write_report(tmp_path, _full_report())
    for name in ("timeline.png", "overhead.png"):
        _assert_png(tmp_path / name)
    assert "held-out AUC      0.7100" in (tmp_path / "summary.txt").read_text()
    assert not (tmp_path / "events.jsonl").exists(), "the events file is the supervisor's: the report leaves it"


def test_a_plot_that_fails_is_a_warning_not_a_failed_run(tmp_path, monkeypatch, caplog):
    def broken(run_dir, report):
        raise ValueError("no room for a legend")

    monkeypatch.setattr("app.plots.write_plots", broken)
    with caplog.at_level(logging.WARNING, logger="app.report"):
        write_report(tmp_path, _full_report())
    assert (tmp_path / "report.json").exists() and (tmp_path / "summary.txt").exists()
    assert "no room for a legend" in caplog.text


def test_summary_shows_the_recovery_decision_whole_with_its_numbers():
    text = format_summary(_full_report())
    line = next(x for x in text.splitlines() if x.strip().startswith("shard:1:"))
    why = line.split("recovery (", 1)[1].split("), detected", 1)[0]
    assert why.startswith("auto -> ") and why.count("(") == why.count(")"), why
    assert "      cost model: full: interval " in text and "MTBF 30 s" in text


@pytest.mark.parametrize("with_journal", [True, False])
def test_cpr_report_rebuilds_a_crashed_run_from_its_files(tmp_path, with_journal):
    run_dir = tmp_path / "run"
    _write_crashed_run(run_dir, with_journal)
    result = CliRunner().invoke(main, ["report", str(run_dir)])
    assert result.exit_code == 0, result.output + repr(result.exception)
    summary = (run_dir / "summary.txt").read_text()
    assert "CRASHED: the run did not finish" in summary and "Traceback" not in result.output
    assert "1 unreadable line(s) of events.jsonl skipped" in summary
    # Progress lost from progress.jsonl's torn tail is still in the journal.
    assert f"in {70 if with_journal else 55} steps" in summary
    assert "fell back to checkpoint step 20" in summary
    assert "shard:1: partial recovery" in summary or "shard:1: full recovery" in summary
    assert not (run_dir / "report.json").exists(), "a rebuilt report must not pass for a finished run's"
    for name in ("timeline.png", "overhead.png"):
        _assert_png(run_dir / name)


def test_rebuilt_report_keeps_what_the_files_tell(tmp_path):
    run_dir = tmp_path / "run"
    _write_crashed_run(run_dir, with_journal=True)
    report = rebuild_report(run_dir)
    tr = config_from_dict(_run_files()[0]).training
    assert report["steps"] == 70 and report["samples_trained"] == 70 * tr.microbatches_per_step * tr.microbatch_rows
    # Time zero is the shards' start (2 s before shards_ready); training began at its wall_time.
    assert report["wall_time_s"]["startup_s"] == 8.0 and report["wall_time_s"]["data_prep_s"] is None
    assert [k["target"] for k in report["faults_injected"]] == ["trainer:0", "shard:1"]
    assert report["lost_samples"] == 512.0 and report["checkpoints_saved"] == 2
    assert report["overhead_s"]["save"] == 0.7 and report["overhead_s"]["tracking"] is None
    assert report["state"]["state"] == "running" and report["trainer_failures"][0]["rejoined_s"] == 7.0
    assert report["rebuilt"]["from"] == ["config.yaml", "supervisor_state.json", "events.jsonl", "progress.jsonl"]


def test_cpr_report_renders_an_interrupted_run_again(tmp_path):
    write_report(tmp_path, _full_report(interrupted=True))
    for name in ("summary.txt", "timeline.png", "overhead.png"):
        (tmp_path / name).unlink()
    result = CliRunner().invoke(main, ["report", str(tmp_path)])
    assert result.exit_code == 0, result.output + repr(result.exception)
    assert "INTERRUPTED" in (tmp_path / "summary.txt").read_text()
    assert "not evaluated" in result.output
    for name in ("timeline.png", "overhead.png"):
        _assert_png(tmp_path / name)


def test_cpr_report_on_a_finished_run_keeps_its_report_json(tmp_path):
    write_report(tmp_path, _full_report())
    before = (tmp_path / "report.json").read_text()
    result = CliRunner().invoke(main, ["report", str(tmp_path)])
    assert result.exit_code == 0, result.output + repr(result.exception)
    assert (tmp_path / "report.json").read_text() == before
    assert "CRASHED" not in (tmp_path / "summary.txt").read_text()


@pytest.mark.parametrize(
    "setup, message",
    [
        (lambda d: None, "no such run directory"),
        (lambda d: d.mkdir(), "is it a run directory?"),
        (lambda d: (d.mkdir(), (d / "events.jsonl").mkdir()), "events.jsonl: cannot read it"),
    ],
    ids=["missing", "empty", "unreadable"],
)
def test_cpr_report_on_a_bad_run_dir_is_one_clear_error(tmp_path, monkeypatch, capsys, setup, message):
    run_dir = tmp_path / "run"
    setup(run_dir)
    result = CliRunner().invoke(main, ["report", str(run_dir)])
    assert isinstance(result.exception, ReportError) and isinstance(result.exception, CprError)
    assert message in str(result.exception) and str(run_dir) in str(result.exception)
    # Through the real entry point: one line on stderr, exit status 2, no traceback.
    monkeypatch.setattr(sys, "argv", ["cpr", "report", str(run_dir)])
    with pytest.raises(SystemExit) as exit_info:
        run()
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and "Traceback" not in err


def test_a_torn_report_json_is_rebuilt_from_the_other_files(tmp_path):
    run_dir = tmp_path / "run"
    _write_crashed_run(run_dir, with_journal=True)
    (run_dir / "report.json").write_text('{"run_id": "crashed1", "events": [')  # killed while writing it
    result = CliRunner().invoke(main, ["report", str(run_dir)])
    assert result.exit_code == 0, result.output + repr(result.exception)
    summary = (run_dir / "summary.txt").read_text()
    assert "CRASHED" in summary and "note: report.json is not valid JSON" in summary


# ---------------------------------------------------------------- failed saves


def test_the_report_counts_failed_saves_and_the_summary_names_them_only_when_some_failed():
    quiet = _full_report()
    assert quiet["failed_saves"] == {"failed": 0, "longest_in_a_row": 0}
    assert "failed saves" not in format_summary(quiet)
    report = _full_report(save_failures={"failed": 7, "longest_in_a_row": 4})
    assert report["failed_saves"] == {"failed": 7, "longest_in_a_row": 4}
    assert "  failed saves      7 checkpoint saves failed (at most 4 in a row)" in format_summary(report)


@pytest.mark.parametrize("with_journal", [True, False])
def test_a_rebuilt_report_counts_failed_saves(tmp_path, with_journal):
    run_dir = tmp_path / "run"
    _write_crashed_run(run_dir, with_journal)
    _, events, _, journal = _run_files()
    failed = [{"time": T0 + 24.0 + i, "kind": "checkpoint_failed", "step": 30 + i, "phase": "write",
               "error": "[Errno 28] No space left on device", "failed_in_a_row": n} for i, n in enumerate((1, 2, 1))]
    (run_dir / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in sorted(events + failed, key=lambda e: e["time"])))
    if with_journal:  # the journal's count is the supervisor's own (its events may be a window)
        journal["schedule"] = {"failed_saves": 5, "longest_failed_in_a_row": 3}
        (run_dir / "supervisor_state.json").write_text(json.dumps(journal))
    report = rebuild_report(run_dir)
    assert report["failed_saves"] == ({"failed": 5, "longest_in_a_row": 3} if with_journal
                                      else {"failed": 3, "longest_in_a_row": 2})
    assert "  failed saves      " in format_summary(report)
