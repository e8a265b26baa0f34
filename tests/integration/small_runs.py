"""The small run the fault tests train (two row-wise shards, two trainers, the audit log on),
and training it to its report."""

from __future__ import annotations

from app.job import TrainingJob
from core.config import RunConfig, config_from_dict


def small_run_config(tmp_path, data, *, seed: int, steps: int, microbatches: int, call_timeout_s: float,
                     collective_timeout_s: float, checkpoint: dict, faults: dict, recovery: str = "partial") -> RunConfig:
    return config_from_dict({
        "run_dir": str(tmp_path / "run"),
        "seed": seed,
        "data": {"train": [data.train_path], "eval": [data.eval_path], "cache_dir": str(tmp_path.parent / "cache")},
        "model": {"embedding_dim": 8, "table_rows": 20_000, "dense_arch": [32, 8], "over_arch": [32, 1]},
        "embeddings": {"num_shards": 2, "sharding": "row_wise", "call_timeout_s": call_timeout_s},
        "training": {"num_trainers": 2, "microbatch_rows": 128, "microbatches_per_step": microbatches,
                     "max_steps": steps, "progress_every_steps": 5, "collective_timeout_s": collective_timeout_s},
        "checkpoint": checkpoint,
        "recovery": recovery,
        "audit_log": True,
        "faults": {"max_failures": 0, **faults},
    })


def train_to_report(cfg: RunConfig, timeout_s: float = 450) -> dict:
    """Trains ``cfg`` with its faults and returns the report; every process of the run is
    ended before this returns."""
    job = TrainingJob(cfg, show_progress=False)
    try:
        job.start(wait=False)
        job.fit_in_background().join(timeout_s=timeout_s)
        return job.finish()
    finally:
        job.close()
