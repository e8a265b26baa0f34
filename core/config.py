"""Typed, validated run configuration (YAML on disk, pydantic models in memory).

Every field is documented where it is declared; a bad value fails at start with the
field's dotted name and its allowed range, as a ``ConfigError``.
"""

from __future__ import annotations

import datetime
import os
import secrets
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

from core.config_data import DataConfig, GenerateConfig
from core.config_failures import BudgetsConfig, EmulationConfig, FaultPoint, FaultsConfig, Section as _Section
from core.errors import ConfigError

__all__ = [
    "RunConfig", "load_config", "config_from_dict", "BudgetsConfig", "EmulationConfig", "FaultPoint", "FaultsConfig",
    "MOVED_FIELDS", "DataConfig", "GenerateConfig",
]

NUM_SPARSE = 26
RUNS_DIR = "runs"


def new_run_dir() -> str:
    """A directory of its own for a run that names none: ``runs/<UTC date-time>-<6 hex>``."""
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
    return f"{RUNS_DIR}/{stamp}-{secrets.token_hex(3)}"


class ModelConfig(_Section):
    """The DLRM model: embedding tables and dense arches (torchrec.models.dlrm)."""

    embedding_dim: int = Field(16, ge=1, le=1024)
    """Dimension D of every embedding row (DLRM needs one D for the interaction)."""
    table_rows: int | list[int] = 100_000
    """Rows per table (``max_ind_range``): one number for all 26 tables or a list of 26."""
    max_ind_range: int | None = Field(None, ge=1, le=2**32)
    """Cap on every table's rows, as DLRM's ``--max-ind-range``: a larger ``table_rows`` entry
    (e.g. a column's published cardinality) gets this many rows; None: no cap."""
    dense_arch: list[int] = [64, 16]
    """DenseArch layer sizes; the last must equal ``embedding_dim``."""
    over_arch: list[int] = [64, 1]
    """OverArch layer sizes; the last must be 1 (one logit)."""

    @field_validator("table_rows")
    @classmethod
    def _check_rows(cls, v: int | list[int]) -> int | list[int]:
        rows = [v] * NUM_SPARSE if isinstance(v, int) else v
        if len(rows) != NUM_SPARSE:
            raise ValueError(f"must be one number or a list of {NUM_SPARSE}, got {len(rows)}")
        if any(r < 1 or r > 2**32 for r in rows):
            raise ValueError("every table needs between 1 and 2**32 rows")
        return v

    @model_validator(mode="after")
    def _check_arches(self) -> "ModelConfig":
        if not self.dense_arch or self.dense_arch[-1] != self.embedding_dim:
            raise ValueError(
                f"dense_arch must end with embedding_dim={self.embedding_dim}, got {self.dense_arch}"
            )
        if not self.over_arch or self.over_arch[-1] != 1:
            raise ValueError(f"over_arch must end with 1, got {self.over_arch}")
        if any(s < 1 for s in self.dense_arch + self.over_arch):
            raise ValueError("layer sizes must be >= 1")
        return self

    @property
    def rows_per_table(self) -> list[int]:
        rows = [self.table_rows] * NUM_SPARSE if isinstance(self.table_rows, int) else list(self.table_rows)
        return rows if self.max_ind_range is None else [min(r, self.max_ind_range) for r in rows]


class EmbeddingsConfig(_Section):
    """The embedding shard actors and their fused optimizer."""

    num_shards: int = Field(2, ge=1, le=1024)
    """Number of EmbeddingShard actors."""
    sharding: Literal["table_wise", "row_wise"] = "table_wise"
    """table_wise: whole tables per shard; row_wise: every table split in row ranges."""
    learning_rate: float = Field(0.05, gt=0.0, le=10.0)
    """Learning rate of fbgemm's fused row-wise Adagrad."""
    eps: float = Field(1e-8, gt=0.0, le=1.0)
    """Adagrad epsilon."""
    num_cpus: float = Field(1.0, ge=0.0, le=64.0)
    """Ray CPUs reserved per shard."""
    num_gpus: float = Field(0.0, ge=0.0, le=8.0)
    """Ray GPUs per shard; with a GPU the tables live in CUDA memory."""
    call_timeout_s: float = Field(60.0, gt=0.0, le=3600.0)
    """A shard that does not answer within this is treated as unavailable."""
    start_timeout_s: float = Field(120.0, gt=0.0, le=3600.0)
    """A new shard process (started, torch and fbgemm imported, tables allocated) that is not ready within
    this is treated as unavailable; calls to a started shard are bounded by call_timeout_s."""
    threads: int = Field(1, ge=1, le=256)
    """torch intra-op threads in each shard process."""
    spares: int = Field(1, ge=0, le=64)
    """Warm spare shard processes (torch and fbgemm imported, no table memory) that a
    recovery adopts instead of starting a new process; placed on nodes without shards when
    the cluster has them. 0: every recovery starts a new shard process."""
    spare_tables: Literal["auto", "ready", "lazy"] = "auto"
    """Whether a warm spare allocates a shard's tables ahead (those of the shape most shards
    have), so that a recovery of such a shard allocates nothing (1.3 GB took 0.5-2 s): "ready"
    always, "lazy" never, "auto" when its node's available memory is at least twice their size.
    Each ready spare holds that memory (its ``spare_ready`` event says how much)."""
    transport: Literal["auto", "ray"] = "auto"
    """How a step's ids, pooled rows and gradients reach a shard: ``auto`` through shared
    memory (/dev/shm) when trainer and shard share a node, in the Ray call otherwise;
    ``ray`` always in the Ray call."""


class TrainingConfig(_Section):
    """The trainers (a Ray Train worker group, one torchft replica group each)."""

    num_trainers: int = Field(2, ge=1, le=1024)
    """Number of trainer workers."""
    microbatch_rows: int = Field(512, ge=1, le=1_000_000)
    """Samples per microbatch."""
    microbatches_per_step: int = Field(4, ge=1, le=100_000)
    """M: microbatches per training step, whatever the number of live trainers."""
    epochs: float = Field(1.0, gt=0.0, le=1000.0)
    """Passes over the training data (fractions allowed)."""
    max_steps: int | None = Field(None, ge=1)
    """Stop after this many steps even if epochs are not done."""
    dense_learning_rate: float = Field(0.1, gt=0.0, le=10.0)
    """Learning rate of the dense Adagrad optimizer."""
    threads_per_worker: int | None = Field(None, ge=1, le=256)
    """torch intra-op threads of each trainer's dense compute. Unset: the cores of the
    trainer's node divided among the trainers there (the shards sit idle while the trainers
    compute)."""
    progress_every_steps: int = Field(10, ge=1)
    """How often trainers report step, loss and samples/s."""
    collective_timeout_s: float = Field(60.0, gt=0.0, le=3600.0)
    """torchft all-reduce timeout. A trainer's read of its step's data gives up at half of it;
    the next quorum waits it plus the saving trainer's save (``core.deadlines``)."""
    connect_timeout_s: float = Field(2.0, gt=0.0, le=3600.0)
    """Timeout of the trainers' gloo connection setup after each new quorum, at most
    ``collective_timeout_s``. A peer that dies while the group connects stalls the survivors
    for up to about 5x this long (gloo retries the connection)."""
    heartbeat_timeout_s: float = Field(2.0, ge=0.2, le=600.0)
    """A trainer whose heartbeats (every 0.1 s) stop for this long is dropped from the torchft
    quorum: after a trainer dies, the survivors wait this long before they go on without it."""

    @model_validator(mode="after")
    def _check_timeouts(self) -> "TrainingConfig":
        if self.connect_timeout_s > self.collective_timeout_s:
            raise ValueError(
                f"connect_timeout_s={self.connect_timeout_s} must be at most "
                f"collective_timeout_s={self.collective_timeout_s}"
            )
        return self


class CheckpointConfig(_Section):
    """Durable state: when to save, where, and how many to keep."""

    storage: str | None = None
    """A pyarrow.fs URI (local path, ``s3://bucket/prefix``, ``gs://...``); default ``<run_dir>/checkpoints``."""
    every_steps: int | None = Field(None, ge=1)
    """Save after every this many committed steps."""
    every_s: float | None = Field(None, gt=0.0, le=86_400.0)
    """Save when this many seconds passed since the last save (converted to steps from the measured step time)."""
    keep_last: int = Field(3, ge=1, le=1000)
    """Full checkpoints kept by the retention rule; the newest valid one is never deleted."""
    policy: Literal["full", "mfu", "ssu"] = "full"
    """Which rows a save writes: full (all), mfu (top r by access count since saved), ssu (a sampled set of accessed rows)."""
    r: float = Field(0.1, gt=0.0, le=1.0)
    """MFU/SSU: fraction of a shard's rows each prioritized save writes; saves happen 1/r times as often."""
    sample_rate: float = Field(0.1, gt=0.0, le=1.0)
    """SSU: probability that an access puts its row into the sampled set."""
    full_every: int = Field(10, ge=1, le=10_000)
    """MFU/SSU: every full_every-th save is full, which bounds the restore chain."""
    final: bool = True
    """Save a full checkpoint after the last step (also when periodic saves are off), so a finished run can be exported (``cpr export``) and resumed."""
    auto_interval: bool = False
    """Choose the interval from the CPR cost model (Young/Daly for full recovery, the PLS target for partial), re-chosen as the online estimates change."""
    pls_target: float = Field(0.02, gt=0.0, lt=1.0)
    """Target portion of lost samples for partial recovery (CPR)."""
    mtbf_s: float = Field(3600.0, gt=0.0)
    """Seed of the mean-time-between-failures estimate, refined from observed failures."""
    save_cost_s: float = Field(1.0, gt=0.0)
    """Seed of the checkpoint-save cost estimate, refined from observed saves."""
    load_cost_s: float = Field(1.0, gt=0.0)
    """Seed of the checkpoint-load cost estimate, refined from observed loads."""
    reschedule_cost_s: float = Field(3.0, gt=0.0)
    """Seed of the respawn cost estimate (new actor until it answers), refined from observed respawns."""
    replica_step_frac: float = Field(0.1, ge=0.0, le=1.0)
    """Share of every step that keeping mirrors in sync costs (``recovery: replica``), as the cost
    model weighs it: ``recovery: auto`` starts with mirrors only where they are cheapest in
    expected overhead and their memory fits the cluster. Measured by ``benchmarks/replica_cost.py``
    on 2 cores: 0.07 on the reference workload (8,192 samples a step), 0.31 on the demo's small steps."""

    @property
    def enabled(self) -> bool:
        """Whether periodic saves are on."""
        return self.every_steps is not None or self.every_s is not None or self.auto_interval

    @property
    def stored(self) -> bool:
        """Whether the run writes checkpoints at all (periodic ones or the final one)."""
        return self.enabled or self.final


class RayConfig(_Section):
    """How to reach Ray."""

    address: str | None = None
    """Cluster address; default: ``RAY_ADDRESS`` if set, else an embedded local Ray on 127.0.0.1."""
    num_cpus: int | None = Field(None, ge=1)
    """Logical CPUs of the embedded Ray (default: enough for shards and trainers)."""
    namespace: str = "cpr"
    """Ray namespace of the named supervisor actor."""
    metrics_export_port: int | None = Field(None, ge=1024, le=65535)
    """Port of the embedded Ray's Prometheus endpoint (``/metrics``); default: Ray picks a free one, written to run.json."""
    warm_pool_s: float = Field(600.0, ge=0.0, le=86_400.0)
    """On a cluster the run joins (``ray.address``, ``RAY_ADDRESS``): at the run's end, start as many idle worker
    processes as it used, for the next run to take (``app.warm``; with ``RAY_preload_python_modules`` on the
    cluster, torch is imported in them already), kept at least this long; 0: none."""
    lease_s: float = Field(1.0, ge=0.05, le=600.0)
    """How long a shard or trainer may act (apply a step, join a quorum) without hearing from the cluster that it still
    holds its place (``actors.lease``); must be below the time Ray takes to declare a silent host dead
    (``health_check_period_ms`` x ``health_check_failure_threshold``). A replaced process that may still be alive is
    waited out this long before its successor loads."""


class RunConfig(_Section):
    """A complete training run."""

    run_dir: str = Field(default_factory=new_run_dir)
    """Where the report, events and caches of this run go; default: a new ``runs/<date>-<time>-<id>`` for
    every run (``runs/latest`` points to the newest), so a config can be run any number of times."""
    seed: int = Field(0, ge=0)
    """Seed of model initialisation and data order."""
    data: DataConfig
    model: ModelConfig = ModelConfig()
    embeddings: EmbeddingsConfig = EmbeddingsConfig()
    training: TrainingConfig = TrainingConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    recovery: Literal["partial", "full", "auto", "replica"] = "partial"
    """What a dead embedding shard costs: partial (respawn it alone from its last checkpoint),
    full (roll every shard and the dense model back to the last checkpoint), replica (its mirror
    on another host takes its place: nothing lost, nothing read; with the mirror gone too, partial),
    auto (the CPR cost model picks)."""
    faults: FaultsConfig | None = None
    """Failure injection during the run; none when absent."""
    budgets: BudgetsConfig = BudgetsConfig()
    emulation: EmulationConfig | None = None
    """Production-scale emulation (``cpr emulate``): the checkpoint interval and the shard failures come
    from these production figures on an emulated clock; none when absent."""
    audit_log: bool = False
    """Shards (their mirrors from their start) and trainers append every applied update and commit to
    ``<run_dir>/audit/*.jsonl``, for ``cpr verify``'s exactly-once checks (independent of the supervisor's
    bookkeeping); the supervisor records each checkpoint retention removes, hashed just before, in
    ``retention.jsonl``."""
    ray: RayConfig = RayConfig()

    @model_validator(mode="after")
    def _check_emulation(self) -> "RunConfig":
        f = self.faults
        if self.emulation is not None and f is not None and (f.max_failures > 0 or f.at_steps or f.at_points):
            raise ValueError("emulation places its own failures on the emulated clock; remove the faults section")
        # A mirror stall (recovery: replica) names a shard's mirror: one per shard.
        counts = {"shard": self.embeddings.num_shards, "trainer": self.training.num_trainers,
                  "mirror": self.embeddings.num_shards}
        for i, spec in enumerate(f.inject if f is not None else []):
            if spec.target is None:
                continue
            kind, _, index = spec.target.partition(":")
            if int(index) >= counts[kind]:
                raise ValueError(f"faults.inject[{i}].target: {spec.target} does not exist; the run has "
                                 f"{counts[kind]} {kind}s (0..{counts[kind] - 1})")
        return self

    @model_validator(mode="after")
    def _check_shards(self) -> "RunConfig":
        if self.embeddings.sharding == "table_wise" and self.embeddings.num_shards > NUM_SPARSE:
            raise ValueError(
                f"embeddings.num_shards={self.embeddings.num_shards} exceeds {NUM_SPARSE} tables "
                "for table_wise sharding; use row_wise or at most 26 shards"
            )
        if self.embeddings.sharding == "row_wise":
            small = min(self.model.rows_per_table)
            if small < self.embeddings.num_shards:
                raise ValueError(
                    f"row_wise sharding needs every table to have >= num_shards="
                    f"{self.embeddings.num_shards} rows; the smallest has {small}"
                )
        return self

    @property
    def cache_dir(self) -> str:
        if self.data.cache_dir:
            return self.data.cache_dir
        storage = self.checkpoint.storage
        if storage and "://" in storage and not storage.startswith("file://"):
            prefix, _, rest = storage.partition("://")
            path, _, options = rest.partition("?")
            parent = path.rstrip("/").rsplit("/", 1)[0] if "/" in path.rstrip("/") else path.rstrip("/")
            return f"{prefix}://{parent}/cache" + (f"?{options}" if options else "")
        # Beside the run directories, not in one: every run under runs/ reuses the stores of the
        # same inputs and options (keyed by content, built atomically, safe for runs at once).
        return str(Path(self.run_dir).parent / "cache")

    @property
    def checkpoint_uri(self) -> str:
        return self.checkpoint.storage or str(Path(self.run_dir).resolve() / "checkpoints")


# Fields that moved to another section, old place -> new place: a config that names the old
# place is told the new one, not "Extra inputs are not permitted". From the history of this
# file, core/config_failures.py and app/config.py before them (every field removed from one
# section and added to another; none was renamed or dropped).
MOVED_FIELDS = {
    "training.max_trainer_failures": "budgets.max_trainer_failures",  # bd9c3a5: the failure budgets in one section
}


def _format_validation_error(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        field = ".".join(str(p) for p in e["loc"]) or "<config>"
        if e["type"] == "extra_forbidden" and field in MOVED_FIELDS:
            lines.append(f"{field}: moved to {MOVED_FIELDS[field]}")
            continue
        got = e.get("input")
        got_s = "" if isinstance(got, dict) else f" (got {got!r})"
        lines.append(f"{field}: {e['msg']}{got_s}")
    return "invalid config: " + "; ".join(lines)


def config_from_dict(raw: dict[str, Any]) -> RunConfig:
    """Validates a config dict; raises ConfigError naming every bad field and its range."""
    try:
        return RunConfig.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(_format_validation_error(err)) from None


def load_config(path: str | os.PathLike, overrides: dict[str, Any] | None = None) -> RunConfig:
    """Reads a YAML config; relative data paths are taken relative to the working directory."""
    try:
        raw = yaml.safe_load(Path(path).read_text()) or {}
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except (OSError, UnicodeDecodeError) as err:  # a directory, unreadable, not text
        raise ConfigError(f"{path}: cannot read the config: {getattr(err, 'strerror', None) or err}") from None
    except yaml.YAMLError as err:  # one line: where, and what YAML found there
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ConfigError(f"{path}: not valid YAML{where}: {problem}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections")
    for dotted, value in (overrides or {}).items():
        node = raw
        *parents, leaf = dotted.split(".")
        for i, p in enumerate(parents):
            if node.get(p) is None:  # absent, or left empty in the file
                node[p] = {}
            node = node[p]
            if not isinstance(node, dict):
                above = ".".join(parents[:i + 1])
                raise ConfigError(f"--set {dotted}: {above} is {node!r}, not a section with fields")
        node[leaf] = value
    return config_from_dict(raw)
