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
        "mirror_feed": 0.0, "promotion": 0.0,
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



def test_replica_saves_at_young_daly_and_its_model_counts_the_configs_mirror_share():
    raw = _cfg("replica", save_s=600)
    raw["checkpoint"]["replica_step_frac"] = 0.2
    e, full = Emulation.of(config_from_dict(raw), 200), _emulation("full", save_s=600)
    d = e.decision
    assert d.mode.value == "replica" and e.replica and not full.replica
    assert d.interval_s == pytest.approx(full.decision.interval_s) and e.every_steps == full.every_steps
    assert d.expected_pls == 0.0 and d.inputs.replica_step_frac == 0.2
    assert d.expected_overhead_frac_replica == pytest.approx(0.2 + 600 / d.interval_s + d.inputs.promote_cost_s / e.mtbf_s)
    assert _emulation("partial").decision.inputs.replica_step_frac is None  # replica is weighed only where asked for
    assert e.configure(config_from_dict(raw)).recovery == "replica"
    acc = e.account(_report())
    assert acc["expected_overhead_pct"] == pytest.approx(100 * d.expected_overhead_frac_replica, abs=1e-3)


def _replica_report(training_s: float = 40.0) -> dict:
    total_rows = 26 * 1000
    promoted = {"recovery": "replica", "rows_reloaded": 0, "lost_steps_recomputed": 0, "lost_samples": 0.0}
    return {
        "events": [{"kind": "checkpoint_saved", "rows": total_rows, "final": False}],
        # The last: a death with the mirror not in sync, recovered from the checkpoint (a partial recovery).
        "failures": [{**promoted, "serving_s": 2.0}, {**promoted, "serving_s": 3.0},
                     {"recovery": "partial", "rows_reloaded": total_rows // 4, "lost_steps_recomputed": 0, "serving_s": 9.0}],
        # 0.004 s a fed step on each shard process, whatever it fed: shard 1's process is a mirror
        # promoted late (it fed 20 steps as a primary), shard 3's fed none yet (no mirror: left out).
        "shards": [{"applied_step": 99, "first_step_after_load": first, "tracking_s": 0.0, "mirror_steps": n,
                    "mirror_send_s": sent} for first, n, sent in ((0, 100, 0.4), (80, 20, 0.08), (0, 100, 0.4), (95, 0, 0.0))],
        "steps": 100, "wall_time_s": {"training_s": training_s}, "pls": 0.001, "auc": 0.75,
        "mirrors": {"built": 6, "lost": 0, "promoted": 2},
    }


def test_a_replica_run_pays_its_mirrors_feed_and_promotions_as_measured_and_a_fallback_as_partial():
    e = _emulation("replica", save_s=100, load_s=200, reschedule_s=50, duration_h=100, total_steps=100)
    acc = e.account(_replica_report())
    assert acc["overhead_s"] == {
        "save": pytest.approx(100.0),
        "load": pytest.approx(50.0), "rescheduling": pytest.approx(50.0),  # the fallback alone, as a partial recovery
        "lost_computation": 0.0, "tracking": 0.0,
        # 0.004 s a step on each of 4 shards in a 0.4 s step: 4% of the 100 h
        "mirror_feed": pytest.approx(0.04 * 100 * 3600, rel=1e-3),
        "promotion": pytest.approx(5.0),  # measured kill to serving, nothing loaded, no host waited for
    }
    m, c = acc["measured"], acc["charged"]
    assert m["mirror_feed_share_of_step_pct"] == pytest.approx(4.0, rel=1e-3)
    assert (m["promotions"], m["fallbacks"], m["promotion_s"]) == (2, 1, [2.0, 3.0])
    assert m["mirrors"] == {"built": 6, "lost": 0, "promoted": 2}
    assert set(m["overhead_pct"]) == {"tracking", "mirror_feed", "promotion"}
    assert c["overhead_total_pct"] + sum(m["overhead_pct"].values()) == pytest.approx(acc["overhead_total_pct"], abs=2e-3)
    # A machine twice as slow halves the feed's share; the charged part does not move.
    slow = e.account(_replica_report(training_s=80.0))
    assert slow["charged"] == c and slow["measured"]["mirror_feed_share_of_step_pct"] == pytest.approx(2.0, rel=1e-3)
    # The emulated clock: a promotion costs its measured serving time, a fallback load and rescheduling.
    assert e._event_cost_s({"kind": "shard_recovered", "recovery": "replica", "serving_s": 2.5, "rows_reloaded": 0}) == 2.5
    assert e._event_cost_s({"kind": "shard_recovered", "recovery": "partial", "rows_reloaded": 26_000 // 4}) == \
        pytest.approx(50.0 + 50.0)


class _ReplicaSupervisor(_Supervisor):
    """Step 5 of 10 forever; a kill is recovered at once, and the shard's new mirror is ready 30 polls later."""

    def __init__(self):
        super().__init__(5)
        self.events, self.pending = [], []

    def progress(self):
        for item in list(self.pending):
            item[1] -= 1
            if item[1] <= 0:
                self.pending.remove(item)
                self.events.append({"kind": "mirror_ready", "shard": item[0]})
        return _Progress(5)

    def events_since(self, cursor: int) -> list:
        return self.events[cursor:]

    def unmirrored(self) -> set:
        last = {e["shard"]: e["kind"] for e in self.events}  # each shard's latest: recovered, or its mirror ready
        return {k for k, kind in last.items() if kind == "shard_recovered"}


@pytest.mark.parametrize("recovery", ["replica", "partial"])
def test_replica_mode_kills_no_shard_until_its_last_victims_mirror_is_back(monkeypatch, recovery):
    import threading

    import app.emulation as emulation

    sup, stop, seen = _ReplicaSupervisor(), threading.Event(), []

    def fake_kill(supervisor, target, trigger):
        seen.append(sup.unmirrored())
        shard = int(target.split(":")[1])
        sup.events.append({"kind": "shard_recovered", "shard": shard, "recovery": recovery, "serving_s": 0.1,
                           "rows_reloaded": 0})
        sup.pending.append([shard, 30])
        if len(seen) == 3:
            stop.set()
        return {"target": target}

    monkeypatch.setattr(emulation, "kill_target", fake_kill)
    e = _emulation(recovery, node_mtbf_h=1, nodes=1, duration_h=100, max_failures=10, total_steps=10)
    timer = threading.Timer(10.0, stop.set)  # a safety net
    timer.start()
    try:
        e.drive(sup, stop, poll_s=0.001)
    finally:
        timer.cancel()
    assert len(e.kills) == 3
    if recovery == "replica":
        assert seen == [set(), set(), set()]  # never a kill while a shard has no mirror in sync
        assert all(k["waited_for_mirror_s"] > 0 for k in e.kills[1:])
    else:
        assert any(seen[1:]) and all("waited_for_mirror_s" not in k for k in e.kills)  # nothing waited for


def test_the_benchmark_merges_rows_of_a_later_commit_and_says_which():
    import json
    root, bench = _bench()
    import benchmarks.cpr_tradeoff as tradeoff  # after _bench(), which puts the repository on the path

    published = json.loads((root / "benchmarks/results/cpr_tradeoff_emulation.json").read_text())
    base = [r for r in published["rows"] if (r["recovery"], r["policy"]) != ("replica", "full")]
    published = {**published, "rows": base, "appended": []}
    template = next(r for r in base if r["recovery"] == "full")
    new = [{**template, "seed": s, "recovery": "replica", "mirror_feed_share_of_step_pct": 3.0, "promotions": 2,
            "fallbacks": 0, "promotion_s_mean": 1.5} for s in (2, 0)]
    entry = {"rows": ["replica"], "seeds": [0, 2], "commit": "abc1234+dirty", "date": "D", "command": "x", "clean_auc_same": True}
    merged = tradeoff.merge_rows(published, new, entry)
    again = tradeoff.merge_rows(merged, new, entry)  # rerunning the same rows replaces them (and their run)
    assert again == merged and merged["meta"] == published["meta"] and merged["appended"] == [entry]
    assert tradeoff.merge_rows(merged, new, {**entry, "commit": "def5678"})["appended"][0]["commit"] == "def5678"
    assert len(merged["rows"]) == len(base) + 2
    replica = [r for r in merged["rows"] if r["recovery"] == "replica"]
    assert [r["seed"] for r in replica] == [0, 2] and {r["commit"] for r in replica} == {"abc1234+dirty"}
    assert merged["rows"][len([r for r in base if r["seed"] == 0])]["recovery"] == "replica"  # after seed 0's others
    text = bench.render_emulation(merged)
    assert all(t in text for t in ("replica (mirrors), Young/Daly interval", "`abc1234+dirty`", "Rows added later", "seeds [0, 2]"))
    assert "Rows added later" not in bench.render_emulation(published)
