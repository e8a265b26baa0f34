"""The emulated clock of ``cpr emulate``: its schedule, its interval and the costs it charges."""

from __future__ import annotations

import math

import pytest

from core.config import EmulationConfig, config_from_dict
from app.emulation import Emulation
from core.errors import ConfigError


def _cfg(recovery: str = "partial", **emulation) -> dict:
    return {
        "data": {"train": ["t.tsv"], "eval": ["e.tsv"]},
        "model": {"table_rows": 1000},
        "embeddings": {"num_shards": 4},
        "checkpoint": {"pls_target": 0.1},
        "recovery": recovery,
        "emulation": emulation,
    }


def _emulation(recovery: str = "partial", total_steps: int = 200, **emulation) -> Emulation:
    return Emulation.of(config_from_dict(_cfg(recovery, **emulation)), total_steps)


def test_the_clock_maps_steps_to_production_time_and_the_job_mtbf_to_hosts():
    e = _emulation(duration_h=100, nodes=50, node_mtbf_h=5000, total_steps=400)
    assert e.step_s == pytest.approx(100 * 3600 / 400)
    assert e.mtbf_s == pytest.approx(5000 * 3600 / 50)


def test_full_recovery_saves_at_the_young_daly_interval_partial_at_the_pls_target():
    full = _emulation("full", save_s=600, total_steps=1000)
    t_full = math.sqrt(2 * 600 * full.mtbf_s)
    assert full.decision.interval_s == pytest.approx(t_full)
    assert full.every_steps == math.floor(t_full / full.step_s)
    partial = _emulation("partial", total_steps=1000)
    t_part = 2 * 0.1 * partial.mtbf_s * 4
    assert partial.decision.interval_s == pytest.approx(t_part)
    assert partial.every_steps == math.floor(t_part / partial.step_s)


def test_configure_sets_the_interval_the_mode_auto_chose_and_per_step_progress():
    e = _emulation("auto")
    cfg = e.configure(config_from_dict(_cfg("auto")))
    assert cfg.recovery == e.decision.mode.value != "auto"
    assert cfg.checkpoint.every_steps == e.every_steps
    assert cfg.checkpoint.auto_interval is False and cfg.checkpoint.every_s is None
    assert cfg.training.progress_every_steps == 1


def test_the_failure_schedule_is_the_seeds_and_exponential_with_the_job_mtbf():
    a = _emulation(seed=3, max_failures=10_000, duration_h=10**6).failure_times_s()
    b = _emulation(seed=3, max_failures=10_000, duration_h=10**6).failure_times_s()
    c = _emulation(seed=4, max_failures=10_000, duration_h=10**6).failure_times_s()
    assert a == b and a != c
    gaps = [y - x for x, y in zip([0.0, *a], a)]
    mtbf = _emulation().mtbf_s
    assert sum(gaps) / len(gaps) == pytest.approx(mtbf, rel=0.05)
    # Coefficient of variation 1: exponential, not fixed gaps.
    mean = sum(gaps) / len(gaps)
    sd = math.sqrt(sum((g - mean) ** 2 for g in gaps) / len(gaps))
    assert sd / mean == pytest.approx(1.0, rel=0.1)
    assert len(_emulation(max_failures=2, duration_h=10**6).failure_times_s()) == 2


def test_account_charges_each_cost_once_from_the_runs_records():
    e = _emulation(save_s=100, load_s=200, reschedule_s=50, total_steps=100, duration_h=100)
    total_rows = 26 * 1000
    report = {
        "events": [
            {"kind": "checkpoint_saved", "rows": total_rows, "final": False},
            {"kind": "checkpoint_saved", "rows": total_rows // 4, "final": False},
            {"kind": "checkpoint_saved", "rows": total_rows, "final": True},  # after training: not an overhead
            {"kind": "shard_recovered", "rows_reloaded": total_rows // 2},
        ],
        "failures": [
            {"rows_reloaded": total_rows // 2, "lost_steps_recomputed": 0},
            {"rows_reloaded": total_rows, "lost_steps_recomputed": 3},
        ],
        # Shard 1 was respawned at step 60 and counts only its own 40 steps: the rate per
        # step is what matters (0.005 s a step on each shard, 0.02 s over 4 shards).
        "shards": [
            {"applied_step": 99, "first_step_after_load": 0, "tracking_s": 0.5},
            {"applied_step": 99, "first_step_after_load": 60, "tracking_s": 0.2},
            {"applied_step": 99, "first_step_after_load": None, "tracking_s": 0.5},
            {"applied_step": 99, "first_step_after_load": 0, "tracking_s": 0.5},
        ],
        "steps": 100,
        "wall_time_s": {"training_s": 40.0},
    }
    acc = e.account(report)
    step_s = 3600.0
    assert acc["overhead_s"] == {
        "save": pytest.approx(125.0), "load": pytest.approx(300.0), "lost_computation": pytest.approx(3 * step_s),
        "rescheduling": pytest.approx(100.0), "tracking": pytest.approx(0.05 * 100 * 3600, rel=1e-3),
    }  # 0.02 s of tracking in a 0.4 s step: 5% of the 100 h
    total = 125 + 300 + 3 * step_s + 100 + 0.05 * 100 * 3600
    assert acc["overhead_total_pct"] == pytest.approx(100 * total / (100 * 3600), abs=1e-3)


def test_bad_emulation_values_and_emulation_with_faults_are_refused_by_name():
    with pytest.raises(ConfigError, match="emulation.nodes"):
        config_from_dict(_cfg(nodes=0))
    with pytest.raises(ConfigError, match="emulation.save_s"):
        config_from_dict(_cfg(save_s=-1))
    raw = _cfg()
    raw["faults"] = {"max_failures": 2}
    with pytest.raises(ConfigError, match="emulation places its own failures"):
        config_from_dict(raw)
    assert EmulationConfig().node_mtbf_h / EmulationConfig().nodes == pytest.approx(49.5, abs=0.1)


def _report(training_s: float = 40.0) -> dict:
    total_rows = 26 * 1000
    return {
        "events": [
            {"kind": "checkpoint_saved", "rows": total_rows, "final": False},
            {"kind": "checkpoint_saved", "rows": total_rows // 4, "final": False},
        ],
        "failures": [
            {"rows_reloaded": total_rows // 2, "lost_steps_recomputed": 0},
            {"rows_reloaded": total_rows, "lost_steps_recomputed": 3},
        ],
        "shards": [{"applied_step": 99, "first_step_after_load": 0, "tracking_s": 0.5} for _ in range(4)],
        "steps": 100,
        "wall_time_s": {"training_s": training_s},
        "pls": 0.02,
        "auc": 0.75,
    }


def test_account_keeps_what_the_run_measured_apart_from_what_it_charges_at_the_constants():
    from app.emulation import CHARGED, MEASURED, OVERHEADS

    assert sorted(CHARGED + MEASURED) == sorted(OVERHEADS)
    e = _emulation(save_s=100, load_s=200, reschedule_s=50, total_steps=100, duration_h=100)
    acc = e.account(_report())
    m, c = acc["measured"], acc["charged"]
    assert set(m["overhead_pct"]) == set(MEASURED) and set(c["overhead_pct"]) == set(CHARGED)
    assert c["overhead_total_pct"] + sum(m["overhead_pct"].values()) == pytest.approx(acc["overhead_total_pct"], abs=2e-3)
    assert c["constants_s"] == {"save_s": 100, "load_s": 200, "reschedule_s": 50, "step_s": 3600.0}
    assert (m["pls"], m["auc"], m["saves"], m["recoveries"], m["steps_redone"]) == (0.02, 0.75, 2, 2, 3)
    assert m["step_s_real"] == pytest.approx(0.4) and m["rows_saved_share_mean"] == pytest.approx(0.625)
    assert m["tracking_share_of_step_pct"] == pytest.approx(5.0, rel=1e-3)  # 0.02 s of a 0.4 s step
    # A machine twice as slow changes what it measures (the tracking share), never what is charged.
    slow = e.account(_report(training_s=80.0))
    assert slow["charged"] == c
    assert slow["measured"]["overhead_pct"]["tracking"] == pytest.approx(m["overhead_pct"]["tracking"] / 2, rel=1e-3)


class _Progress:
    def __init__(self, step: int):
        self.step = step


class _Supervisor:
    def __init__(self, step: int):
        self._step = step

    def progress(self):
        return _Progress(self._step)

    def events_since(self, cursor: int) -> list:
        return []


@pytest.mark.parametrize("step, kills", [(5, 1), (10, 0)])
def test_failures_stop_when_training_is_over(monkeypatch, step, kills):
    """A failure whose time comes after the last training step is not placed: the emulated
    job is over (killing a shard between the last step and the final save tests nothing)."""
    import threading

    import app.emulation as emulation

    stop = threading.Event()
    done = []

    def fake_kill(supervisor, target, trigger):
        done.append(target)
        stop.set()
        return {"target": target}

    monkeypatch.setattr(emulation, "kill_target", fake_kill)
    e = _emulation(node_mtbf_h=1, nodes=1, duration_h=100, total_steps=10)
    assert e.failure_times_s()[0] < 5 * e.step_s
    timer = threading.Timer(5.0, stop.set)  # a safety net: the loop must end by itself
    timer.start()
    try:
        e.drive(_Supervisor(step), stop, poll_s=0.001)
    finally:
        timer.cancel()
    assert len(done) == kills == len(e.kills)


def _bench():
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    sys.path.insert(0, str(root))
    import benchmarks.cpr_tradeoff_render as bench

    return root, bench


def test_the_benchmark_renders_without_starting_ray():
    """Its module imports and renders in a fresh interpreter that never starts Ray."""
    import subprocess
    import sys

    root, _ = _bench()
    code = ("import json, ray; from benchmarks.cpr_tradeoff_render import render_emulation as r; "
            "r(json.load(open('benchmarks/results/cpr_tradeoff_emulation.json'))); assert not ray.is_initialized()")
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_configs_emulate_yaml_is_what_the_published_emulation_ran():
    """Every setting configs/emulate.yaml makes is the one in the published results file's
    config (the benchmark overrides only seed, recovery, policy and PLS target, per run)."""
    import json

    import yaml

    root, _ = _bench()
    published = json.loads((root / "benchmarks/results/cpr_tradeoff_emulation.json").read_text())
    assert published.get("config_file") == "configs/emulate.yaml", "rerun benchmarks/cpr_tradeoff.py --part emulation"
    raw = yaml.safe_load((root / "configs/emulate.yaml").read_text())
    ran = published["config"]

    def same(want, got, where):
        if isinstance(want, dict):
            for k, v in want.items():
                same(v, got[k], f"{where}.{k}")
        else:
            assert want == got, f"{where}: configs/emulate.yaml says {want!r}, the published run had {got!r}"

    for section, value in raw.items():
        if section in ("seed", "data"):  # per run / written to a temporary dir from data.generate
            continue
        same(value, ran[section], section)
    same(raw["data"]["generate"], ran["data"]["generate"], "data.generate")


def test_the_published_emulation_table_is_rendered_from_its_json():
    import json

    root, bench = _bench()
    res = root / "benchmarks/results/cpr_tradeoff_emulation"
    result = json.loads(res.with_suffix(".json").read_text())
    assert "meta" in result and {"commit", "machine", "date", "command"} <= set(result["meta"])
    assert res.with_suffix(".md").read_text() == f"# {bench.TITLES['emulation']}\n\n" + bench.render_emulation(result)
    rendered = bench.render_emulation(result)
    assert "**Measured**" in rendered and "**Charged at production constants**" in rendered
