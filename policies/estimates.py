"""Online estimates of MTBF and save/load/reschedule costs, and the interval controller they drive.

Estimates start from config values and move with observations; the controller re-decides recovery.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from policies._checks import (
    check_finite,
    check_int,
    check_non_negative,
    check_open_unit,
    check_positive,
    check_unit_half_open,
)
from policies.recovery import CostInputs, RecoveryDecision, RecoveryMode, decide_recovery

__all__ = ["OnlineCostModel", "IntervalChange", "IntervalController"]

_COUNT_KEYS = ("failures_observed", "saves_observed", "loads_observed", "reschedules_observed")
_STATE_KEYS = ("save_cost_s", "load_cost_s", "reschedule_cost_s", "exposure_s", "failure_weight",
               "last_failure_s", "clock_s") + _COUNT_KEYS


class OnlineCostModel:
    """MTBF and cost estimates seeded from config and updated from observations.

    Costs (save, load, reschedule) are exponential moving averages with weight
    ``alpha`` on each new observation, starting at the config value.

    MTBF is an exponentially discounted exposure/failures ratio: the config MTBF
    counts as ``prior_weight`` pseudo-failures over ``prior_weight * mtbf_s`` of
    pseudo-exposure; each observed failure adds its gap since the previous one
    (or since ``start_s``) to the exposure and 1 to the count, after both are
    multiplied by (1 - alpha). With alpha -> 0 this is the pooled estimate
    (total observed time + prior) / (failures + prior weight); alpha > 0 lets it
    follow a failure rate that drifts, with a memory of about 1/alpha failures.
    An EMA of gaps alone would ignore a long failure-free stretch; here the time
    since the last failure (up to the latest ``observe_time``/failure) is added
    to the exposure, so quiet periods raise the estimate.
    """

    def __init__(
        self,
        mtbf_s: float,
        save_cost_s: float,
        load_cost_s: float,
        reschedule_cost_s: float,
        alpha: float = 0.2,
        prior_weight: float = 1.0,
        start_s: float = 0.0,
    ) -> None:
        mtbf_s = check_positive("mtbf_s", mtbf_s)
        self._save_cost_s = check_positive("save_cost_s", save_cost_s)
        self._load_cost_s = check_non_negative("load_cost_s", load_cost_s)
        self._reschedule_cost_s = check_non_negative("reschedule_cost_s", reschedule_cost_s)
        self.alpha = check_unit_half_open("alpha", alpha)
        self.prior_weight = check_positive("prior_weight", prior_weight)
        start_s = check_finite("start_s", start_s)
        self._exposure_s = self.prior_weight * mtbf_s
        self._failure_weight = self.prior_weight
        self._last_failure_s = start_s
        self._clock_s = start_s
        self.failures_observed = 0
        self.saves_observed = 0
        self.loads_observed = 0
        self.reschedules_observed = 0

    def _advance(self, name: str, t_s: float) -> float:
        t_s = check_finite(name, t_s)
        if t_s < self._clock_s:
            raise ValueError(
                f"{name} must be >= the latest observed time {self._clock_s:.6g} s "
                f"(timestamps are monotonic), got {t_s:.6g}"
            )
        self._clock_s = t_s
        return t_s

    def observe_time(self, now_s: float) -> None:
        """Advances the clock without a failure, so a quiet stretch counts as exposure."""
        self._advance("now_s", now_s)

    def observe_failure(self, t_s: float) -> None:
        """Records a failure at time ``t_s`` (same clock as ``start_s``; monotonic)."""
        t_s = self._advance("t_s", t_s)
        keep = 1.0 - self.alpha
        self._exposure_s = keep * self._exposure_s + (t_s - self._last_failure_s)
        self._failure_weight = keep * self._failure_weight + 1.0
        self._last_failure_s = t_s
        self.failures_observed += 1

    def _ema(self, old: float, new: float) -> float:
        return (1.0 - self.alpha) * old + self.alpha * new

    def observe_save(self, duration_s: float) -> None:
        # A save measured at 0 s is a timing bug; it would also make the
        # Young/Daly interval 0 (save continuously).
        self._save_cost_s = self._ema(self._save_cost_s, check_positive("duration_s", duration_s))
        self.saves_observed += 1

    def observe_load(self, duration_s: float) -> None:
        self._load_cost_s = self._ema(self._load_cost_s, check_non_negative("duration_s", duration_s))
        self.loads_observed += 1

    def observe_reschedule(self, duration_s: float) -> None:
        self._reschedule_cost_s = self._ema(
            self._reschedule_cost_s, check_non_negative("duration_s", duration_s)
        )
        self.reschedules_observed += 1

    @property
    def clock_s(self) -> float:
        """The latest time observed; later observations must not be earlier."""
        return self._clock_s

    @property
    def mtbf_s(self) -> float:
        open_gap_s = self._clock_s - self._last_failure_s
        return (self._exposure_s + open_gap_s) / self._failure_weight

    @property
    def save_cost_s(self) -> float:
        return self._save_cost_s

    @property
    def load_cost_s(self) -> float:
        return self._load_cost_s

    @property
    def reschedule_cost_s(self) -> float:
        return self._reschedule_cost_s

    def state(self) -> dict[str, float | int]:
        """Every number the model has learned, to continue from (a restarted supervisor
        journals it). ``alpha`` and ``prior_weight`` are not in it: they are configuration,
        which the restoring model takes from its own construction."""
        return {
            "save_cost_s": self._save_cost_s,
            "load_cost_s": self._load_cost_s,
            "reschedule_cost_s": self._reschedule_cost_s,
            "exposure_s": self._exposure_s,
            "failure_weight": self._failure_weight,
            "last_failure_s": self._last_failure_s,
            "clock_s": self._clock_s,
            "failures_observed": self.failures_observed,
            "saves_observed": self.saves_observed,
            "loads_observed": self.loads_observed,
            "reschedules_observed": self.reschedules_observed,
        }

    def restore(self, state: dict) -> None:
        """Continues from another model's ``state()``. Every entry is checked before any is
        taken, so a bad state (missing, unknown, non-finite or out-of-range entry) raises
        ``ValueError`` and leaves this model as it was."""
        missing = [k for k in _STATE_KEYS if k not in state]
        unknown = [k for k in state if k not in _STATE_KEYS]
        if missing or unknown:
            raise ValueError(f"state must have exactly the keys {', '.join(_STATE_KEYS)}; "
                             f"missing {missing}, unknown {unknown}")
        clock_s = check_finite("clock_s", state["clock_s"])
        last_failure_s = check_finite("last_failure_s", state["last_failure_s"])
        if last_failure_s > clock_s:
            raise ValueError(f"last_failure_s must be <= clock_s={clock_s!r}, got {last_failure_s!r}")
        new = {
            "_save_cost_s": check_positive("save_cost_s", state["save_cost_s"]),
            "_load_cost_s": check_non_negative("load_cost_s", state["load_cost_s"]),
            "_reschedule_cost_s": check_non_negative("reschedule_cost_s", state["reschedule_cost_s"]),
            "_exposure_s": check_non_negative("exposure_s", state["exposure_s"]),
            "_failure_weight": check_positive("failure_weight", state["failure_weight"]),
            "_last_failure_s": last_failure_s,
            "_clock_s": clock_s,
        }
        for key in _COUNT_KEYS:
            new[key] = check_int(key, state[key], 0)
        for name, value in new.items():
            setattr(self, name, value)

    def inputs(self, num_shards: int, pls_target: float) -> CostInputs:
        """The current estimates as ``CostInputs`` for ``decide_recovery``."""
        return CostInputs(
            mtbf_s=self.mtbf_s,
            save_cost_s=self._save_cost_s,
            load_cost_s=self._load_cost_s,
            reschedule_cost_s=self._reschedule_cost_s,
            num_shards=num_shards,
            pls_target=pls_target,
        )


@dataclass(frozen=True)
class IntervalChange:
    """A change of checkpoint interval or recovery mode worth logging and applying."""

    old_interval_s: float | None
    """None on the controller's first decision."""
    new_interval_s: float
    relative_change: float
    """|new - old| / old; inf on the first decision."""
    threshold: float
    old_mode: RecoveryMode | None
    new_mode: RecoveryMode
    inputs: CostInputs
    """The estimates that produced the new interval."""
    reason: str


class IntervalController:
    """Re-decides recovery mode and interval from an ``OnlineCostModel``.

    ``update`` always returns the fresh decision, plus an ``IntervalChange`` when
    the interval moved by more than ``rel_threshold`` (relative), or the mode
    flipped, since the last reported change (the first call always reports).
    Comparing against the last *reported* interval, not the previous call's,
    means a slow drift is reported once it adds up, while noise below the
    threshold never re-arms the caller's checkpoint timer.
    """

    def __init__(
        self,
        mode: RecoveryMode | str,
        model: OnlineCostModel,
        num_shards: int,
        pls_target: float,
        rel_threshold: float = 0.2,
    ) -> None:
        try:
            self.mode = RecoveryMode(mode)
        except ValueError:
            allowed = ", ".join(m.value for m in RecoveryMode)
            raise ValueError(f"mode must be one of {allowed}, got {mode!r}") from None
        self.model = model
        self.num_shards = check_int("num_shards", num_shards, 1)
        self.pls_target = check_open_unit("pls_target", pls_target)
        self.rel_threshold = check_positive("rel_threshold", rel_threshold)
        self._reported: RecoveryDecision | None = None

    @property
    def reported(self) -> RecoveryDecision | None:
        """The decision of the last reported change (the interval in effect)."""
        return self._reported

    def update(self) -> tuple[RecoveryDecision, IntervalChange | None]:
        decision = decide_recovery(self.mode, self.model.inputs(self.num_shards, self.pls_target))
        old = self._reported
        if old is None:
            rel = math.inf
            why = f"initial: {decision.mode.value} every {decision.interval_s:.4g} s"
        else:
            rel = abs(decision.interval_s - old.interval_s) / old.interval_s
            if decision.mode is old.mode and rel <= self.rel_threshold:
                return decision, None
            why = (
                f"{old.mode.value} every {old.interval_s:.4g} s -> {decision.mode.value} every "
                f"{decision.interval_s:.4g} s ({100.0 * rel:.3g}% change, threshold "
                f"{100.0 * self.rel_threshold:.3g}%)"
            )
        c = decision.inputs
        change = IntervalChange(
            old_interval_s=None if old is None else old.interval_s,
            new_interval_s=decision.interval_s,
            relative_change=rel,
            threshold=self.rel_threshold,
            old_mode=None if old is None else old.mode,
            new_mode=decision.mode,
            inputs=c,
            reason=(
                f"{why}; estimates: MTBF {c.mtbf_s:.4g} s, save {c.save_cost_s:.4g} s, "
                f"load {c.load_cost_s:.4g} s, reschedule {c.reschedule_cost_s:.4g} s; {decision.reason}"
            ),
        )
        self._reported = decision
        return decision, change

