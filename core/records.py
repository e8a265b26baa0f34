"""The typed messages our processes exchange through Ray calls, and the records the supervisor
journals. Every one is a frozen dataclass: a field that is misspelt or missing fails where it
is made, not three processes later.

Shard -> supervisor / trainer: ``ShardInfo``, ``Snapshot``, ``WrittenPart``, ``LoadResult``,
``ShardState``, ``PushResult``. Trainer -> supervisor: ``TrainerStart``, ``CommitRecord``,
``StepFailure``, ``Progress``, ``SaveRequest``, ``EvalResult``. Supervisor -> trainer:
``TrainerSetup``, ``RunStatus``, ``FleetView`` (with its ``Rollback``), ``FinalView``,
``SaveResult``. Supervisor -> driver and chaos: ``Target``. The run's books (failures, kills,
the summary for the report) are in ``core.books``.

The event log (``events.jsonl``) is the exception: its records are JSON lines of many kinds,
written for people and reports, and cross to the driver as such.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from core.checkpoint import FileEntry
from core.plan import ShardingPlan
from core.schedule import StepSchedule

__all__ = [
    "ShardInfo", "ShardFacts", "Target", "Snapshot", "WrittenPart", "CheckpointFallback", "LoadResult", "ShardState",
    "PushResult", "StartMarks", "TrainerStart", "TrainerFacts", "CommitRecord", "StepFailure", "Heal", "PhaseTimes", "Progress", "SaveRequest",
    "SaveResult",
    "EvalResult", "ResumePoint", "TrainerSetup", "RunStatus", "Rollback", "FleetView", "FinalView",
]


# --------------------------------------------------------------------------- shards


@dataclass(frozen=True)
class ShardInfo:
    """Who answers as a shard (or a warm spare): its process, node and size."""

    shard_id: int | None  # None: a warm spare not adopted yet
    spare: str | None  # the spare's name, when the process started as one
    generation: int
    pid: int
    node_id: str
    node_ip: str
    rows: int
    device: str
    adopt_s: float | None = None  # how long ``adopt`` took, when this answers it
    link: str | None = None  # its socket for trainers on its node (actors.shard_link)
    tables_ready_bytes: int = 0  # a warm spare's tables allocated ahead (embeddings.spare_tables)
    mirror_of: int | None = None  # the shard this process mirrors (recovery: replica), until promoted
    applied_steps: int = 0  # the steps in its rows (a promoted mirror's tell how far it was)


@dataclass(frozen=True)
class ShardFacts:
    """What a shard or mirror process confirms about itself when a recovery asks (one round,
    ``actors.supervisor.survey``): the facts a recovery decides from, not the books.

    ``first_step``: the first step this process applied since it was created or last loaded a
    checkpoint (None: none yet, or a promoted mirror, whose rows hold its primary's steps too);
    ``held_steps``: a mirror's steps, applied or held complete (for a serving shard, its
    applied steps); ``in_sync``: a mirror that has its base and never missed a step."""

    shard_id: int | None
    generation: int
    pid: int
    applied_steps: int
    first_step: int | None
    complete_step: int | None = None
    mirror_of: int | None = None
    held_steps: int = 0
    in_sync: bool = False


@dataclass(frozen=True)
class Target:
    """A process of the run that chaos may kill: its pid (None while being replaced) and node."""

    pid: int | None
    node_id: str | None
    node_ip: str | None = None


@dataclass(frozen=True)
class Snapshot:
    """Phase one of a save in a shard: the rows copied at the step boundary."""

    rows: int
    bytes: int
    full: bool
    reason: str
    tracked_rows: int  # rows MFU/SSU tracked as candidates before this save
    snapshot_s: float


@dataclass(frozen=True)
class WrittenPart:
    """A shard's file of a save, written and synced: the manifest's entry for it."""

    entry: FileEntry
    write_s: float


@dataclass(frozen=True)
class CheckpointFallback:
    """A checkpoint refused while loading (``reason``), and so passed over for an older one;
    ``removed``: not corrupt, its manifest was gone (retention or a fence) when it was read."""

    step: int
    reason: str
    removed: bool = False


@dataclass(frozen=True)
class LoadResult:
    """What a shard loaded: the chain it used (it may fall back past a corrupt file of its own,
    and a partial recovery may use a newer chain than the one it was given) and, per
    incremental, the shard rows it held (for lost-sample accounting)."""

    rows: int
    bytes: int
    chain: tuple[int, ...]
    incremental_rows: tuple[tuple[int, np.ndarray], ...] = ()
    fallbacks: tuple[CheckpointFallback, ...] = ()
    duration_s: float = 0.0
    initial_rows_reason: str | None = None  # why an empty chain: the initial rows are the state to be at


@dataclass(frozen=True)
class ShardState:
    """A shard's counters, for the report."""

    shard_id: int | None
    applied_step: int
    compute_s: float
    rows_updated_total: int
    steps_dropped: int
    first_step_after_load: int | None
    tracking_s: float  # MFU/SSU tracking on the lookup's path (handing the ids over)
    tracking_bytes: int
    shm_reads: int
    tracking_thread_s: float = 0.0  # the tracker thread's counting, beside the steps (actors.tracking)
    mirror_steps: int = 0  # steps sent to its mirror (recovery: replica)
    mirror_send_s: float = 0.0  # the time its trainers waited for the mirror to hold them


@dataclass(frozen=True)
class PushResult:
    """A pushed gradient chunk: ``applied`` once its step's update ran (now or before:
    ``duplicate``); ``stale`` when a newer attempt of the step replaced this chunk."""

    applied: bool
    duplicate: bool = False
    stale: bool = False


# --------------------------------------------------------------------------- trainers


@dataclass(frozen=True)
class StartMarks:
    """Wall times of a trainer process's start, for the report of where a replacement's time goes."""

    process: float | None = None
    train_fn: float | None = None
    imports: float | None = None
    setup: float | None = None
    client: float | None = None
    model: float | None = None
    manager: float | None = None


@dataclass(frozen=True)
class TrainerStart:
    """A trainer process is ready; ``worker``: its Ray Train worker actor, through which a
    recovery asks it for its ``TrainerFacts``."""

    rank: int
    pid: int
    node_id: str
    marks: StartMarks = StartMarks()
    worker: object = None


@dataclass(frozen=True)
class TrainerFacts:
    """What a trainer process confirms when a recovery asks: its rank and process, the steps
    its dense model holds (torchft's committed step count) and whether it trained or healed
    since it started (a replacement that did neither holds only its checkpoint's state)."""

    rank: int
    pid: int
    steps: int
    established: bool


@dataclass(frozen=True)
class CommitRecord:
    """A trainer's share of a committed dense step: its microbatch ids, the step's microbatch
    total as the all-reduce summed it, and the fleet generation it trained on."""

    step: int
    rank: int
    microbatches: tuple[int, ...]
    total: int
    participants: int
    time: float
    generation: int | None = None
    pid: int | None = None  # the trainer process; with ``seq``, what makes a report retried twice count once
    seq: int | None = None  # the process's report number (commits and failed steps)
    process: str | None = None  # the process's own random name: pids repeat across hosts


@dataclass(frozen=True)
class StepFailure:
    """Trainer ``rank`` did not commit ``step``; ``broken_quorum``: the quorum whose all-reduce
    failed on that trainer (a member died), if that is why."""

    step: int
    rank: int
    time: float
    cause: str
    broken_quorum: int | None = None
    pid: int | None = None
    seq: int | None = None
    process: str | None = None


@dataclass(frozen=True)
class PhaseTimes:
    """Seconds a trainer spent in each phase of its steps since its last progress record."""

    quorum: float = 0.0
    data: float = 0.0
    lookup: float = 0.0
    dense: float = 0.0
    push: float = 0.0
    allreduce: float = 0.0
    commit: float = 0.0
    checkpoint: float = 0.0


@dataclass(frozen=True)
class Progress:
    step: int
    total_steps: int
    loss: float
    samples_per_s: float
    trainers: int
    phase_s: PhaseTimes = PhaseTimes()
    time: float = 0.0  # when the trainer sent it (else when the supervisor recorded it)


@dataclass(frozen=True)
class Heal:
    """A replacement trainer took its first share of a step after healing from a live peer."""

    rank: int
    step: int
    heal_s: float
    time: float


@dataclass(frozen=True)
class SaveRequest:
    """The saving trainer's dense state after ``step`` committed steps; ``final``: the run's
    last step (a full checkpoint whatever the schedule)."""

    step: int
    dense: bytes
    final: bool = False


@dataclass(frozen=True)
class SaveResult:
    saved: bool
    next_step: int | None
    duration_s: float = 0.0


@dataclass(frozen=True)
class EvalResult:
    auc: float
    log_loss: float
    eval_rows: int
    positive_rate: float
    eval_s: float
    steps: int


@dataclass(frozen=True)
class ResumePoint:
    """Where a trainer starts: a committed step and its dense state (None: step 0's)."""

    step: int
    dense: bytes | None


@dataclass(frozen=True)
class TrainerSetup:
    """What a trainer needs to start; ``finished``: nothing to do (the run is over, or its
    shards failed to start)."""

    finished: bool
    shards: tuple = ()
    generation: int = 0
    plan: ShardingPlan | None = None
    schedule: StepSchedule | None = None
    train_cache: str = ""
    eval_cache: str = ""
    resume: ResumePoint | None = None
    training_started: bool = False
    next_checkpoint_step: int | None = None
    audit_dir: str | None = None


@dataclass(frozen=True)
class RunStatus:
    """Polled by trainers every step: stop, or when the next save is due."""

    stop: bool
    state: str
    next_checkpoint: int | None


@dataclass(frozen=True)
class Rollback:
    """After a full recovery: every trainer goes back to ``step`` with its dense state
    (None: step 0's initial state). ``generation``: the fleet that rolled back."""

    generation: int
    step: int
    dense: bytes | None = None


@dataclass(frozen=True)
class FleetView:
    """The shards a trainer trains with now, their generation, and what else it must do."""

    generation: int
    shards: tuple
    rollback: Rollback | None = None
    stop: bool = False
    next_checkpoint: int | None = None
    # Steps the commit reports say are committed (await_shards): a trainer whose dense model
    # holds fewer stalled while the others trained on, and must not train on from its own step.
    committed_steps: int | None = None


@dataclass(frozen=True)
class FinalView:
    """``await_final``'s answer: the fleet after the last step, and whether the run's final
    full checkpoint is committed (if not, the trainers save it again)."""

    fleet: FleetView
    final_saved: bool
