"""Failure budgets: one message format for every budget, the boundary, no limit, bad limits."""

from __future__ import annotations

import pytest

from policies import Budget, BudgetCheck, BudgetLimits, FailurePolicy

pytestmark = pytest.mark.timeout(60)

DEFAULTS = {
    Budget.SHARD_RECOVERIES: 100,
    Budget.STEP_REDOS: 20,
    Budget.SUPERVISOR_RESTARTS: 20,
    Budget.EXECUTOR_ERRORS: 5,
    Budget.TRAINER_FAILURES: 20,
    Budget.FAILED_SAVES: 20,
}


def test_every_budget_names_a_limit_field() -> None:
    assert {b.value for b in Budget} == set(BudgetLimits.__dataclass_fields__)
    policy = FailurePolicy(BudgetLimits())
    assert {b: policy.limit(b) for b in Budget} == DEFAULTS


@pytest.mark.parametrize("budget", list(Budget), ids=lambda b: b.value)
def test_message_format_and_boundary(budget: Budget) -> None:
    policy = FailurePolicy(BudgetLimits(**{budget.value: 3}))
    assert policy.exceeded(budget, 3) is None  # the limit itself is still allowed
    assert not policy.check(budget, 3).exceeded
    assert policy.check(budget, 4).exceeded
    assert policy.exceeded(budget, 4) == f"budgets.{budget.value}: 4 (max 3)"
    assert policy.exceeded(budget, 4, "shard 2 died") == f"budgets.{budget.value}: 4 (max 3): shard 2 died"
    assert policy.check(budget, 1).message("x") == f"budgets.{budget.value}: 1 (max 3): x"


def test_the_exact_message_of_the_default_step_redos() -> None:
    policy = FailurePolicy(BudgetLimits())
    assert policy.exceeded(Budget.STEP_REDOS, 20) is None
    assert policy.exceeded(Budget.STEP_REDOS, 21) == "budgets.max_step_redos: 21 (max 20)"


@pytest.mark.parametrize("budget", list(Budget), ids=lambda b: b.value)
def test_no_limit_never_exceeds(budget: Budget) -> None:
    policy = FailurePolicy(BudgetLimits(**{budget.value: -1}))
    for count in (0, 1, 10**9):
        assert policy.exceeded(budget, count) is None
    assert policy.check(budget, 7).message() == f"budgets.{budget.value}: 7 (no limit)"
    assert policy.check(budget, 7).message("d") == f"budgets.{budget.value}: 7 (no limit): d"


def test_a_zero_limit_allows_no_failure() -> None:
    policy = FailurePolicy(BudgetLimits(max_executor_errors=0))
    assert policy.exceeded(Budget.EXECUTOR_ERRORS, 0) is None
    assert policy.exceeded(Budget.EXECUTOR_ERRORS, 1) == "budgets.max_executor_errors: 1 (max 0)"


def test_a_budget_may_be_named_by_its_value() -> None:
    policy = FailurePolicy(BudgetLimits(max_step_redos=2))
    assert policy.exceeded("max_step_redos", 3) == "budgets.max_step_redos: 3 (max 2)"  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^budget must be one of max_shard_recoveries, .*got 'max_redos'"):
        policy.limit("max_redos")  # type: ignore[arg-type]


@pytest.mark.parametrize("field", sorted(BudgetLimits.__dataclass_fields__))
@pytest.mark.parametrize("value", [-2, -100, True, False, 3.0, 2.5, "3", None])
def test_bad_limits_name_the_field(field: str, value) -> None:
    with pytest.raises(ValueError, match=rf"^{field} must be an integer >= -1 \(-1: no limit\), got {value!r}"):
        BudgetLimits(**{field: value})


@pytest.mark.parametrize(
    ("count", "limit", "match"),
    [(-1, 3, r"^count must be an integer >= 0, got -1"), (True, 3, r"^count must be an integer >= 0, got True"),
     (1, -2, r"^limit must be an integer >= -1 \(-1: no limit\), got -2")],
)
def test_a_check_refuses_a_bad_count_or_limit(count, limit, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        BudgetCheck(Budget.STEP_REDOS, count, limit)


def test_limits_are_frozen() -> None:
    limits = BudgetLimits()
    with pytest.raises(AttributeError):
        limits.max_step_redos = 3  # type: ignore[misc]
