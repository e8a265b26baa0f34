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
from core.errors import ConfigError
from core.journal import refuse_old_journal

__all__ = ["refuse_other_data", "resume_config"]


def resume_config(run_dir: str, verify_data: bool = False) -> RunConfig:
    """The config a run was started with, saved in its run directory (``verify_data``: with
    data.verify_data set, which reads the inputs again and changes nothing they make)."""
    path = Path(run_dir) / "config.yaml"
    if not path.exists():
        raise ConfigError(f"--resume {run_dir}: no config.yaml there; is it a run directory?")
    refuse_old_journal(Path(run_dir))  # another version's journal: refused before anything starts
    cfg = load_config(path)
    if verify_data:
        cfg = cfg.model_copy(update={"data": cfg.data.model_copy(update={"verify_data": True})})
    return cfg


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
