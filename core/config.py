"""Typed, validated run configuration (YAML on disk, pydantic models in memory).

Every field is documented where it is declared; a bad value fails at start with the
field's dotted name and its allowed range, as a ``ConfigError``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from core.errors import ConfigError

__all__ = ["RunConfig", "load_config", "config_from_dict", "config_reference"]

NUM_SPARSE = 26


class _Section(BaseModel):
    # Unknown keys are typos; failing on them beats silently ignoring a setting.
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


class GenerateConfig(_Section):
    """Synthetic data written by ``cpr datagen`` when the data files do not exist yet."""

    train_rows: int = Field(200_000, ge=1, le=10**10)
    """Training rows to write."""
    eval_rows: int = Field(20_000, ge=1, le=10**9)
    """Held-out rows to write (a separate file, never trained on)."""
    seed: int = Field(0, ge=0)
    """Generator seed: the same seed writes byte-identical files."""
    format: Literal["tsv", "tsv.gz", "parquet"] = "tsv"
    """File format of the generated data."""
    vocab_rows: int = Field(100_000, ge=2, le=2**32)
    """Distinct categorical values per feature before hashing to table rows."""


class DataConfig(_Section):
    """Where the Criteo-format data lives and how it is read."""

    train: list[str] = Field(..., min_length=1)
    """Training files: Criteo TSV (optionally .gz) or Parquet, read as a stream."""
    eval: list[str] = Field(..., min_length=1)
    """Held-out files; a fixed split that is never trained on."""
    generate: GenerateConfig | None = None
    """If set and the files are missing, synthetic data is generated first."""
    skip_bad_lines: bool = False
    """Count and skip malformed lines instead of stopping with an error."""
    cache_dir: str | None = None
    """Where the preprocessed microbatch cache goes; default ``<run_dir>/cache``."""


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
    threads: int = Field(1, ge=1, le=256)
    """torch intra-op threads in each shard process."""
    spares: int = Field(1, ge=0, le=64)
    """Warm spare shard processes (torch and fbgemm imported, no table memory) that a
    recovery adopts instead of starting a new process; placed on nodes without shards when
    the cluster has them. 0: every recovery starts a new shard process."""
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
    """torchft quorum / all-reduce timeout."""
    connect_timeout_s: float = Field(2.0, gt=0.0, le=3600.0)
    """Timeout of the trainers' gloo connection setup after each new quorum, at most
    ``collective_timeout_s``. A peer that dies while the group connects stalls the survivors
    for up to about 5x this long (gloo retries the connection)."""
    heartbeat_timeout_s: float = Field(2.0, ge=0.2, le=600.0)
    """A trainer whose heartbeats (every 0.1 s) stop for this long is dropped from the torchft
    quorum: after a trainer dies, the survivors wait this long before they go on without it."""
    max_trainer_failures: int = Field(20, ge=-1)
    """Trainer deaths Ray Train replaces before the run fails (-1: no limit)."""

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

    @property
    def enabled(self) -> bool:
        """Whether periodic saves are on."""
        return self.every_steps is not None or self.every_s is not None or self.auto_interval

    @property
    def stored(self) -> bool:
        """Whether the run writes checkpoints at all (periodic ones or the final one)."""
        return self.enabled or self.final


class FaultPoint(_Section):
    """A kill at a named point of the supervisor's work (like torchft's EventInjector.fail_at)."""

    at: Literal["save.snapshotted", "save.files_written", "recovery.spawned", "recovery.loaded", "rollback.loaded"]
    """save.snapshotted: every shard copied the rows to save, files being written in the background;
    save.files_written: shard files written, manifest not; recovery.spawned: new shards answer, nothing
    loaded; recovery.loaded: loaded, fleet not committed; rollback.loaded: every shard loaded, nothing fenced."""
    kill: str = Field(..., pattern=r"^(supervisor|all_trainers|shard:\d+|trainer:\d+)$")
    """What to kill there, once: supervisor, all_trainers, shard:K or trainer:K."""


class FaultsConfig(_Section):
    """Injected failures, so that a run with failures is reproducible."""

    targets: list[Literal["shards", "trainers", "supervisor", "all_trainers"]] = ["shards"]
    """Which actors may be killed (SIGKILL of the actor's process); all_trainers kills every trainer at once."""
    mtbf_s: float = Field(20.0, gt=0.0)
    """Mean time between injected failures."""
    distribution: Literal["exponential", "fixed"] = "exponential"
    """Inter-failure times: exponential with mean mtbf_s (memoryless, as real failures), or fixed."""
    seed: int = Field(0, ge=0)
    """Seed of the schedule: which actor dies and when."""
    max_failures: int = Field(3, ge=0)
    """Stop injecting after this many kills."""
    start_after_s: float = Field(0.0, ge=0.0)
    """Injection starts this long after the first training step."""
    at_steps: dict[str, list[int]] = {}
    """Kills once a training step committed, e.g. ``{trainer: [40], shard: [70]}``; keys: shard, trainer
    (one chosen by the seed), shard:K, trainer:K, supervisor, all_trainers. Independent of machine speed."""
    at_points: list[FaultPoint] = []
    """Kills at named points of the supervisor's work, each once (see faults.at_points[].at)."""

    @field_validator("at_steps")
    @classmethod
    def _check_at_steps(cls, v: dict[str, list[int]]) -> dict[str, list[int]]:
        import re

        for key, steps in v.items():
            if not re.fullmatch(r"shard|trainer|supervisor|all_trainers|shard:\d+|trainer:\d+", key):
                raise ValueError(f"key {key!r} must be shard, trainer, shard:K, trainer:K, supervisor or all_trainers")
            if any(s < 0 for s in steps):
                raise ValueError(f"{key}: steps must be >= 0, got {steps}")
        return v


class EmulationConfig(_Section):
    """The CPR paper's production-scale emulation: real training, failures and costs on an emulated clock."""

    node_mtbf_h: float = Field(6335.0, gt=0.0, le=10_000_000.0)
    """Mean time between failures of one host, in hours. Default: Llama 3's pre-training, 419 unexpected
    interruptions in 54 days on 16,384 GPUs = 2,048 hosts of 8 (Dubey et al. 2024, section 3.3.4)."""
    nodes: int = Field(128, ge=1, le=1_000_000)
    """Hosts of the emulated job; its MTBF is node_mtbf_h / nodes (49.5 h by default)."""
    duration_h: float = Field(240.0, gt=0.0, le=1_000_000.0)
    """Failure-free production training time the run stands for; each step is duration_h / steps of it."""
    save_s: float = Field(600.0, gt=0.0, le=86_400.0)
    """Training stall of one full checkpoint save (o_save); a prioritized save costs its share of the rows."""
    load_s: float = Field(600.0, ge=0.0, le=86_400.0)
    """Loading the whole model from a checkpoint (o_load); a partial recovery pays the dead shard's share."""
    reschedule_s: float = Field(300.0, ge=0.0, le=86_400.0)
    """Getting a replacement host and process running (o_res), per failure."""
    seed: int = Field(0, ge=0)
    """Seed of the failure schedule (times on the emulated clock, and which shard fails)."""
    max_failures: int = Field(100, ge=0, le=10_000)
    """Stop placing failures after this many."""


class BudgetsConfig(_Section):
    """Failure budgets (like Ray Train's FailureConfig): past one the run stops with an error
    naming the budget and the counts, writes its report, and ``--resume`` continues it."""

    max_shard_recoveries: int = Field(100, ge=-1)
    """Embedding-shard deaths recovered before the run stops (-1: no limit)."""
    max_step_redos: int = Field(20, ge=-1)
    """Times one training step may fail and be redone before the run stops (-1: no limit)."""
    max_supervisor_restarts: int = Field(20, ge=-1)
    """Supervisor restarts before the run stops (-1: no limit)."""


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


class RunConfig(_Section):
    """A complete training run."""

    run_dir: str = "runs/local"
    """Where the report, events and caches of this run go."""
    seed: int = Field(0, ge=0)
    """Seed of model initialisation and data order."""
    data: DataConfig
    model: ModelConfig = ModelConfig()
    embeddings: EmbeddingsConfig = EmbeddingsConfig()
    training: TrainingConfig = TrainingConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    recovery: Literal["partial", "full", "auto"] = "partial"
    """What a dead embedding shard costs: partial (respawn it alone from its last checkpoint),
    full (roll every shard and the dense model back to the last checkpoint), auto (the CPR cost
    model picks)."""
    faults: FaultsConfig | None = None
    """Failure injection during the run; none when absent."""
    budgets: BudgetsConfig = BudgetsConfig()
    emulation: EmulationConfig | None = None
    """Production-scale emulation (``cpr emulate``): the checkpoint interval and the shard failures come
    from these production figures on an emulated clock; none when absent."""
    audit_log: bool = False
    """Shards and trainers append every applied update and commit to ``<run_dir>/audit/*.jsonl``, for
    ``cpr soak``'s exactly-once checks (independent of the supervisor's bookkeeping)."""
    ray: RayConfig = RayConfig()

    @model_validator(mode="after")
    def _check_emulation(self) -> "RunConfig":
        f = self.faults
        if self.emulation is not None and f is not None and (f.max_failures > 0 or f.at_steps or f.at_points):
            raise ValueError("emulation places its own failures on the emulated clock; remove the faults section")
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
        return self.data.cache_dir or str(Path(self.run_dir) / "cache")

    @property
    def checkpoint_uri(self) -> str:
        return self.checkpoint.storage or str(Path(self.run_dir).resolve() / "checkpoints")


def _format_validation_error(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        field = ".".join(str(p) for p in e["loc"]) or "<config>"
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
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {err}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections")
    for dotted, value in (overrides or {}).items():
        node = raw
        *parents, leaf = dotted.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return config_from_dict(raw)


def _allowed(info) -> str:
    parts = []
    for m in info.metadata:
        for attr, sym in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
            v = getattr(m, attr, None)
            if v is not None:
                parts.append(f"{sym} {v}")
    return ", ".join(parts)


def config_reference() -> str:
    """The config reference as a markdown table, from the models' field docstrings."""
    rows = ["| field | type | default | allowed | meaning |", "|---|---|---|---|---|"]

    def walk(model: type[BaseModel], prefix: str) -> None:
        for name, info in model.model_fields.items():
            ann = info.annotation
            sub = next(
                (a for a in getattr(ann, "__args__", (ann,)) if isinstance(a, type) and issubclass(a, BaseModel)),
                None,
            )
            if sub is not None:
                doc = (sub.__doc__ or "").strip().splitlines()[0]
                rows.append(f"| **{prefix}{name}** | section | | | {doc} |")
                walk(sub, f"{prefix}{name}.")
                continue
            type_s = str(ann).replace("typing.", "").replace("<class '", "").replace("'>", "").replace("|", "\\|")
            default = "required" if info.is_required() else repr(info.default)
            desc = " ".join((info.description or "").split())
            rows.append(f"| `{prefix}{name}` | `{type_s}` | `{default}` | {_allowed(info)} | {desc} |")

    walk(RunConfig, "")
    return "\n".join(rows)
