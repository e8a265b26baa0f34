"""What the recovery controller is given: its collaborators (``Supervisor`` builds the real
ones from the other parts; a unit test passes fakes), and which errors of a recovery attempt
it retries."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

from actors.supervisor.facts import Survey
from actors.supervisor.hooks import RunHooks
from actors.supervisor.ledger import FailureLedger
from core.errors import CprError
from policies import FailurePolicy, RecoveryDecision

__all__ = ["Collaborators", "RETRIED_ERRORS"]

# Failures of a recovery attempt that are retried (up to budgets.max_executor_errors): a Ray
# call that failed or timed out, storage, a checkpoint refused. Anything else is a bug: the
# executor thread crashes and the run ends as Failed, naming it.
RETRIED_ERRORS: tuple[type[BaseException], ...] = (OSError, TimeoutError, CprError)


@dataclass(frozen=True)
class Collaborators:
    """What the controller is given (``Supervisor`` builds the real ones; tests pass fakes)."""

    executor: object  # run(state, committed handles) -> Outcome
    fleet: object  # watch(k, generation, handle), find(k, gen), spawn(k, gen, taken), ready(handles), kill(handle)
    ledger: FailureLedger
    spares: object  # candidate(avoid), take(names), wake()
    prune_commits: Callable[[int, int], None]  # (step, the generation the trainers start again in)
    observe: object  # SharedCosts: observe_failure, observe_reschedule, observe_load
    decide: Callable[[], RecoveryDecision]
    host_down_since: Callable[[str | None], float | None]
    suspects: Callable[[], set]
    partial_chain: Callable[[], tuple[int, ...]]
    consistent_chain: Callable[[], tuple[int, ...]]
    policy: FailurePolicy
    hooks: RunHooks
    start_thread: Callable[..., threading.Thread]
    retried: tuple[type[BaseException], ...] = RETRIED_ERRORS
    refuse: Callable[[tuple], None] = lambda fallbacks: None  # checkpoints a shard found corrupt: chains skip them
    full_upto: Callable[[int], tuple[int, ...]] = lambda step: ()  # the newest valid full checkpoint <= step, alone
    mirrors: object = None  # candidate(k, avoid), take(names), ready(), drop(shards, promoted), kill_dropped(dropped)
    # One round of questions to the live processes (actors.supervisor.survey): skip those shards.
    survey: Callable[[set], Survey] = lambda skip: Survey({}, {}, {})
    committed_steps: Callable[[], int] = lambda: 0  # steps the trainers' commit reports say are committed
    protect: Callable[[str, tuple], None] = lambda owner, steps: None  # keep steps from retention for owner
    release: Callable[[str], None] = lambda owner: None

    def __post_init__(self):
        if self.mirrors is None:
            object.__setattr__(self, "mirrors", _NoMirrors())


class _NoMirrors:
    """Runs without mirrors (every recovery mode but replica, and unit tests)."""

    def candidate(self, k: int, avoid: set) -> None:
        return None

    def take(self, names) -> None:
        pass

    def ready(self) -> dict[int, str]:
        return {}

    def drop(self, shards, promoted) -> list:
        return []

    def kill_dropped(self, dropped) -> None:
        pass
