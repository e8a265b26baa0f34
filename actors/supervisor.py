"""The Supervisor actor: creates the embedding shards, tells trainers how to reach them,
and records the run's events, progress and evaluation. Checkpoint and recovery decisions
are made here too, so one actor owns the run's story.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any

import ray

from actors.checkpoint import DATA_POSITION_FILE, DENSE_FILE, FULL, CheckpointStore, write_blob
from actors.plan import make_plan
from actors.shard import EmbeddingShard
from actors.trainer import StepSchedule
from app.config import config_from_dict
from app.errors import ConfigError, ShardUnavailable
from policies import interval_steps

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
        ck = self.cfg.checkpoint
        self.store = CheckpointStore(self.cfg.checkpoint_uri, keep_last=ck.keep_last) if ck.enabled else None
        self.resume_state: dict | None = None
        self.trainers_registered: set[int] = set()
        self.training_started = False
        self.last_checkpoint_step = 0
        self.next_checkpoint_step = self._after(0)

    def _step_time_s(self) -> float | None:
        with self._lock:
            rates = [p["samples_per_s"] for p in self.progress_log[-5:] if p.get("samples_per_s")]
        if not rates:
            return None
        tr = self.cfg.training
        return tr.microbatches_per_step * tr.microbatch_rows / (sum(rates) / len(rates))

    def _after(self, step: int) -> int | None:
        """The step count at which the next checkpoint is due, or None when saves are off."""
        ck = self.cfg.checkpoint
        if not ck.enabled:
            return None
        candidates = []
        if ck.every_steps is not None:
            candidates.append(ck.every_steps)
        if ck.every_s is not None:
            step_time_s = self._step_time_s()
            # Before the first measurement, save at the first progress report.
            candidates.append(
                interval_steps(ck.every_s, step_time_s) if step_time_s else self.cfg.training.progress_every_steps
            )
        return step + min(candidates)

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
        """What a trainer needs: shard handles, the plan, the data, the step schedule, the
        step to resume from with its dense state, and when the next checkpoint is due."""
        return {
            "shards": self.shards,
            "plan": self.plan,
            "schedule": self.schedule,
            "train_cache": self.train_cache,
            "eval_cache": self.eval_cache,
            "resume": self.resume_state,
            "next_checkpoint_step": self.next_checkpoint_step,
        }

    def register_trainer(self, rank: int) -> bool:
        """A trainer is ready to step. Returns True once the first step may begin: every
        trainer of the group has registered, or training is already under way (a
        replacement trainer joins the running quorum and heals from a peer)."""
        with self._lock:
            self.trainers_registered.add(rank)
            return self.training_started or len(self.trainers_registered) >= self.cfg.training.num_trainers

    def record_training_started(self, step: int, trainers: int, wall_time: float) -> None:
        with self._lock:
            if self.training_started:
                return
            self.training_started = True
        self.record_event("training_started", step=step, trainers=trainers, wall_time=wall_time)

    def checkpoint_due(self) -> int | None:
        return self.next_checkpoint_step

    def _position(self, step: int) -> dict:
        tr = self.cfg.training
        return {
            "next_step": step,
            "microbatches_per_step": tr.microbatches_per_step,
            "microbatch_rows": tr.microbatch_rows,
            "num_microbatches": self.schedule.num_microbatches,
            "seed": self.schedule.seed,
            "samples_trained": step * tr.microbatches_per_step * tr.microbatch_rows,
        }

    def save_checkpoint(self, step: int, dense_blob: bytes) -> dict:
        """A full, consistent checkpoint after ``step`` committed steps: every shard writes
        its own file, the dense state and data position are written here, the manifest last.
        Called by the first participating trainer right after it committed ``step``.
        """
        if self.store is None:
            raise ConfigError("checkpoint: every_steps or every_s must be set to save checkpoints")
        t0 = time.perf_counter()
        uri = self.cfg.checkpoint_uri
        refs = [shard.save_checkpoint.remote(uri, step) for shard in self.shards]
        entries = [
            write_blob(uri, step, DENSE_FILE, dense_blob),
            write_blob(uri, step, DATA_POSITION_FILE, json.dumps(self._position(step)).encode()),
        ]
        results = ray.get(refs, timeout=self.cfg.embeddings.call_timeout_s)
        entries += [r["entry"] for r in results]
        info = self.store.commit(step, entries, kind=FULL, meta={"run_id": self.run_id})
        duration_s = time.perf_counter() - t0
        self.last_checkpoint_step = step
        self.next_checkpoint_step = self._after(step)
        self.record_event(
            "checkpoint_saved",
            step=step,
            duration_s=round(duration_s, 4),
            bytes=info.total_bytes,
            rows=sum(r["rows"] for r in results),
            shard_write_s=[round(r["duration_s"], 4) for r in results],
            next_step=self.next_checkpoint_step,
        )
        return {"next_step": self.next_checkpoint_step, "duration_s": duration_s}

    def restore(self) -> dict | None:
        """Loads every shard from the newest restorable checkpoint and keeps the dense state
        and data position for the trainers. Returns what was restored, or None if nothing was.
        """
        if self.store is None:
            raise ConfigError("checkpoint: every_steps or every_s must be set to resume a run")
        t0 = time.perf_counter()
        steps = self.store.chain_steps()
        for step, reason in self.store.fallbacks:
            self.record_event("checkpoint_fallback", step=step, reason=reason)
        if not steps:
            return None
        step = steps[-1]
        position = json.loads(self.store.read_blob(step, DATA_POSITION_FILE))
        expected = self._position(step)
        for key in ("microbatches_per_step", "microbatch_rows", "num_microbatches", "seed"):
            if position[key] != expected[key]:
                raise ConfigError(
                    f"checkpoint step {step} was made with {key}={position[key]}, the config now "
                    f"gives {expected[key]}; resume with the run's own config"
                )
        uri = self.cfg.checkpoint_uri
        loaded = ray.get([s.load_checkpoint.remote(uri, steps) for s in self.shards], timeout=self.cfg.embeddings.call_timeout_s)
        self.resume_state = {"step": step, "dense": self.store.read_blob(step, DENSE_FILE), "position": position}
        self.last_checkpoint_step = step
        self.next_checkpoint_step = self._after(step)
        event = self.record_event(
            "resumed",
            step=step,
            chain=steps,
            rows_loaded=sum(x["rows"] for x in loaded),
            bytes_loaded=sum(x["bytes"] for x in loaded),
            duration_s=round(time.perf_counter() - t0, 4),
        )
        return event

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
                "resumed_from_step": self.resume_state["step"] if self.resume_state else None,
                "last_checkpoint_step": self.last_checkpoint_step,
            }
