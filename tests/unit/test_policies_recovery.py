"""Recovery-mode decisions: a hand-computed point, a property sweep, and the clamped edge case."""

from __future__ import annotations

import itertools
import math

import pytest

from policies.recovery import CostInputs, RecoveryDecision, RecoveryMode, decide_recovery

pytestmark = pytest.mark.timeout(60)

REL = 1e-9


def _inputs(**over: float) -> CostInputs:
    base = dict(
        mtbf_s=3600.0,
        save_cost_s=2.0,
        load_cost_s=5.0,
        reschedule_cost_s=10.0,
        num_shards=8,
        pls_target=0.01,
    )
    base.update(over)
    return CostInputs(**base)  # type: ignore[arg-type]


def test_hand_computed_point() -> None:
    d = decide_recovery(RecoveryMode.AUTO, _inputs())
    # Young/Daly: sqrt(2*2*3600) = 120 s; PLS interval: 2*0.01*3600*8 = 576 s.
    assert d.interval_full_s == pytest.approx(120.0)
    assert d.interval_partial_s == pytest.approx(576.0)
    # full: 2/120 + (5 + 10 + 60)/3600 = 0.0166667 + 0.0208333 = 0.0375
    assert d.expected_overhead_frac_full == pytest.approx(0.0375)
    # partial: 2/576 + (5 + 10)/3600 = 0.0034722 + 0.0041667 = 0.0076389
    assert d.expected_overhead_frac_partial == pytest.approx(2 / 576 + 15 / 3600)
    assert d.mode is RecoveryMode.PARTIAL
    assert d.interval_s == pytest.approx(576.0)
    assert d.expected_pls == pytest.approx(0.01)
    assert d.pls_target_met
    for number in ("576", "120", "3.75%", "0.764%", "0.01", "3600"):
        assert number in d.reason, (number, d.reason)
    assert d.reason.startswith("auto -> partial")


def _expected_overheads(c: CostInputs) -> tuple[float, float, float, float]:
    t_full = max(math.sqrt(2 * c.save_cost_s * c.mtbf_s), c.save_cost_s)
    t_part = max(2 * c.pls_target * c.mtbf_s * c.num_shards, c.save_cost_s)
    fixed = (c.load_cost_s + c.reschedule_cost_s) / c.mtbf_s
    ovh_full = c.save_cost_s / t_full + fixed + t_full / (2 * c.mtbf_s)
    ovh_part = c.save_cost_s / t_part + fixed
    return t_full, t_part, ovh_full, ovh_part


GRID = list(
    itertools.product(
        [10.0, 100.0, 600.0, 3600.0, 86400.0],  # mtbf_s
        [0.1, 1.0, 10.0, 60.0],  # save_cost_s
        [0.0, 5.0, 60.0],  # load_cost_s
        [0.0, 30.0],  # reschedule_cost_s
        [1, 2, 8, 64],  # num_shards
        [1e-4, 1e-3, 0.01, 0.1],  # pls_target
    )
)


def _sweep() -> list[tuple[CostInputs, dict[RecoveryMode, RecoveryDecision]]]:
    out = []
    for mtbf, save, load, res, n, target in GRID:
        c = CostInputs(mtbf, save, load, res, n, target)
        out.append((c, {m: decide_recovery(m, c) for m in RecoveryMode}))
    return out


SWEEP = _sweep()


def test_sweep_covers_both_outcomes_and_the_clamped_case() -> None:
    modes = {ds[RecoveryMode.AUTO].mode for _, ds in SWEEP}
    assert modes == {RecoveryMode.FULL, RecoveryMode.PARTIAL}
    assert any(not ds[RecoveryMode.AUTO].pls_target_met for _, ds in SWEEP)
    assert any(
        ds[RecoveryMode.AUTO].pls_target_met and ds[RecoveryMode.AUTO].mode is RecoveryMode.FULL
        for _, ds in SWEEP
    )


def test_auto_never_picks_partial_above_pls_target() -> None:
    for c, ds in SWEEP:
        d = ds[RecoveryMode.AUTO]
        assert d.mode in (RecoveryMode.FULL, RecoveryMode.PARTIAL)
        if d.mode is RecoveryMode.PARTIAL:
            assert d.expected_pls <= c.pls_target * (1 + REL), d.reason
        if d.expected_pls_partial > c.pls_target * (1 + REL):
            assert d.mode is RecoveryMode.FULL, d.reason
            assert "cannot keep PLS target" in d.reason


def test_auto_picks_the_cheaper_mode_where_pls_holds() -> None:
    for _, ds in SWEEP:
        d = ds[RecoveryMode.AUTO]
        if not d.pls_target_met:
            continue
        cheaper = (
            RecoveryMode.PARTIAL
            if d.expected_overhead_frac_partial < d.expected_overhead_frac_full
            else RecoveryMode.FULL
        )
        assert d.mode is cheaper, d.reason


def test_unclamped_partial_is_cheaper_exactly_when_pls_interval_exceeds_half_young_daly() -> None:
    # o_save/T_p < o_save/T* + T*/(2 T_fail) = 2 o_save/T*  <=>  T_p > T*/2
    for c, ds in SWEEP:
        d = ds[RecoveryMode.AUTO]
        t_star = math.sqrt(2 * c.save_cost_s * c.mtbf_s)
        t_pls = 2 * c.pls_target * c.mtbf_s * c.num_shards
        if min(t_star, t_pls) < c.save_cost_s or math.isclose(t_pls, t_star / 2, rel_tol=1e-6):
            continue
        assert (d.mode is RecoveryMode.PARTIAL) == (t_pls > t_star / 2), d.reason


def test_requested_modes_are_honoured_and_numbers_still_computed() -> None:
    for c, ds in SWEEP:
        auto, full, part = ds[RecoveryMode.AUTO], ds[RecoveryMode.FULL], ds[RecoveryMode.PARTIAL]
        assert full.mode is RecoveryMode.FULL and full.requested is RecoveryMode.FULL
        assert full.interval_s == full.interval_full_s
        assert full.expected_pls == 0.0
        assert part.mode is RecoveryMode.PARTIAL and part.requested is RecoveryMode.PARTIAL
        assert part.interval_s == part.interval_partial_s
        assert part.expected_pls == part.expected_pls_partial
        for d in (full, part):
            assert d.expected_overhead_frac_full == auto.expected_overhead_frac_full
            assert d.expected_overhead_frac_partial == auto.expected_overhead_frac_partial
            assert d.expected_pls_partial == auto.expected_pls_partial
            assert d.reason.startswith(f"{d.requested.value} requested")
            assert d.inputs is c


def test_overheads_and_intervals_match_formulas_over_sweep() -> None:
    for c, ds in SWEEP:
        d = ds[RecoveryMode.AUTO]
        t_full, t_part, ovh_full, ovh_part = _expected_overheads(c)
        assert d.interval_full_s == pytest.approx(t_full)
        assert d.interval_partial_s == pytest.approx(t_part)
        assert d.expected_overhead_frac_full == pytest.approx(ovh_full)
        assert d.expected_overhead_frac_partial == pytest.approx(ovh_part)
        assert d.interval_s >= c.save_cost_s
        assert d.expected_pls_partial == pytest.approx(t_part / (2 * c.mtbf_s * c.num_shards))


def test_reason_mentions_the_numbers() -> None:
    for c, ds in SWEEP[::37]:
        for d in ds.values():
            assert f"{c.pls_target:.4g}" in d.reason
            assert f"{d.interval_s:.4g} s" in d.reason
            assert f"{c.mtbf_s:.4g} s" in d.reason
            assert f"{c.num_shards} shards" in d.reason


def test_pls_interval_shorter_than_a_save_cannot_hold_target() -> None:
    # PLS interval 2 * 0.01 * 100 * 1 = 2 s, but one save takes 60 s.
    c = _inputs(mtbf_s=100.0, save_cost_s=60.0, load_cost_s=0.0, reschedule_cost_s=0.0, num_shards=1)
    auto = decide_recovery("auto", c)
    assert auto.interval_partial_s == 60.0  # clamped to one save
    assert auto.expected_pls_partial == pytest.approx(60.0 / 200.0)
    assert not auto.pls_target_met
    assert auto.mode is RecoveryMode.FULL
    assert "cannot keep PLS target" in auto.reason and "below one save" in auto.reason
    part = decide_recovery(RecoveryMode.PARTIAL, c)
    assert part.mode is RecoveryMode.PARTIAL and part.interval_s == 60.0
    assert "WARNING: expected PLS 0.3 exceeds target 0.01" in part.reason


def test_overhead_above_one_is_flagged() -> None:
    d = decide_recovery(RecoveryMode.FULL, _inputs(mtbf_s=1.0, save_cost_s=10.0))
    assert d.interval_s == 10.0  # sqrt(20) < 10 s: clamped to one save
    assert d.expected_overhead_frac_full >= 1.0
    assert "first-order model does not hold" in d.reason


def test_tie_goes_to_full() -> None:
    # T* = sqrt(2 * 1 * 800) = 40 s; T_pls = 2 * 0.0125 * 800 * 1 = 20 s = T*/2: equal overheads.
    c = _inputs(mtbf_s=800.0, save_cost_s=1.0, num_shards=1, pls_target=0.0125)
    d = decide_recovery(RecoveryMode.AUTO, c)
    assert d.expected_overhead_frac_full == pytest.approx(d.expected_overhead_frac_partial)
    assert d.mode is RecoveryMode.FULL


def test_mode_parses_from_string() -> None:
    assert RecoveryMode("auto") is RecoveryMode.AUTO
    assert decide_recovery("full", _inputs()).mode is RecoveryMode.FULL


@pytest.mark.parametrize(
    ("over", "arg"),
    [
        ({"mtbf_s": 0.0}, "mtbf_s"),
        ({"save_cost_s": 0.0}, "save_cost_s"),
        ({"load_cost_s": -1.0}, "load_cost_s"),
        ({"reschedule_cost_s": math.nan}, "reschedule_cost_s"),
        ({"num_shards": 0}, "num_shards"),
        ({"pls_target": 1.0}, "pls_target"),
        ({"pls_target": 0.0}, "pls_target"),
    ],
)
def test_invalid_cost_inputs(over: dict, arg: str) -> None:
    with pytest.raises(ValueError, match=arg):
        _inputs(**over)


def test_invalid_requested_mode() -> None:
    with pytest.raises(ValueError, match="requested must be one of full, partial, auto"):
        decide_recovery("sometimes", _inputs())


def test_auto_picks_replica_where_keeping_mirrors_costs_less_and_never_where_they_do_not_fit() -> None:
    """Replica: the mirrors' share of every step, partial's saves (its fallback) and a
    promotion per failure; nothing lost. Not a choice without mirrors (None)."""
    c = _inputs(mtbf_s=600.0, pls_target=0.001, replica_step_frac=0.01)
    d = decide_recovery(RecoveryMode.AUTO, c)
    expected = 0.01 + c.save_cost_s / d.interval_full_s + c.promote_cost_s / c.mtbf_s
    assert math.isclose(d.expected_overhead_frac_replica, expected, rel_tol=REL)
    assert d.mode is RecoveryMode.REPLICA and d.expected_pls == 0.0
    assert d.expected_overhead_frac_replica < min(d.expected_overhead_frac_full, d.expected_overhead_frac_partial)
    assert "auto -> replica" in d.reason and "mirrors 1% of each step" in d.reason
    # Mirrors that cost more than the others: not chosen; mirrors that do not fit: never.
    assert decide_recovery(RecoveryMode.AUTO, _inputs(mtbf_s=600.0, replica_step_frac=0.5)).mode is not RecoveryMode.REPLICA
    none = decide_recovery(RecoveryMode.AUTO, _inputs(mtbf_s=600.0, pls_target=0.001))
    assert none.mode is not RecoveryMode.REPLICA and none.expected_overhead_frac_replica is None
    assert "replica: not a choice" in none.reason
    # Requested, it is honoured; its checkpoints (the fallback of a shard lost with its mirror)
    # are at Young/Daly's interval.
    r = decide_recovery(RecoveryMode.REPLICA, c)
    assert r.mode is RecoveryMode.REPLICA and r.interval_s == r.interval_full_s and r.expected_pls == 0.0
