"""The run's books as typed records: injected kills, shard deaths and the failure records of
their recoveries, trainer failures, committed steps, and the summary the supervisor hands the
driver for the report. The supervisor journals them; the report is built from them."""

from __future__ import annotations

from dataclasses import dataclass, field

from core.records import EvalResult, Progress, ShardInfo, ShardState
from policies import CostInputs, RecoveryDecision

__all__ = [
    "StartInfo", "KillRecord", "DeathCause", "FailureRecord", "TrainerFailure", "StateView", "StepCommit",
    "CommitTally", "RecoveryModes", "SaveFailures", "CheckpointPolicyView", "RunSummary",
]


@dataclass(frozen=True)
class StartInfo:
    shards: tuple[ShardInfo, ...]
    startup_s: float
    total_steps: int


@dataclass(frozen=True)
class KillRecord:
    """A kill about to happen, recorded by whoever sends the signal."""

    target: str
    time: float
    pid: int | None = None
    trigger: str = "chaos"


@dataclass(frozen=True)
class DeathCause:
    """What the supervisor knew of a shard's death when it decided its recovery."""

    actor: str
    shard: int
    generation: int
    cause: str
    detected_at: float
    killed_at: float | None
    detection_s: float | None
    first_step: int | None  # the first step the dead actor applied
    exited: bool = False  # Ray saw its process exit: it cannot act any more (actors.lease)


@dataclass(frozen=True)
class FailureRecord:
    """One recovered shard death, as the report shows it. ``failed_at_step`` (from which step
    trainers redid work on the replacement) and ``lost_samples`` are filled in later."""

    actor: str
    shard: int
    generation: int
    cause: str
    detected_at: float
    killed_at: float | None
    detection_s: float | None
    first_step: int | None
    recovery: str  # partial, full or replica (a mirror took the shard's place: nothing lost)
    decision: RecoveryDecision | None
    generation_after: int
    spare: str | None
    adoption_s: float
    reschedule_s: float
    load_s: float
    recovery_s: float
    serving_s: float | None
    restored_step: int
    chain: tuple[int, ...]
    rows_reloaded: int
    bytes_reloaded: int
    failed_at_step: int | None = None
    lost_samples: float | None = None
    lost_steps_recomputed: int | None = None
    lost_samples_error: str | None = None
    # The rows the dead generation held, (table, row_start, row_end) per slice: its plan's, which a
    # resume on another plan changes before a failure of the attempt before it is counted.
    slices: tuple[tuple[int, int, int], ...] | None = None


@dataclass(frozen=True)
class TrainerFailure:
    """One killed trainer: detection, steps with fewer trainers, the replacement's heal."""

    actor: str
    cause: str | None
    killed_at: float
    detection_s: float | None
    steps_with_fewer_trainers: int
    heal_s: float | None
    rejoined_s: float | None
    replacement_joined_at_step: int | None


@dataclass(frozen=True)
class StateView:
    """The supervisor's state as the report shows it: its name, and why it ended."""

    state: str
    reason: str | None = None  # Failed
    how: str | None = None  # Finished: completed or interrupted


@dataclass(frozen=True)
class StepCommit:
    """A committed dense step: the microbatch ids its trainers held, the total the all-reduce
    summed (M on every step: ReCoVer's invariant) and how many trainers took part."""

    microbatches: tuple[int, ...]
    total: int
    participants: int
    time: float


@dataclass(frozen=True)
class CommitTally:
    """What the report reads of the committed steps, over the run's final timeline (a later
    attempt's commit of a step replaces an earlier's): the steps committed (the last one + 1),
    the distinct microbatch totals their all-reduces summed (M alone: ReCoVer's invariant
    held) and the steps committed by fewer trainers than the group. Every step's commit
    reports are in the run's ``trainer_book.jsonl``."""

    steps: int = 0
    microbatches_per_step: tuple[int, ...] = ()
    steps_with_fewer_trainers: int = 0


@dataclass(frozen=True)
class RecoveryModes:
    requested: str
    used: tuple[str, ...]
    decisions: tuple[RecoveryDecision | None, ...]


@dataclass(frozen=True)
class SaveFailures:
    """Checkpoint saves that failed over the run (every attempt), and the most of them in a row
    (what ``budgets.max_failed_saves`` limits: a commit starts the count again)."""

    failed: int = 0
    longest_in_a_row: int = 0


@dataclass(frozen=True)
class CheckpointPolicyView:
    policy: str
    interval_steps: int | None
    interval_s: float | None
    estimates: CostInputs


@dataclass(frozen=True)
class RunSummary:
    """Everything the report needs, from the supervisor's books (every attempt of the run)."""

    run_id: str
    state: StateView
    events: tuple[dict, ...]
    progress: tuple[Progress, ...]
    failures: tuple[FailureRecord, ...]
    eval: EvalResult | None
    shards: tuple[ShardState, ...]
    shards_error: str | None
    total_steps: int
    resumed_from_step: int | None
    last_checkpoint_step: int
    final_checkpoint_step: int | None
    recovery_mode: RecoveryModes
    checkpoint_policy: CheckpointPolicyView
    faults_injected: tuple[KillRecord, ...]
    supervisor_restarts: int
    attempts: int
    trainer_failures: tuple[TrainerFailure, ...]
    committed: CommitTally = field(default_factory=CommitTally)
    save_failures: SaveFailures = field(default_factory=SaveFailures)
