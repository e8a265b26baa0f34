"""Online MTBF/cost estimates and the interval controller's change reports."""

from __future__ import annotations

import json
import math

import pytest

from policies.estimates import IntervalController, OnlineCostModel
from policies.recovery import RecoveryMode

pytestmark = pytest.mark.timeout(60)


def _model(**over: float) -> OnlineCostModel:
    base = dict(mtbf_s=1000.0, save_cost_s=2.0, load_cost_s=5.0, reschedule_cost_s=10.0)
    base.update(over)
    return OnlineCostModel(**base)  # type: ignore[arg-type]


def test_mtbf_moves_from_prior_towards_observed_gaps() -> None:
    m = _model(alpha=0.2)
    assert m.mtbf_s == 1000.0
    estimates = []
    for i in range(1, 31):
        m.observe_failure(100.0 * i)
        estimates.append(m.mtbf_s)
    assert all(b < a for a, b in zip(estimates, estimates[1:]))  # strictly falling
    assert estimates[0] < 1000.0
    assert estimates[-1] == pytest.approx(100.0, rel=0.05)
    assert m.failures_observed == 30


def test_small_alpha_is_the_pooled_estimate() -> None:
    m = _model(alpha=1e-12, prior_weight=2.0)
    for i in range(1, 11):
        m.observe_failure(100.0 * i)
    # (2 * 1000 s prior + 1000 s observed) / (2 prior + 10 failures)
    assert m.mtbf_s == pytest.approx(3000.0 / 12.0)


def test_quiet_time_raises_mtbf() -> None:
    m = _model()
    m.observe_failure(100.0)
    before = m.mtbf_s
    m.observe_time(5000.0)
    assert m.mtbf_s > before


def test_costs_are_emas() -> None:
    m = _model(alpha=0.5)
    m.observe_save(4.0)
    assert m.save_cost_s == pytest.approx(3.0)
    m.observe_load(15.0)
    assert m.load_cost_s == pytest.approx(10.0)
    m.observe_reschedule(0.0)
    assert m.reschedule_cost_s == pytest.approx(5.0)
    c = m.inputs(4, 0.01)
    assert (c.save_cost_s, c.load_cost_s, c.reschedule_cost_s, c.num_shards) == (3.0, 10.0, 5.0, 4)


@pytest.mark.parametrize(
    ("call", "arg"),
    [
        (lambda: _model(mtbf_s=0.0), "mtbf_s"),
        (lambda: _model(alpha=0.0), "alpha"),
        (lambda: _model(alpha=1.5), "alpha"),
        (lambda: _model(prior_weight=-1.0), "prior_weight"),
        (lambda: _model().observe_save(0.0), "duration_s"),
        (lambda: _model().observe_load(-1.0), "duration_s"),
        (lambda: _model(start_s=50.0).observe_failure(10.0), "t_s"),
        (lambda: IntervalController("never", _model(), 2, 0.01), "mode"),
        (lambda: IntervalController("auto", _model(), 2, 0.01, rel_threshold=0.0), "rel_threshold"),
        (lambda: IntervalController("auto", _model(), 0, 0.01), "num_shards"),
    ],
)
def test_invalid_args(call, arg: str) -> None:
    with pytest.raises(ValueError, match=rf"\b{arg}\b"):
        call()


def test_controller_reports_changes_past_threshold_only() -> None:
    m = _model(mtbf_s=3600.0, alpha=0.5)
    ctl = IntervalController(RecoveryMode.FULL, m, num_shards=8, pls_target=0.01, rel_threshold=0.2)
    d0, ch0 = ctl.update()
    assert ch0 is not None and ch0.old_interval_s is None and ch0.new_interval_s == pytest.approx(120.0)
    assert ctl.update()[1] is None  # nothing observed

    # save 2 -> 2.2 s: T* grows by sqrt(1.1) - 1 = 4.9%, below 20%.
    m.observe_save(2.4)
    d1, ch1 = ctl.update()
    assert ch1 is None and d1.interval_s == pytest.approx(120.0 * 1.1**0.5)

    # Failures every 60 s pull MTBF far below 3600 s: T* shrinks past the threshold.
    for i in range(1, 6):
        m.observe_failure(60.0 * i)
    d2, ch2 = ctl.update()
    assert ch2 is not None
    assert ch2.old_interval_s == pytest.approx(120.0)  # last *reported*, not last computed
    assert ch2.new_interval_s == d2.interval_s < 120.0 * 0.8
    assert ch2.relative_change > 0.2 and ch2.threshold == 0.2
    assert ch2.old_mode is ch2.new_mode is RecoveryMode.FULL
    assert f"{ch2.inputs.mtbf_s:.4g} s" in ch2.reason and "threshold 20%" in ch2.reason
    assert ctl.reported is d2
    assert ctl.update()[1] is None


def test_controller_reports_mode_flip_even_below_threshold() -> None:
    m = _model(mtbf_s=3600.0, alpha=1.0)
    ctl = IntervalController("auto", m, num_shards=8, pls_target=0.01, rel_threshold=1e9)
    d0, _ = ctl.update()
    assert d0.mode is RecoveryMode.PARTIAL  # 576 s PLS interval, see recovery tests
    m.observe_save(2000.0)  # a save now outlasts the 576 s PLS interval
    d1, ch = ctl.update()
    assert d1.mode is RecoveryMode.FULL
    assert ch is not None and ch.old_mode is RecoveryMode.PARTIAL and ch.new_mode is RecoveryMode.FULL


def _observed(alpha: float = 0.3) -> OnlineCostModel:
    m = _model(alpha=alpha, start_s=100.0)
    for t in (150.0, 400.0, 420.0):
        m.observe_failure(t)
    m.observe_save(3.0)
    m.observe_load(7.5)
    m.observe_reschedule(12.0)
    m.observe_time(900.0)  # a quiet stretch after the last failure: open exposure
    return m


def _same(a: OnlineCostModel, b: OnlineCostModel) -> None:
    # Exact equality: a restored model is the same model, not an approximation of it.
    assert a.state() == b.state()
    assert (a.mtbf_s, a.save_cost_s, a.load_cost_s, a.reschedule_cost_s, a.clock_s) == (
        b.mtbf_s, b.save_cost_s, b.load_cost_s, b.reschedule_cost_s, b.clock_s)
    assert a.inputs(8, 0.01) == b.inputs(8, 0.01)


def test_a_restored_model_continues_identically() -> None:
    a = _observed()
    state = a.state()
    assert all(isinstance(v, (int, float)) and math.isfinite(v) for v in state.values())
    # Built from other config numbers (same alpha), as a restarted supervisor builds it.
    b = OnlineCostModel(
        mtbf_s=50.0, save_cost_s=1.0, load_cost_s=1.0, reschedule_cost_s=1.0, alpha=0.3, start_s=5000.0
    )
    b.restore(json.loads(json.dumps(state)))  # as the journal stores it
    _same(a, b)
    assert b.failures_observed == 3 and b.saves_observed == b.loads_observed == b.reschedules_observed == 1
    for m in (a, b):
        m.observe_time(1000.0)
        m.observe_failure(1200.0)
        m.observe_save(2.5)
        m.observe_load(4.0)
        m.observe_reschedule(9.0)
        m.observe_time(1500.0)
    _same(a, b)
    with pytest.raises(ValueError, match=r"\bnow_s\b"):  # the restored clock is the monotonic floor
        b.observe_time(1400.0)


_MISSING = object()


def _bad(key: str, value) -> dict:
    state = _observed().state()
    if value is _MISSING:
        del state[key]
    else:
        state[key] = value
    return state


@pytest.mark.parametrize(
    ("key", "value", "match"),
    [
        ("exposure_s", _MISSING, r"missing \['exposure_s'\]"),
        ("failures_observed", _MISSING, r"missing \['failures_observed'\]"),
        ("mtbf_s", 1.0, r"unknown \['mtbf_s'\]"),  # derived, not a state entry
        ("save_cost_s", math.nan, r"^save_cost_s must be a finite number > 0, got nan"),
        ("load_cost_s", math.inf, r"^load_cost_s must be a finite number >= 0, got inf"),
        ("clock_s", -math.inf, r"^clock_s must be a finite number, got -inf"),
        ("failure_weight", 0.0, r"^failure_weight must be a finite number > 0, got 0.0"),
        ("reschedule_cost_s", -1.0, r"^reschedule_cost_s must be a finite number >= 0, got -1.0"),
        ("saves_observed", -1, r"^saves_observed must be an integer >= 0, got -1"),
        ("loads_observed", 2.0, r"^loads_observed must be an integer >= 0, got 2.0"),
        ("reschedules_observed", True, r"^reschedules_observed must be an integer >= 0, got True"),
        ("last_failure_s", 1e9, r"^last_failure_s must be <= clock_s=900.0, got 1000000000.0"),
    ],
)
def test_restore_refuses_a_bad_state_and_keeps_its_own(key: str, value, match: str) -> None:
    m = _model()
    before = m.state()
    with pytest.raises(ValueError, match=match):
        m.restore(_bad(key, value))
    assert m.state() == before
