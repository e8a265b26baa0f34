"""Checkpoint-interval formulas of CPR (Maeng et al., MLSys 2021) and Young/Daly.

Pure first-order formulas in seconds, plus the seconds -> training-steps conversion.
"""

from __future__ import annotations

import math

from policies._checks import check_int, check_open_unit, check_positive

__all__ = [
    "young_daly_interval_s",
    "pls_interval_s",
    "expected_pls",
    "feasible_interval_s",
    "interval_steps",
]

# interval/step_time is often a hair under an integer in binary floating point
# (0.3 / 0.1 == 2.9999999999999996); this slack keeps such exact multiples from
# flooring one step short, and is far below any step-time measurement noise.
_STEP_ROUNDING_SLACK = 1e-9


def young_daly_interval_s(save_cost_s: float, mtbf_s: float) -> float:
    """Full-recovery checkpoint interval T* = sqrt(2 * o_save * T_fail) (Young, 1974).

    It minimises the first-order overhead per second ``o_save/T + T/(2*T_fail)``
    (save cost plus, per failure, half an interval of recomputed work). The
    approximation holds for ``o_save << T_fail``; as ``mtbf_s`` falls towards
    ``save_cost_s`` the result can drop below ``save_cost_s`` (saving back to back),
    which is returned as is here: use ``feasible_interval_s`` before scheduling.
    """
    save_cost_s = check_positive("save_cost_s", save_cost_s)
    mtbf_s = check_positive("mtbf_s", mtbf_s)
    return math.sqrt(2.0 * save_cost_s * mtbf_s)


def pls_interval_s(pls_target: float, mtbf_s: float, num_shards: int) -> float:
    """Partial-recovery interval: the largest T whose expected PLS is <= ``pls_target``.

    Inverse of ``expected_pls``: T = 2 * PLS_target * T_fail * N. Like
    ``young_daly_interval_s`` it may come out shorter than a save takes; the
    caller clamps with ``feasible_interval_s`` and re-evaluates ``expected_pls``.
    """
    pls_target = check_open_unit("pls_target", pls_target)
    mtbf_s = check_positive("mtbf_s", mtbf_s)
    num_shards = check_int("num_shards", num_shards, 1)
    return 2.0 * pls_target * mtbf_s * num_shards


def expected_pls(interval_s: float, mtbf_s: float, num_shards: int) -> float:
    """Expected portion of lost samples under partial recovery: T / (2 * T_fail * N).

    A failure (rate 1/T_fail, ``mtbf_s`` being the whole job's MTBF) hits one of N
    equally sized shards and loses on average T/2 seconds of that shard's updates,
    worth 1/N of the model. It is first order: it treats saves as instantaneous
    stalls and assumes every failure hits a shard, so it errs on the high
    (conservative) side when trainers fail too or failures cluster in an interval.
    """
    interval_s = check_positive("interval_s", interval_s)
    mtbf_s = check_positive("mtbf_s", mtbf_s)
    num_shards = check_int("num_shards", num_shards, 1)
    return interval_s / (2.0 * mtbf_s * num_shards)


def feasible_interval_s(interval_s: float, save_cost_s: float) -> float:
    """Clamps an interval to >= one save: a save cannot start before the last ended."""
    interval_s = check_positive("interval_s", interval_s)
    save_cost_s = check_positive("save_cost_s", save_cost_s)
    return max(interval_s, save_cost_s)


def interval_steps(
    interval_s: float,
    step_time_s: float,
    min_steps: int = 1,
    max_steps: int | None = None,
) -> int:
    """Converts an interval to whole training steps from the measured step time.

    Rounds down (checkpointing a little early keeps the PLS bound) and clamps to
    [min_steps, max_steps].
    """
    interval_s = check_positive("interval_s", interval_s)
    step_time_s = check_positive("step_time_s", step_time_s)
    min_steps = check_int("min_steps", min_steps, 1)
    if max_steps is not None:
        max_steps = check_int("max_steps", max_steps, min_steps)
    steps = math.floor(interval_s / step_time_s + _STEP_ROUNDING_SLACK)
    steps = max(steps, min_steps)
    if max_steps is not None:
        steps = min(steps, max_steps)
    return steps

