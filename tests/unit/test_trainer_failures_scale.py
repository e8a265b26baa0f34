"""The production-scale model of trainer failures (benchmarks/trainer_failures_scale.py): a pure
function of the costs measured here and the production constants."""

import math

import pytest

from benchmarks.trainer_failures_scale import (
    CONSTANTS,
    check_here,
    failure_costs,
    kept_share,
    measured_inputs,
    render,
    scale_model,
    young_daly_interval_s,
)

MEASURED = {"a_cpr": {"stall_s": 1.0, "rejoin_s": 20.0}, "b_ray_train_ddp": {"restart_s": 10.0}}
CONST = {"host_mtbf_h": 1000.0, "reschedule_s": 300.0, "load_s": 600.0, "save_s": 600.0}


def test_kept_share_and_young_daly():
    assert kept_share(0.0, 100.0) == 1.0
    assert kept_share(100.0, 100.0) == pytest.approx(0.5)
    assert young_daly_interval_s(600.0, 3600.0) == pytest.approx(math.sqrt(2 * 600 * 3600))


def test_failure_costs_by_hand():
    c = failure_costs(100, MEASURED, CONST)
    mtbf = 1000.0 * 3600 / 100
    assert c["job_mtbf_s"] == pytest.approx(mtbf)
    interval = math.sqrt(2 * 600 * mtbf)
    assert c["checkpoint_interval_s"] == pytest.approx(interval)
    # cpr: the whole group stalls 1 s, then one host's work (of 100) is missing for 300 + 20 s
    assert c["a_cpr"]["total_s"] == pytest.approx(1.0 + 320.0 / 100)
    # checkpoint-and-restart: everything stops for reschedule + restart + load + half an interval
    assert c["b_ray_train_ddp"]["total_s"] == pytest.approx(300 + 10 + 600 + interval / 2)


def test_scale_model_trends():
    rows = scale_model(MEASURED, CONST, hosts=(64, 512, 2048))
    assert [r["hosts"] for r in rows] == [64, 512, 2048]
    for r in rows:
        assert 0 < r["kept"]["b"] < r["kept"]["a"] <= 1
        assert r["ratio_of_kept"] == pytest.approx(r["kept"]["a"] / r["kept"]["b"])
    # more hosts: more failures per hour, so restarting the whole group keeps less and cpr's edge grows
    assert rows[0]["kept"]["b"] > rows[1]["kept"]["b"] > rows[2]["kept"]["b"]
    assert rows[0]["ratio_of_kept"] < rows[1]["ratio_of_kept"] < rows[2]["ratio_of_kept"]


def test_no_failure_cost_keeps_everything():
    free = {"a_cpr": {"stall_s": 0.0, "rejoin_s": 0.0}, "b_ray_train_ddp": {"restart_s": 0.0}}
    const = {**CONST, "reschedule_s": 0.0, "load_s": 0.0, "save_s": 0.0}
    (row,) = scale_model(free, const, hosts=(512,))
    assert row["kept"] == {"a": 1.0, "b": 1.0}


def test_constants_say_where_they_come_from():
    assert CONSTANTS["host_mtbf_h"][0] == pytest.approx(54 * 24 * 2048 / 419)  # about 6,335 h
    for name, (value, source) in CONSTANTS.items():
        assert value > 0
        assert "arXiv" in source or source.startswith("assumption"), name


def test_render_from_a_results_dict():
    tf = {
        "trainers": 2,
        "meta": {"commit": "abc", "date": "2026-01-01", "command": "python x", "machine": {
            "cpu": "cpu", "cores": 2, "memory_gib": 8.0, "python": "3.11"}},
        "per_event_costs": {
            "a_cpr": {"stall_s": 0.5, "rejoin_s": 6.0, "extra_s_per_kill": 3.0},
            "b_ray_train_ddp": {"restart_s": 5.0, "ready_s": 6.0, "redo_s": 1.0, "extra_s_per_kill": 7.5},
        },
    }
    m = measured_inputs(tf)
    assert m == {"a_cpr": {"stall_s": 0.5, "rejoin_s": 6.0}, "b_ray_train_ddp": {"restart_s": 5.0}}
    chk = check_here(tf)
    assert chk["a_cpr"]["model_s"] == pytest.approx(0.5 + 6.0 / 2)
    assert chk["b_ray_train_ddp"]["model_s"] == pytest.approx(7.0)
    out = {
        "meta": tf["meta"], "measured_from": "benchmarks/results/trainer_failures.json", "measured_meta": tf["meta"],
        "measured": m, "constants": {k: {"value": v, "source": s} for k, (v, s) in CONSTANTS.items()},
        "scenarios": [{"host_mtbf_h": 6335.0, "host_mtbf_from": "Llama 3", "rows": scale_model(m, {
            **{k: v for k, (v, _) in CONSTANTS.items()}})}],
        "model_check_here": chk,
    }
    text = render(out)
    assert text.startswith("`python x` at commit `abc`")
    assert "| 2,048 |" in text
