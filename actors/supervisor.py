"""The Supervisor actor: creates the embedding shards, tells trainers how to reach them,
and records the run's events, progress and evaluation. Checkpoint and recovery decisions
are made here too, so one actor owns the run's story.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import ray

from actors.plan import make_plan
from actors.shard import EmbeddingShard
from actors.trainer import StepSchedule
from app.config import config_from_dict
from app.errors import ShardUnavailable

__all__ = ["Supervisor", "supervisor_name"]

logger = logging.getLogger(__name__)


def supervisor_name(run_id: str) -> str:
    return f"cpr-supervisor-{run_id}"


class Supervisor:
    """One per run, a named actor: ``supervisor_name(run_id)`` in the config's namespace."""

    def __init__(self, config: dict, run_id: str, train_cache: str, eval_cache: str, num_microbatches: int):
        self.cfg = config_from_dict(config)
        self.run_id = run_id
        self.t0 = time.time()
        self.plan = make_plan(
            self.cfg.embeddings.sharding, self.cfg.model.rows_per_table, self.cfg.embeddings.num_shards
        )
        tr = self.cfg.training
        self.schedule = StepSchedule.from_config(
            num_microbatches, tr.microbatches_per_step, tr.epochs, tr.max_steps, self.cfg.seed
        )
        self.train_cache = train_cache
        self.eval_cache = eval_cache
        self.shards: list[Any] = []
        self.shard_info: list[dict] = []
        self.events: list[dict] = []
        self.progress_log: list[dict] = []
        self.eval_metrics: dict | None = None
        self._lock = threading.Lock()

    def record_event(self, kind: str, **fields) -> dict:
        event = {"time_s": round(time.time() - self.t0, 3), "kind": kind, **fields}
        with self._lock:
            self.events.append(event)
        logger.info("event %s", event)
        return event

    def _spawn_shard(self, k: int):
        emb = self.cfg.embeddings
        actor_cls = ray.remote(EmbeddingShard)
        return actor_cls.options(
            name=f"cpr-shard-{self.run_id}-{k}",
            namespace=self.cfg.ray.namespace,
            num_cpus=emb.num_cpus,
            num_gpus=emb.num_gpus,
            max_restarts=0,
        ).remote(
            shard_id=k,
            slices=list(self.plan.shards[k]),
            dim=self.cfg.model.embedding_dim,
            learning_rate=emb.learning_rate,
            eps=emb.eps,
            seed=self.cfg.seed,
            microbatches_per_step=self.cfg.training.microbatches_per_step,
            threads=self.cfg.training.threads_per_worker,
        )

    def start(self) -> dict:
        """Creates every shard and waits until each answers; returns their identities."""
        t = time.perf_counter()
        self.shards = [self._spawn_shard(k) for k in range(self.plan.num_shards)]
        try:
            self.shard_info = ray.get(
                [s.ready.remote() for s in self.shards], timeout=self.cfg.embeddings.call_timeout_s
            )
        except ray.exceptions.GetTimeoutError:
            raise ShardUnavailable(
                f"{self.plan.num_shards} shards did not start within "
                f"embeddings.call_timeout_s={self.cfg.embeddings.call_timeout_s}s"
            ) from None
        startup_s = time.perf_counter() - t
        self.record_event(
            "shards_ready",
            shards=self.plan.num_shards,
            sharding=self.plan.kind,
            rows=[self.plan.shard_rows(k) for k in range(self.plan.num_shards)],
            startup_s=round(startup_s, 3),
        )
        return {"shards": self.shard_info, "startup_s": startup_s, "total_steps": self.schedule.total_steps}

    def trainer_setup(self) -> dict:
        """What a trainer needs: shard handles, the plan, the data and the step schedule."""
        return {
            "shards": self.shards,
            "plan": self.plan,
            "schedule": self.schedule,
            "train_cache": self.train_cache,
            "eval_cache": self.eval_cache,
        }

    def shard_handles(self) -> list:
        return list(self.shards)

    def record_progress(self, progress: dict) -> None:
        progress = {"time_s": round(time.time() - self.t0, 3), **progress}
        with self._lock:
            self.progress_log.append(progress)

    def record_eval(self, metrics: dict) -> None:
        self.eval_metrics = metrics
        self.record_event("evaluated", **{k: v for k, v in metrics.items() if k != "positive_rate"})

    def progress(self) -> dict | None:
        with self._lock:
            return self.progress_log[-1] if self.progress_log else None

    def summary(self) -> dict:
        """Everything the report needs, including each shard's counters."""
        try:
            shard_states = ray.get([s.state.remote() for s in self.shards], timeout=self.cfg.embeddings.call_timeout_s)
        except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError) as err:
            shard_states = [{"error": str(err)}]
        with self._lock:
            return {
                "run_id": self.run_id,
                "events": list(self.events),
                "progress": list(self.progress_log),
                "eval": self.eval_metrics,
                "shards": shard_states,
                "shard_rows": [self.plan.shard_rows(k) for k in range(self.plan.num_shards)],
                "total_steps": self.schedule.total_steps,
            }
