"""Pure checkpoint/recovery policies of CPR: intervals, recovery mode, row priority, estimates, failure budgets.

Only Python and numpy; every decision is a frozen dataclass with its numbers and a reason.
"""

from policies.budgets import Budget, BudgetCheck, BudgetLimits, FailurePolicy
from policies.estimates import IntervalChange, IntervalController, OnlineCostModel
from policies.interval import (
    expected_pls,
    feasible_interval_s,
    interval_steps,
    pls_interval_s,
    young_daly_interval_s,
)
from policies.priority import (
    FullPolicy,
    MfuPolicy,
    PriorityPolicy,
    SaveSelection,
    SsuPolicy,
    make_policy,
)
from policies.recovery import CostInputs, RecoveryDecision, RecoveryMode, decide_recovery

__all__ = [
    "Budget",
    "BudgetCheck",
    "BudgetLimits",
    "FailurePolicy",
    "young_daly_interval_s",
    "pls_interval_s",
    "expected_pls",
    "feasible_interval_s",
    "interval_steps",
    "RecoveryMode",
    "CostInputs",
    "RecoveryDecision",
    "decide_recovery",
    "PriorityPolicy",
    "SaveSelection",
    "FullPolicy",
    "MfuPolicy",
    "SsuPolicy",
    "make_policy",
    "OnlineCostModel",
    "IntervalController",
    "IntervalChange",
]
