"""What trainers, the driver and the chaos tool ask of the supervisor.

A mixin of ``Supervisor``: every method here reads the core's state under its lock, changes
it only through ``_transition``, and waits with a deadline (``core.deadlines``) so that a
caller's own timeout is always the longer one.
"""

from __future__ import annotations

import json
import logging
import os
import time

import ray

from core.checkpoint import DATA_POSITION_FILE, DENSE_FILE
from core.deadlines import Deadline
from actors.fleet import kill_run_shards, spare_target
from actors.machine import (
    RECOVERING, TERMINAL, ResumeRequested, RollingBack, Running, StopRequested, TrainersAllDied,
    replacement_at_checkpoint, state_to_dict,
)
from core.errors import ConfigError, ShardUnavailable, TrainerConflict

__all__ = ["RunApi"]

logger = logging.getLogger(__name__)


class RunApi:
    # ------------------------------------------------------------------ start and resume

    def start(self) -> dict:
        """Creates every shard (generation 0, reserved in the journal first) and waits until
        each answers; returns their identities. Idempotent across a supervisor restart."""
        t = time.perf_counter()
        n = self.plan.num_shards
        if not self.started:
            with self._lock:
                self.next_gens = [max(g, 1) for g in self.next_gens]
                self._persist()
            try:
                taken = []  # spread over the nodes (actors.nodes.placement)
                handles = [self.fleet.find(k, 0) or self.fleet.spawn(k, 0, taken) for k in range(n)]
                infos = self.fleet.ready(handles)
            except Exception as err:  # trainers waiting in trainer_setup end; the driver raises it
                with self._lock:
                    self.start_error = repr(err)[:500]
                    self._changed.notify_all()
                raise
            with self._lock:
                self.shards, self.shard_info, self.started = handles, infos, True
                self.ckpt.start(0)
                self._persist()
                self._changed.notify_all()
            for k, h in enumerate(handles):
                self.fleet.watch(k, 0, h)
            self.hosts.start()
            self.record_event(
                "shards_ready", shards=n, sharding=self.plan.kind, rows=[self.plan.shard_rows(k) for k in range(n)],
                nodes=[i.get("node_ip") for i in infos],
                startup_s=round(time.perf_counter() - t, 3),
            )
        return {"shards": list(self.shard_info), "startup_s": time.perf_counter() - t, "total_steps": self.schedule.total_steps}

    def restore(self) -> dict | None:
        """--resume: rolls every shard back to the newest full checkpoint (the one rollback
        path) and keeps its step for the trainers. Returns the ``resumed`` event, or None."""
        if self.ckpt.store is None:
            raise ConfigError("checkpoint: every_steps, every_s or auto_interval must be set to resume a run")
        steps = self.ckpt.consistent_chain()
        for step, reason in self.ckpt.store.fallbacks:
            self.record_event("checkpoint_fallback", step=step, reason=reason)
        if not steps:
            return None
        position = json.loads(self.ckpt.store.read_blob(steps[-1], DATA_POSITION_FILE))
        expected = self._position(steps[-1])
        for key in ("microbatches_per_step", "microbatch_rows", "num_microbatches", "seed"):
            if position[key] != expected[key]:
                raise ConfigError(
                    f"checkpoint step {steps[-1]} was made with {key}={position[key]}, the config now "
                    f"gives {expected[key]}; resume with the run's own config"
                )
        self._transition(ResumeRequested(steps[-1], tuple(steps)))
        self._wait_settled(Deadline(self.deadlines.supervisor_wait_s))
        return next((e for e in reversed(self.events) if e["kind"] == "resumed"), None)

    def _position(self, step: int) -> dict:
        tr = self.cfg.training
        return {
            "next_step": step, "microbatches_per_step": tr.microbatches_per_step, "microbatch_rows": tr.microbatch_rows,
            "num_microbatches": self.schedule.num_microbatches, "seed": self.schedule.seed,
            "samples_trained": step * self.samples_per_step,
        }

    def _wait_settled(self, deadline: Deadline) -> bool:
        """Waits until no recovery is in flight; False if the deadline passed first."""
        with self._changed:
            return self._changed.wait_for(lambda: not isinstance(self.state, RECOVERING), timeout=deadline.remaining())

    # ------------------------------------------------------------------ trainers

    def trainer_setup(self) -> dict:
        """What a trainer needs: shard handles, the plan, the data, the step schedule, the
        step to start from with its dense state, and when the next checkpoint is due."""
        with self._lock:
            # The driver starts Ray Train while the shards start: wait for them here.
            if not self._changed.wait_for(lambda: self.started or self.start_error, self.deadlines.supervisor_wait_s):
                raise ShardUnavailable(f"the embedding shards did not start within {self.deadlines.supervisor_wait_s:.0f}s")
            if self.start_error:
                return {"finished": True}  # the driver raises the error from start()
            if isinstance(self.state, RollingBack) and self.training_started:
                start = self.state.step  # newer checkpoints are being fenced right now
            elif self.training_started:
                chain = self.ckpt.consistent_chain()
                start = chain[-1] if chain else 0
            else:
                start = self.resume_step
            return {
                "shards": list(self.shards), "generation": self.generation, "plan": self.plan, "schedule": self.schedule,
                "train_cache": self.train_cache, "eval_cache": self.eval_cache,
                "train_cache_bytes": os.path.getsize(self.train_cache),
                "resume": None if start is None else {"step": start, "dense": self._dense(start)},
                "training_started": self.training_started, "finished": isinstance(self.state, TERMINAL),
                "next_checkpoint_step": self.ckpt.next_checkpoint_step,
                "audit_dir": str(self.run_dir / "audit") if self.cfg.audit_log else None,
            }

    def _dense(self, step: int) -> bytes | None:
        return self.ckpt.store.read_blob(step, DENSE_FILE) if step > 0 and self.ckpt.store is not None else None

    def status(self) -> dict:
        """Polled by trainers every step without blocking: stop, or when to save next."""
        with self._lock:
            return {"stop": isinstance(self.state, TERMINAL), "state": self.state.name,
                    "next_checkpoint": self.ckpt.next_checkpoint_step}

    def report_shard_failure(self, k: int, generation: int, reason: str, step: int) -> None:
        """A trainer's call to shard ``k`` failed or timed out at ``step``. A shard that hangs
        is killed, so that hangs and deaths take the same recovery path (the watch sees it)."""
        with self._lock:
            if generation != self.generation or not isinstance(self.state, Running):
                return
            shard = self.shards[k]
        logger.warning("trainer reports shard %d unavailable (%s); killing it", k, reason)
        self.fleet.kill(shard)

    def await_shards(self, known_generation: int, step: int) -> dict:
        """Called by a trainer after its step ``step`` failed. Returns the current shards,
        their generation and, after a full recovery, the step to roll back to (with its
        dense state); ``stop`` once the run is over.

        It does not answer "nothing changed" while a shard is dead but not yet recovered: a
        trainer whose own calls succeeded could otherwise redo the step with stale state
        while the others roll back. So on an unchanged generation it probes the shards.
        """
        deadline = Deadline(self.deadlines.supervisor_wait_s)
        while not deadline.expired():
            self._wait_settled(deadline)
            with self._lock:
                state, generation, shards = self.state, self.generation, list(self.shards)
                answer = {"generation": generation, "shards": shards, "rollback": None,
                          "stop": isinstance(state, TERMINAL), "next_checkpoint": self.ckpt.next_checkpoint_step}
                if isinstance(state, TERMINAL):
                    return answer
                if isinstance(state, Running) and generation > known_generation:
                    rb = self.rollback if self.rollback and self.rollback["generation"] > known_generation else None
                    if rb is not None:
                        answer["rollback"] = {**rb, "dense": self._dense(rb["step"])}
                    self._settle(known_generation, step)
                    return answer
            if not isinstance(state, Running):
                continue
            try:
                ray.get([s.state.remote() for s in shards], timeout=deadline.remaining(self.deadlines.shard_call_s))
                return answer
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                with self._changed:
                    self._changed.wait_for(lambda: self.generation > generation, timeout=deadline.remaining())
        raise ShardUnavailable(f"shards not recovered within {self.deadlines.supervisor_wait_s:.0f}s (4 x call_timeout_s)")

    def fallback_to_checkpoint(self, step: int, rank: int) -> dict:
        """Every trainer died and the new ones start at checkpoint ``step``: roll the shards
        back to it too (the one rollback path), so dense and embedding state agree.
        Idempotent (several trainers call it). Returns whether it rolled back, and the
        generation and shards the caller now trains with. Raises ``TrainerConflict`` when a
        live trainer is ahead of ``step`` (a quorum of replacements only); rolls nothing back
        when the live trainers are at ``step`` (``actors.machine.replacement_at_checkpoint``)."""
        deadline = Deadline(self.deadlines.supervisor_wait_s)
        # Replacements can form a torchft quorum of their own before the survivors join it;
        # "nobody ahead in my quorum" then does not mean every trainer died.
        decision = replacement_at_checkpoint(
            step, self._live_established_trainers(rank, deadline.remaining(self.deadlines.shard_call_s))
        )
        if decision.action == "heal":
            raise TrainerConflict(f"{decision.reason}; replacement {rank} must heal from them")
        if decision.action == "join":
            self.record_event("replacement_joined", rank=rank, step=step, reason=decision.reason)
            with self._lock:
                return {"rolled_back": False, "generation": self.generation, "shards": list(self.shards)}
        with self._fallback_lock:
            while True:
                if not self._wait_settled(deadline):
                    raise ShardUnavailable(f"shards not back within {deadline.total_s:.0f}s for the fallback")
                with self._lock:
                    shards, generation = list(self.shards), self.generation
                try:
                    states = ray.get([s.state.remote() for s in shards], timeout=deadline.remaining(self.deadlines.shard_call_s))
                    break
                except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                    with self._changed:
                        self._changed.wait_for(lambda: self.generation > generation, timeout=deadline.remaining())
            ahead = max(st["applied_step"] + 1 for st in states)
            if ahead <= step:
                # Nothing to roll back: another trainer of this incident did it already, or
                # every trainer died right at a checkpoint. The latter is still an incident.
                with self._lock:
                    if not self._same_fallback(step):
                        self._append_event("all_trainers_failed", fallback_step=step, steps_lost=0, fenced=[],
                                           rows_reloaded=0, load_s=0.0)
                        self._persist()
                return {"rolled_back": False, "generation": generation, "shards": shards}
            cause = {"actor": "all trainers", "ahead": ahead, "reported_by": rank}
            self._transition(TrainersAllDied(step, tuple(self.ckpt.chain_upto(step)), cause))
            if not self._wait_settled(deadline):
                raise ShardUnavailable(f"rollback to step {step} not done within {deadline.total_s:.0f}s")
            with self._lock:
                return {"rolled_back": True, "generation": self.generation, "shards": list(self.shards)}

    def _same_fallback(self, step: int) -> bool:
        """Whether the last every-trainer fallback went to ``step`` and nothing was committed
        since: the caller belongs to that incident (read from the journaled events, so it
        holds across a supervisor restart)."""
        last = next((e for e in reversed(self.events) if e["kind"] == "all_trainers_failed"), None)
        return last is not None and last["fallback_step"] == step and not any(s >= step for s in self.commits)

    def save_checkpoint(self, step: int, dense_blob: bytes, final: bool = False) -> dict:
        """Called by the first participating trainer right after it committed ``step``;
        ``final``: the last step of the run (a full checkpoint, whatever the schedule)."""
        with self._lock:
            if not isinstance(self.state, Running):
                return {"next_step": step + 1, "duration_s": 0.0, "saved": False}
            shards = list(self.shards)
        return self.ckpt.save(
            step, dense_blob, shards, {"run_id": self.run_id, "position": self._position(step)}, self._at_point, final
        )

    def checkpoint_due(self) -> int | None:
        return self.ckpt.next_checkpoint_step

    # ------------------------------------------------------------------ end of run

    def await_final(self, known_generation: int, step: int) -> dict:
        """Called by each trainer once the last step committed: waits until the final
        checkpoint's save (if one is in flight) committed or failed, then answers like
        ``await_shards``. A shard that dies after that is restored from the final checkpoint,
        which holds the finished state; one that died before is seen here (dead, or already
        recovered), and after a full recovery the trainers redo the steps."""
        self.ckpt.drain()
        return self.await_shards(known_generation, step)

    def record_eval(self, metrics: dict) -> None:
        self.ckpt.drain()  # the final checkpoint, written while evaluation ran, commits first
        self.eval_metrics = metrics
        self.record_event("evaluated", **{k: v for k, v in metrics.items() if k != "positive_rate"})
        self._transition(StopRequested("completed"))

    def request_stop(self, how: str = "interrupted") -> None:
        """The driver was interrupted (SIGINT/SIGTERM): trainers stop at their next step."""
        self._transition(StopRequested(how))

    def is_finished(self) -> bool:
        return isinstance(self.state, TERMINAL)

    def progress(self) -> dict | None:
        with self._lock:
            return self.progress_log[-1] if self.progress_log else None

    def events_since(self, index: int) -> list[dict]:
        with self._lock:
            return self.events[index:]

    def targets(self) -> dict[str, dict]:
        """Every killable actor of the run: its process id and node."""
        me = {"pid": os.getpid(), "node_id": ray.get_runtime_context().get_node_id()}
        with self._lock:
            out = {f"shard:{k}": {"pid": i["pid"], "node_id": i["node_id"]} for k, i in enumerate(self.shard_info)}
            out.update({f"trainer:{r}": {"pid": t["pid"], "node_id": t["node_id"]} for r, t in self.trainers.items()})
            out.update({spare_target(n): dict(self.spare_info[n]) for n in self.spares
                        if n in self.spare_info})
            out["supervisor"] = me
            return out

    def shard_handles(self) -> list:
        with self._lock:
            return list(self.shards)

    def summary(self) -> dict:
        """Everything the report needs; failures whose redo step never came are closed at
        the last committed step and their lost samples counted now."""
        self.ckpt.drain()
        with self._lock:
            final = (self.eval_metrics or {}).get("steps") or (max(self.commits) + 1 if self.commits else 0)
            todo = [f for f in self.failures if self._close(f, final)]
        self._count_lost(todo)
        try:
            shard_states = ray.get([s.state.remote() for s in self.shards], timeout=self.deadlines.shard_call_s)
        except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError, AttributeError) as err:
            shard_states = [{"error": str(err)}]
        step_time_s = self._step_time_s()
        ck = self.ckpt
        with self._lock:
            return {
                "run_id": self.run_id, "state": state_to_dict(self.state), "events": list(self.events),
                "progress": list(self.progress_log), "failures": list(self.failures), "eval": self.eval_metrics,
                "shards": shard_states, "total_steps": self.schedule.total_steps, "resumed_from_step": self.resume_step,
                "last_checkpoint_step": ck.last_checkpoint_step,
                "recovery_mode": {
                    "requested": self.cfg.recovery,
                    "used": sorted({f["recovery"] for f in self.failures}),
                    "decisions": [{"actor": f["actor"], **f["decision"]} for f in self.failures],
                },
                "checkpoint_policy": {
                    "policy": self.cfg.checkpoint.policy, "interval_steps": ck.interval_steps_in_use,
                    "interval_s": ck.interval_steps_in_use * step_time_s if ck.interval_steps_in_use and step_time_s else None,
                    "estimates": vars(self.costs.inputs(self.plan.num_shards, self.cfg.checkpoint.pls_target)),
                },
                "faults_injected": list(self.kills), "supervisor_restarts": self.supervisor_restarts,
                "trainer_failures": self.trainer_failures(),
                "commits": {
                    s: {"microbatches": sorted(c["microbatches"]), "total": c["total"], "participants": c["participants"]}
                    for s, c in sorted(self.commits.items())
                },
            }

    def shutdown(self) -> None:
        """Stops watching and recovering, and kills every shard actor of the run by name
        (half-started ones of an unfinished recovery too)."""
        self._stop.set()
        self.hosts.stop()
        self.ckpt.drain()
        self.fleet.stop()
        kill_run_shards(self.run_id, self.cfg.ray.namespace)
