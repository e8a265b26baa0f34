"""Full vs partial (CPR) recovery: which mode and which checkpoint interval, and why.

``decide_recovery`` turns cost inputs into a ``RecoveryDecision`` carrying the numbers it used.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from policies._checks import check_int, check_non_negative, check_open_unit, check_positive
from policies.interval import (
    expected_pls,
    feasible_interval_s,
    pls_interval_s,
    young_daly_interval_s,
)

__all__ = ["RecoveryMode", "CostInputs", "RecoveryDecision", "decide_recovery"]

# expected_pls(pls_interval_s(x)) can come back as x * (1 + 1 ulp); without this
# slack an unclamped partial interval would "miss" its own target by rounding.
_PLS_RELATIVE_SLACK = 1e-9


class RecoveryMode(str, Enum):
    """How a dead embedding shard is recovered."""

    FULL = "full"
    """Every actor reloads the last checkpoint; no update is lost, work since it is redone."""
    PARTIAL = "partial"
    """Only the dead shard reloads; its updates since its checkpoint are lost (PLS)."""
    AUTO = "auto"
    """Partial where it is cheaper and keeps the PLS target, else full."""
    REPLICA = "replica"
    """The dead shard's mirror takes its place: nothing lost, nothing redone; mirrors cost
    memory (the rows and their optimizer state once more) and time on every step. Without
    its mirror (both died), partial."""


@dataclass(frozen=True)
class CostInputs:
    """What a recovery decision depends on; all times in seconds of wall clock.

    Overheads are expressed per second of wall time, so no training horizon is needed.
    """

    mtbf_s: float
    """Mean time between failures of the whole job (T_fail)."""
    save_cost_s: float
    """Training stall of one checkpoint save (o_save); must be > 0."""
    load_cost_s: float
    """Stall of one checkpoint load (o_load)."""
    reschedule_cost_s: float
    """Stall of respawning a dead actor (o_res)."""
    num_shards: int
    """Embedding shards N the model is split over."""
    pls_target: float
    """Largest acceptable expected portion of lost samples, in (0, 1)."""
    replica_step_frac: float | None = None
    """Expected fraction of training time spent keeping every shard's mirror in sync (the
    primary's wait for its mirror on each step); None: mirrors are not possible here (their
    memory does not fit the cluster), so replica recovery is not a choice."""
    promote_cost_s: float = 0.5
    """Stall of one replica recovery: the dead shard's mirror promoted (detection included)."""

    def __post_init__(self) -> None:
        check_positive("mtbf_s", self.mtbf_s)
        check_positive("save_cost_s", self.save_cost_s)
        check_non_negative("load_cost_s", self.load_cost_s)
        check_non_negative("reschedule_cost_s", self.reschedule_cost_s)
        check_int("num_shards", self.num_shards, 1)
        check_open_unit("pls_target", self.pls_target)
        if self.replica_step_frac is not None:
            check_non_negative("replica_step_frac", self.replica_step_frac)
        check_non_negative("promote_cost_s", self.promote_cost_s)


@dataclass(frozen=True)
class RecoveryDecision:
    """The recovery mode and interval chosen, with both modes' expected costs."""

    requested: RecoveryMode
    mode: RecoveryMode
    """FULL, PARTIAL or REPLICA, never AUTO."""
    interval_s: float
    """Checkpoint interval of ``mode``: ``interval_full_s`` (full, replica) or ``interval_partial_s``."""
    interval_full_s: float
    """Young/Daly interval, clamped to >= one save."""
    interval_partial_s: float
    """PLS-target interval, clamped to >= one save."""
    expected_overhead_frac_full: float
    """Expected stalled fraction of wall time under full recovery (first order)."""
    expected_overhead_frac_partial: float
    """Expected stalled fraction of wall time under partial recovery (first order)."""
    expected_pls: float
    """Expected PLS of ``mode``: 0 for full, ``expected_pls_partial`` for partial."""
    expected_pls_partial: float
    """Expected PLS of partial recovery at ``interval_partial_s``."""
    pls_target_met: bool
    """Whether partial recovery at ``interval_partial_s`` keeps the PLS target."""
    reason: str
    inputs: CostInputs
    expected_overhead_frac_replica: float | None = None
    """Expected stalled fraction of wall time under replica recovery (None: not possible)."""


def _overhead_frac_full(interval_s: float, c: CostInputs) -> float:
    # Saves every interval; per failure: load + respawn + on average half an
    # interval of work redone since the checkpoint.
    return c.save_cost_s / interval_s + (c.load_cost_s + c.reschedule_cost_s + interval_s / 2.0) / c.mtbf_s


def _overhead_frac_partial(interval_s: float, c: CostInputs) -> float:
    # The lost half interval is not redone (it is paid in PLS instead), so a
    # failure costs only the dead shard's load and respawn.
    return c.save_cost_s / interval_s + (c.load_cost_s + c.reschedule_cost_s) / c.mtbf_s


def _overhead_frac_replica(interval_s: float, c: CostInputs) -> float | None:
    # Mirrors are kept in sync on every step; a failure costs a promotion. Checkpoints stay, at
    # Young/Daly's interval: only a shard that dies with its mirror falls back to them.
    if c.replica_step_frac is None:
        return None
    return c.replica_step_frac + c.save_cost_s / interval_s + c.promote_cost_s / c.mtbf_s


def _pct(frac: float) -> str:
    return f"{100.0 * frac:.3g}%"


@dataclass(frozen=True)
class _Options:
    """Both modes' intervals and expected overheads, and partial's expected PLS, before a mode is chosen."""

    t_full_s: float
    t_part_raw_s: float
    """The PLS-target interval before the clamp to one save."""
    t_part_s: float
    pls_part: float
    pls_ok: bool
    ovh_full: float
    ovh_part: float
    ovh_replica: float | None


def _options(c: CostInputs) -> _Options:
    t_part_raw_s = pls_interval_s(c.pls_target, c.mtbf_s, c.num_shards)
    t_part_s = feasible_interval_s(t_part_raw_s, c.save_cost_s)
    t_full_s = feasible_interval_s(young_daly_interval_s(c.save_cost_s, c.mtbf_s), c.save_cost_s)
    pls_part = expected_pls(t_part_s, c.mtbf_s, c.num_shards)
    return _Options(
        t_full_s=t_full_s,
        t_part_raw_s=t_part_raw_s,
        t_part_s=t_part_s,
        pls_part=pls_part,
        pls_ok=pls_part <= c.pls_target * (1.0 + _PLS_RELATIVE_SLACK),
        ovh_full=_overhead_frac_full(t_full_s, c),
        ovh_part=_overhead_frac_partial(t_part_s, c),
        ovh_replica=_overhead_frac_replica(t_full_s, c),
    )


def _reason(requested: RecoveryMode, mode: RecoveryMode, c: CostInputs, o: _Options) -> str:
    """Why ``mode`` was chosen, then (in parentheses) every number the choice used."""
    numbers = (
        f"full: interval {o.t_full_s:.4g} s, overhead {_pct(o.ovh_full)}; "
        f"partial: interval {o.t_part_s:.4g} s, overhead {_pct(o.ovh_part)}, "
        f"expected PLS {o.pls_part:.4g} vs target {c.pls_target:.4g}; "
        f"MTBF {c.mtbf_s:.4g} s, save {c.save_cost_s:.4g} s, load {c.load_cost_s:.4g} s, "
        f"reschedule {c.reschedule_cost_s:.4g} s, {c.num_shards} shards"
    )
    if o.ovh_replica is not None:
        numbers += f"; replica: overhead {_pct(o.ovh_replica)} (mirrors {_pct(c.replica_step_frac)} of each step)"
    else:
        numbers += "; replica: not a choice (no mirrors: not configured, or they do not fit)"
    if requested is RecoveryMode.AUTO:
        if mode is RecoveryMode.REPLICA:
            why = (f"auto -> replica: overhead {_pct(o.ovh_replica)} <= full {_pct(o.ovh_full)} and "
                   f"<= partial {_pct(o.ovh_part)}, and nothing lost")
        elif mode is RecoveryMode.PARTIAL:
            why = (
                f"auto -> partial: overhead {_pct(o.ovh_part)} < full {_pct(o.ovh_full)} and "
                f"expected PLS {o.pls_part:.4g} <= target {c.pls_target:.4g}"
            )
        elif not o.pls_ok:
            why = (
                f"auto -> full: partial cannot keep PLS target {c.pls_target:.4g} "
                f"(its interval would be {o.t_part_raw_s:.4g} s, below one save of "
                f"{c.save_cost_s:.4g} s; at {o.t_part_s:.4g} s expected PLS is {o.pls_part:.4g})"
            )
        else:
            why = f"auto -> full: overhead {_pct(o.ovh_full)} <= partial {_pct(o.ovh_part)}"
    else:
        why = f"{requested.value} requested"
        if mode is RecoveryMode.PARTIAL and not o.pls_ok:
            why += (
                f"; WARNING: expected PLS {o.pls_part:.4g} exceeds target {c.pls_target:.4g} "
                f"because the PLS interval {o.t_part_raw_s:.4g} s is shorter than one save"
            )
    chosen_ovh = {RecoveryMode.PARTIAL: o.ovh_part, RecoveryMode.REPLICA: o.ovh_replica}.get(mode, o.ovh_full)
    if chosen_ovh is not None and chosen_ovh >= 1.0:
        why += (
            f"; WARNING: expected overhead {_pct(chosen_ovh)} >= 100%: failures are about as "
            "frequent as checkpoints, the first-order model does not hold"
        )
    return f"{why} ({numbers})"


def decide_recovery(requested: RecoveryMode | str, inputs: CostInputs) -> RecoveryDecision:
    """Chooses full or partial recovery and its checkpoint interval.

    FULL and PARTIAL requests are honoured with that mode's interval (Young/Daly
    for full, the PLS-target interval for partial); AUTO picks PARTIAL only where
    its expected overhead is strictly lower and its expected PLS <= target, else
    FULL (ties go to full: same cost, no lost samples). Where neither interval
    is clamped, the load and respawn terms cancel and full's overhead at T* is
    2*o_save/T*, so partial is cheaper exactly when T_pls > T*/2.

    Both intervals are clamped to >= ``save_cost_s``: below that the job would
    save back to back and never train. A PLS interval shorter than one save
    therefore cannot keep the target; the clamped interval's expected PLS is
    reported (above target), AUTO rejects partial, and a PARTIAL request is
    honoured with a reason saying the target is missed. Overheads are the
    first-order model; a value >= 100% means failures come about as often as
    checkpoints, where the model (and steady progress) breaks down, and the
    reason says so.
    """
    try:
        requested = RecoveryMode(requested)
    except ValueError:
        allowed = ", ".join(m.value for m in RecoveryMode)
        raise ValueError(f"requested must be one of {allowed}, got {requested!r}") from None
    c = inputs
    o = _options(c)
    if requested is RecoveryMode.AUTO:
        mode = _cheapest(o)
    else:
        mode = requested
    partial = mode is RecoveryMode.PARTIAL
    return RecoveryDecision(
        requested=requested,
        mode=mode,
        interval_s=o.t_part_s if partial else o.t_full_s,
        interval_full_s=o.t_full_s,
        interval_partial_s=o.t_part_s,
        expected_overhead_frac_full=o.ovh_full,
        expected_overhead_frac_partial=o.ovh_part,
        expected_pls=o.pls_part if mode is RecoveryMode.PARTIAL else 0.0,
        expected_pls_partial=o.pls_part,
        pls_target_met=o.pls_ok,
        reason=_reason(requested, mode, c, o),
        inputs=c,
        expected_overhead_frac_replica=o.ovh_replica,
    )


def _cheapest(o: _Options) -> RecoveryMode:
    """The mode of least expected overhead; ties go to the one that loses nothing (full, then
    replica): partial only where strictly cheaper, and only where it keeps the PLS target."""
    options = [(o.ovh_full, 0, RecoveryMode.FULL)]
    if o.ovh_replica is not None:
        options.append((o.ovh_replica, 1, RecoveryMode.REPLICA))
    if o.pls_ok:
        options.append((o.ovh_part, 2, RecoveryMode.PARTIAL))
    return min(options)[2]
