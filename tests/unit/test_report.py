"""The run report from a supervisor summary, without Ray."""

from __future__ import annotations

import pytest

from app.config import config_from_dict
from app.report import build_report, format_summary

pytestmark = pytest.mark.timeout(30)


class _Cache:
    bad_lines = 0


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
        "events": [], "commits": {}, "state": {"state": "finished", "how": "completed"},
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
