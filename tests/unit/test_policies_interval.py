"""Checkpoint-interval formulas: hand-computed values, limits, step rounding, bad arguments."""

from __future__ import annotations

import math

import pytest

from policies.interval import (
    expected_pls,
    feasible_interval_s,
    interval_steps,
    pls_interval_s,
    young_daly_interval_s,
)

pytestmark = pytest.mark.timeout(60)


def test_young_daly_hand_computed() -> None:
    # sqrt(2 * 2 s * 3600 s) = sqrt(14400) = 120 s
    assert young_daly_interval_s(2.0, 3600.0) == pytest.approx(120.0)


def test_young_daly_scales_with_sqrt_of_both_args() -> None:
    base = young_daly_interval_s(3.0, 1000.0)
    assert young_daly_interval_s(12.0, 1000.0) == pytest.approx(2 * base)
    assert young_daly_interval_s(3.0, 4000.0) == pytest.approx(2 * base)


def test_pls_interval_hand_computed() -> None:
    # 2 * 0.01 * 3600 s * 8 = 576 s
    assert pls_interval_s(0.01, 3600.0, 8) == pytest.approx(576.0)


def test_expected_pls_hand_computed() -> None:
    # 576 s / (2 * 3600 s * 8) = 0.01
    assert expected_pls(576.0, 3600.0, 8) == pytest.approx(0.01)


@pytest.mark.parametrize("target", [1e-5, 1e-3, 0.01, 0.25, 0.9])
@pytest.mark.parametrize("mtbf_s", [1.0, 600.0, 86400.0])
@pytest.mark.parametrize("num_shards", [1, 3, 64])
def test_expected_pls_inverts_pls_interval(target: float, mtbf_s: float, num_shards: int) -> None:
    interval_s = pls_interval_s(target, mtbf_s, num_shards)
    assert expected_pls(interval_s, mtbf_s, num_shards) == pytest.approx(target, rel=1e-12)


def test_mtbf_far_below_save_cost_gives_infeasible_interval_that_clamps() -> None:
    # MTBF 1 s, save 100 s: sqrt(200) ~ 14 s is shorter than one save.
    raw_s = young_daly_interval_s(100.0, 1.0)
    assert raw_s == pytest.approx(math.sqrt(200.0))
    assert raw_s < 100.0
    assert feasible_interval_s(raw_s, 100.0) == 100.0


def test_mtbf_far_above_save_cost_gives_interval_between_save_and_mtbf() -> None:
    save_s, mtbf_s = 1.0, 1e9
    t_s = young_daly_interval_s(save_s, mtbf_s)
    assert save_s < t_s < mtbf_s
    assert t_s / mtbf_s < 1e-4  # checkpoints are rare events relative to failures
    assert feasible_interval_s(t_s, save_s) == t_s


@pytest.mark.parametrize(
    ("interval_s", "step_time_s", "kwargs", "expected"),
    [
        (10.0, 3.0, {}, 3),  # rounds down
        (0.3, 0.1, {}, 3),  # 0.3 / 0.1 = 2.999...96 in floats; still 3
        (12.0, 4.0, {}, 3),
        (0.5, 1.0, {}, 1),  # below one step: clamped up to min_steps
        (0.5, 1.0, {"min_steps": 4}, 4),
        (100.0, 1.0, {"max_steps": 50}, 50),
        (100.0, 1.0, {"min_steps": 2, "max_steps": 2}, 2),
        (7.0, 1.0, {"min_steps": 2, "max_steps": 10}, 7),
    ],
)
def test_interval_steps(interval_s: float, step_time_s: float, kwargs: dict, expected: int) -> None:
    assert interval_steps(interval_s, step_time_s, **kwargs) == expected


@pytest.mark.parametrize(
    ("call", "arg"),
    [
        (lambda: young_daly_interval_s(0.0, 10.0), "save_cost_s"),
        (lambda: young_daly_interval_s(-1.0, 10.0), "save_cost_s"),
        (lambda: young_daly_interval_s(1.0, 0.0), "mtbf_s"),
        (lambda: young_daly_interval_s(1.0, math.inf), "mtbf_s"),
        (lambda: young_daly_interval_s(math.nan, 1.0), "save_cost_s"),
        (lambda: pls_interval_s(0.0, 10.0, 2), "pls_target"),
        (lambda: pls_interval_s(1.0, 10.0, 2), "pls_target"),
        (lambda: pls_interval_s(0.01, -5.0, 2), "mtbf_s"),
        (lambda: pls_interval_s(0.01, 10.0, 0), "num_shards"),
        (lambda: pls_interval_s(0.01, 10.0, 2.5), "num_shards"),
        (lambda: pls_interval_s(0.01, 10.0, True), "num_shards"),
        (lambda: expected_pls(0.0, 10.0, 2), "interval_s"),
        (lambda: expected_pls(5.0, 10.0, -1), "num_shards"),
        (lambda: feasible_interval_s(5.0, 0.0), "save_cost_s"),
        (lambda: interval_steps(0.0, 1.0), "interval_s"),
        (lambda: interval_steps(1.0, 0.0), "step_time_s"),
        (lambda: interval_steps(1.0, 1.0, min_steps=0), "min_steps"),
        (lambda: interval_steps(1.0, 1.0, min_steps=5, max_steps=4), "max_steps"),
        (lambda: young_daly_interval_s("2", 10.0), "save_cost_s"),
    ],
)
def test_invalid_args_raise_config_error_naming_arg(call, arg: str) -> None:
    with pytest.raises(ValueError, match=arg) as info:
        call()
    assert isinstance(info.value, ValueError)
