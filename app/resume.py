"""What ``cpr train --resume RUN_DIR`` checks before anything starts: the run's own config,
a journal of this version, and the training data the run trained on (its checkpoints' data
position names the training store's key and inputs, core.checkpoint.position)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from app.dataprep import DataInputs, train_identity
from core.checkpoint import newest_position, other_data
from core.checkpoint.reader import CheckpointReader
from core.config import RunConfig, load_config
from core.errors import CheckpointCorrupt, CheckpointNotFound, ConfigError
from core.journal import refuse_old_journal

__all__ = ["PLAN_FIELDS", "refuse_other_data", "resume_config"]


# What a resume may change: the rows go back to the shards of the new plan from the
# checkpoint's files, whatever plan wrote them (core.checkpoint.plans.read_slices).
PLAN_FIELDS = ("embeddings.num_shards", "embeddings.sharding")


def resume_config(run_dir: str, verify_data: bool = False, plan: dict | None = None) -> RunConfig:
    """The config a run was started with, saved in its run directory (``verify_data``: with
    data.verify_data set, which reads the inputs again and changes nothing they make), with
    ``plan``'s fields (of ``PLAN_FIELDS``, as ``--set`` gives them) changed: a resume on
    another number of shards, or another sharding."""
    path = Path(run_dir) / "config.yaml"
    if not path.exists():
        raise ConfigError(f"--resume {run_dir}: no config.yaml there; is it a run directory?")
    refuse_old_journal(Path(run_dir))  # another version's journal: refused before anything starts
    if other := sorted(set(plan or {}) - set(PLAN_FIELDS)):
        raise ConfigError(f"--resume {run_dir} continues the run with its own config: --set {other[0]} is not "
                          f"allowed (only {' and '.join(PLAN_FIELDS)}: a new sharding plan)")
    cfg = load_config(path, plan or None)
    if plan and cfg.checkpoint.stored:
        _refuse_unrecorded_plan(cfg)
    if verify_data:
        cfg = cfg.model_copy(update={"data": cfg.data.model_copy(update={"verify_data": True})})
    return cfg


def _refuse_unrecorded_plan(cfg: RunConfig) -> None:
    """A checkpoint made before manifests recorded their plan cannot say which rows each file
    holds: a resume of one keeps the run's plan."""
    reader = CheckpointReader(cfg.checkpoint_uri)
    for step in reader.list_committed():
        try:
            recorded = reader.plan(reader.info(step))
        except (CheckpointCorrupt, CheckpointNotFound):
            continue  # not one a restore will use
        if recorded is None:
            raise ConfigError(f"checkpoint step {step} does not record its sharding plan (an older version wrote it): "
                              f"resume without --set {PLAN_FIELDS[0]} or {PLAN_FIELDS[1]}")


def refuse_other_data(cfg: RunConfig, inputs: DataInputs) -> None:
    """Stops a resume whose training inputs are not those of its newest readable checkpoint,
    naming what changed, before a store of other data is built. The supervisor's restore
    checks the checkpoint it restores again (actors.supervisor.actor.Supervisor.restore)."""
    if not cfg.checkpoint.stored:
        return
    found = newest_position(CheckpointReader(cfg.checkpoint_uri))
    if found is None:
        return
    step, saved = found
    key, sources = train_identity(cfg, inputs)
    now = dataclasses.replace(saved, store_key=key, inputs=sources, content="")  # content: known once built
    if (why := other_data(saved, now, step)) is not None:
        raise ConfigError(why)
