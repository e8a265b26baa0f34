"""The Supervisor actor: creates the embedding shards, tells trainers how to reach them,
detects shard deaths from Ray's own signals, recovers them (partial or full, CPR), saves
checkpoints, and records every event with the numbers behind it.

Its state is small and written to ``<run_dir>/supervisor_state.json`` on every change, so a
restarted supervisor (``max_restarts``) rebuilds it from that file, the live named shards
and the checkpoint store.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import logging
import os
import queue
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import ray

from actors.checkpoint import DATA_POSITION_FILE, DENSE_FILE, FULL, INCREMENTAL, CheckpointStore, write_blob
from actors.plan import make_plan, shard_row_ids, slice_offsets
from actors.shard import EmbeddingShard
from actors.trainer import StepSchedule
from app.config import config_from_dict
from app.errors import ConfigError, ShardUnavailable, TrainerConflict
from policies import IntervalController, OnlineCostModel, RecoveryMode, decide_recovery, expected_pls, interval_steps

__all__ = ["Supervisor", "supervisor_name", "shard_name", "RunState"]

logger = logging.getLogger(__name__)

_STATE_FILE = "supervisor_state.json"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


def supervisor_name(run_id: str) -> str:
    return f"cpr-supervisor-{run_id}"


def shard_name(run_id: str, shard: int, generation: int) -> str:
    return f"cpr-shard-{run_id}-{shard}-g{generation}"


class RunState(str, enum.Enum):
    """The supervisor's state machine: trainers step only while RUNNING."""

    STARTING = "starting"
    RUNNING = "running"
    RECOVERING = "recovering"
    FINISHED = "finished"


class Supervisor:
    """One per run, a named actor: ``supervisor_name(run_id)`` in the config's namespace."""

    def __init__(self, config: dict, run_id: str, train_cache: str, eval_cache: str, num_microbatches: int):
        self.cfg = config_from_dict(config)
        self.run_id = run_id
        self.run_dir = Path(self.cfg.run_dir).resolve()
        self.plan = make_plan(
            self.cfg.embeddings.sharding, self.cfg.model.rows_per_table, self.cfg.embeddings.num_shards
        )
        tr = self.cfg.training
        self.samples_per_step = tr.microbatches_per_step * tr.microbatch_rows
        self.schedule = StepSchedule.from_config(
            num_microbatches, tr.microbatches_per_step, tr.epochs, tr.max_steps, self.cfg.seed
        )
        self.train_cache = train_cache
        self.eval_cache = eval_cache
        ck = self.cfg.checkpoint
        self.store = CheckpointStore(self.cfg.checkpoint_uri, keep_last=ck.keep_last) if ck.enabled else None
        self.costs = OnlineCostModel(
            mtbf_s=ck.mtbf_s, save_cost_s=ck.save_cost_s, load_cost_s=ck.load_cost_s,
            reschedule_cost_s=ck.reschedule_cost_s, start_s=time.time(),
        )
        self.interval_controller = IntervalController(
            self.cfg.recovery, self.costs, self.plan.num_shards, ck.pls_target
        )
        self.save_index = 0
        self.last_full_step: int | None = None
        self.interval_steps_in_use: int | None = None
        self._lock = threading.RLock()
        self._fallback_lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._stop = threading.Event()
        self.shards: list[Any] = []
        self.shard_info: list[dict] = []
        self.shard_gens = [0] * self.plan.num_shards
        self.generation = 0
        self.state = RunState.STARTING
        self.rollback: dict | None = None
        self.events: list[dict] = []
        self.progress_log: list[dict] = []
        self.failures: list[dict] = []
        self.kills: list[dict] = []
        self.trainers: dict[int, dict] = {}
        self.eval_metrics: dict | None = None
        self.resume_state: dict | None = None
        self.training_started = False
        self.last_checkpoint_step = 0
        self.next_checkpoint_step = self._after(0)
        self._watch: dict[Any, tuple[int, int]] = {}
        self._deaths: queue.Queue = queue.Queue()
        self.commits: dict[int, dict] = {}
        self.failed_steps: list[dict] = []
        self.heals: list[dict] = []
        self.max_step_seen = 0
        if ray.get_runtime_context().was_current_actor_reconstructed:
            self._rebuild()

    # ------------------------------------------------------------------ events and state

    def record_event(self, kind: str, **fields) -> dict:
        event = {"time": round(time.time(), 3), "kind": kind, **fields}
        with self._lock:
            self.events.append(event)
            self._persist()
        logger.info("event %s", event)
        return event

    def _persist(self) -> None:
        state = {
            "run_id": self.run_id,
            "shard_gens": self.shard_gens,
            "generation": self.generation,
            "events": self.events,
            "progress": self.progress_log[-200:],
            "failures": self.failures,
            "kills": self.kills,
            "trainers": {str(k): v for k, v in self.trainers.items()},
            "training_started": self.training_started,
            "last_checkpoint_step": self.last_checkpoint_step,
            "resume_step": self.resume_state["step"] if self.resume_state else None,
            "save_index": self.save_index,
            "last_full_step": self.last_full_step,
        }
        tmp = self.run_dir / f".{_STATE_FILE}.tmp"
        tmp.write_text(json.dumps(state, default=str))
        os.replace(tmp, self.run_dir / _STATE_FILE)

    def _rebuild(self) -> None:
        """After a restart: state from the file, shards from their names, checkpoints from the store."""
        t0 = time.time()
        state = json.loads((self.run_dir / _STATE_FILE).read_text())
        self.shard_gens = state["shard_gens"]
        self.generation = state["generation"]
        self.events = state["events"]
        self.progress_log = state["progress"]
        self.failures = state["failures"]
        self.kills = state["kills"]
        self.trainers = {int(k): v for k, v in state["trainers"].items()}
        self.training_started = state["training_started"]
        self.last_checkpoint_step = state["last_checkpoint_step"]
        self.save_index = state["save_index"]
        self.last_full_step = state["last_full_step"]
        if self.store is not None:
            committed = self.store.list_committed()
            self.last_checkpoint_step = max([self.last_checkpoint_step, *committed])
        self.next_checkpoint_step = self._after(self.last_checkpoint_step)
        ns = self.cfg.ray.namespace
        self.shards, self.shard_info, missing = [], [], []
        for k, g in enumerate(self.shard_gens):
            try:
                shard = ray.get_actor(shard_name(self.run_id, k, g), namespace=ns)
                info = ray.get(shard.ready.remote(), timeout=self.cfg.embeddings.call_timeout_s)
            except (ValueError, ray.exceptions.RayError, ray.exceptions.GetTimeoutError):
                # Died while this supervisor was down (or mid-recovery): recover it now.
                shard, info = None, {"pid": None, "node_id": None}
                missing.append(k)
            self.shards.append(shard)
            self.shard_info.append(info)
        kill = next((k for k in reversed(self.kills) if k["target"] == "supervisor"), None)
        self.state = RunState.RUNNING
        self._start_watching()
        for k in missing:
            self._deaths.put((k, self.shard_gens[k], "not found after supervisor restart", time.time()))
        self.record_event(
            "supervisor_restarted",
            rebuilt_s=round(time.time() - t0, 3),
            detection_s=round(t0 - kill["time"], 3) if kill else None,
            shards_found=len(self.shards),
            last_checkpoint_step=self.last_checkpoint_step,
        )

    # ------------------------------------------------------------------ shards

    def _spawn_shard(self, k: int, generation: int):
        emb = self.cfg.embeddings
        ck = self.cfg.checkpoint
        # Detached: the shards outlive a supervisor restart; shutdown() and the driver's
        # cleanup remove them. The extra concurrency group runs watch() beside the compute.
        actor_cls = ray.remote(concurrency_groups={"watch": 1})(EmbeddingShard)
        return actor_cls.options(
            name=shard_name(self.run_id, k, generation),
            namespace=self.cfg.ray.namespace,
            lifetime="detached",
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
            priority={"policy": ck.policy, "r": ck.r, "sample_rate": ck.sample_rate, "full_every": ck.full_every},
        )

    def _ready(self, shards: list) -> list[dict]:
        try:
            return ray.get([s.ready.remote() for s in shards], timeout=self.cfg.embeddings.call_timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise ShardUnavailable(
                f"{len(shards)} shard(s) did not start within embeddings.call_timeout_s="
                f"{self.cfg.embeddings.call_timeout_s}s"
            ) from None

    def start(self) -> dict:
        """Creates every shard and waits until each answers; returns their identities."""
        t = time.perf_counter()
        self.shards = [self._spawn_shard(k, 0) for k in range(self.plan.num_shards)]
        self.shard_info = self._ready(self.shards)
        startup_s = time.perf_counter() - t
        with self._lock:
            self.state = RunState.RUNNING
        self._start_watching()
        self.record_event(
            "shards_ready",
            shards=self.plan.num_shards,
            sharding=self.plan.kind,
            rows=[self.plan.shard_rows(k) for k in range(self.plan.num_shards)],
            startup_s=round(startup_s, 3),
        )
        return {"shards": self.shard_info, "startup_s": startup_s, "total_steps": self.schedule.total_steps}

    def _start_watching(self) -> None:
        for k, shard in enumerate(self.shards):
            if shard is None:
                continue
            self._watch[shard.watch.options(concurrency_group="watch").remote()] = (k, self.shard_gens[k])
        # Detection and recovery on separate threads: a death during another shard's
        # recovery is still seen (and timed) at once.
        threading.Thread(target=self._watch_loop, name="shard-watch", daemon=True).start()
        threading.Thread(target=self._recovery_loop, name="shard-recovery", daemon=True).start()

    def _recovery_loop(self) -> None:
        while not self._stop.is_set():
            try:
                k, gen, cause, detected = self._deaths.get(timeout=0.5)
            except queue.Empty:
                continue
            try:
                self._recover_shard(k, gen, cause, detected)
            except Exception as err:
                self.record_event("recovery_failed", actor=f"shard:{k}", error=repr(err))
                logger.exception("recovery of shard %d failed", k)

    def _watch_loop(self) -> None:
        while not self._stop.is_set():
            refs = list(self._watch)
            if not refs:
                self._stop.wait(0.2)
                continue
            ready, _ = ray.wait(refs, num_returns=1, timeout=0.2)
            for ref in ready:
                k, gen = self._watch.pop(ref)
                try:
                    ray.get(ref)
                    cause = "watch returned"
                except ray.exceptions.RayActorError as err:
                    cause = type(err).__name__
                except Exception as err:  # an unexpected error still means the shard is gone
                    cause = repr(err)
                if not self._stop.is_set():
                    self._deaths.put((k, gen, cause, time.time()))

    def report_shard_failure(self, k: int, generation: int, reason: str, step: int) -> None:
        """A trainer's call to shard ``k`` failed or timed out at ``step``. A shard that hangs
        is killed, so that hangs and deaths take the same recovery path (the watch sees the
        death)."""
        with self._lock:
            self.max_step_seen = max(self.max_step_seen, step)
            if generation != self.generation or self.state != RunState.RUNNING:
                return
            shard = self.shards[k]
        logger.warning("trainer reports shard %d unavailable (%s); killing it", k, reason)
        ray.kill(shard, no_restart=True)

    def _recovery_mode(self) -> tuple[RecoveryMode, dict]:
        requested = RecoveryMode(self.cfg.recovery)
        decision = decide_recovery(
            requested, self.costs.inputs(self.plan.num_shards, self.cfg.checkpoint.pls_target)
        )
        return decision.mode, {"mode": decision.mode.value, "requested": requested.value, "reason": decision.reason}

    def _recover_shard(self, k: int, generation: int, cause: str, detected: float) -> None:
        with self._lock:
            if generation != self.shard_gens[k] or self.state == RunState.FINISHED:
                return
            self.state = RunState.RECOVERING
            self._persist()
        kill = next((x for x in reversed(self.kills) if x["target"] == f"shard:{k}" and x["time"] <= detected), None)
        self.costs.observe_failure(detected)
        mode, decision = self._recovery_mode()
        survivors = [s for i, s in enumerate(self.shards) if i != k and s is not None]
        # The steps the dead shard had trained: what survivors applied, what trainers were
        # at when their calls failed, and the last progress report, whichever is furthest.
        try:
            states = ray.get([s.state.remote() for s in survivors], timeout=self.cfg.embeddings.call_timeout_s)
            applied = [st["applied_step"] + 1 for st in states]
        except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError):
            applied = []
        with self._lock:
            steps_done = max([self.last_checkpoint_step, self.max_step_seen, *applied])
        t_spawn = time.time()
        new_gen = self.shard_gens[k] + 1
        new_shard = self._spawn_shard(k, new_gen)
        info = self._ready([new_shard])[0]
        reschedule_s = time.time() - t_spawn
        self.costs.observe_reschedule(reschedule_s)
        t_load = time.time()
        if mode == RecoveryMode.FULL:
            chain = self._consistent_chain()
        else:
            chain = self.store.chain_steps() if self.store is not None else []
        restored_step = chain[-1] if chain else 0
        uri = self.cfg.checkpoint_uri
        timeout = self.cfg.embeddings.call_timeout_s
        if mode == RecoveryMode.PARTIAL:
            to_load = [new_shard]
        else:
            to_load = survivors + [new_shard]
        if chain:
            loaded = ray.get([s.load_checkpoint.remote(uri, chain) for s in to_load], timeout=timeout)
        else:
            # No checkpoint yet: the state of step 0 is the initial rows.
            ray.get([s.reset_to_init.remote() for s in to_load if s is not new_shard], timeout=timeout)
            loaded = [{"rows": 0, "bytes": 0}]
        load_s = time.time() - t_load
        if chain:
            self.costs.observe_load(load_s)
        lost_steps = max(steps_done - restored_step, 0)
        failure = {
            "actor": f"shard:{k}",
            "cause": cause,
            "recovery": mode.value,
            "decision": decision,
            "killed_at": kill["time"] if kill else None,
            "detected_at": round(detected, 3),
            "detection_s": round(detected - kill["time"], 3) if kill else None,
            "reschedule_s": round(reschedule_s, 3),
            "load_s": round(load_s, 3),
            "recovery_s": round(time.time() - detected, 3),
            "restored_step": restored_step,
            "chain": chain,
            "failed_at_step": steps_done,
            "rows_reloaded": sum(x["rows"] for x in loaded),
            "bytes_reloaded": sum(x["bytes"] for x in loaded),
        }
        if mode == RecoveryMode.PARTIAL:
            new_loaded = loaded[-1] if chain else {"incremental_rows": []}
            failure["lost_samples"] = self._lost_samples(k, chain, new_loaded["incremental_rows"], steps_done)
            failure["lost_steps_recomputed"] = 0
        else:
            failure["lost_samples"] = 0.0
            failure["lost_steps_recomputed"] = lost_steps
        with self._lock:
            self.shards[k] = new_shard
            self.shard_info[k] = info
            self.shard_gens[k] = new_gen
            self.generation += 1
            if mode == RecoveryMode.FULL:
                self.max_step_seen = restored_step
                self.commits = {s: c for s, c in self.commits.items() if s < restored_step}
                dense = self.store.read_blob(restored_step, DENSE_FILE) if chain else None
                self.rollback = {"generation": self.generation, "step": restored_step, "dense": dense}
            else:
                self.rollback = None
            self.failures.append(failure)
            self.state = RunState.RUNNING
            self._watch[new_shard.watch.options(concurrency_group="watch").remote()] = (k, new_gen)
            self._changed.notify_all()
        self.record_event("shard_recovered", **failure)

    def _lost_samples(self, k: int, chain: list[int], incremental_rows: list, steps_done: int) -> float:
        """Samples whose updates to shard ``k`` were lost, counted per row: an access at step
        t to a row last saved at step c <= t is lost. Each sample touches one row per table,
        so a lost access is 1/26 of a sample (CPR's PLS numerator, finer than one loss
        fraction per shard when MFU/SSU saved rows at different steps)."""
        from app.cache import MicrobatchFile
        from app.data import NUM_SPARSE, sparse_to_rows

        saved_at = np.full(self.plan.shard_rows(k), chain[0] if chain else 0, dtype=np.int64)
        for step, rows in incremental_rows:
            saved_at[rows] = step
        offsets = slice_offsets(self.plan.shards[k])
        data = MicrobatchFile(self.train_cache)
        lost_accesses = 0
        for t in range(int(saved_at.min()), steps_done):
            for m in range(self.schedule.microbatches_per_step):
                rows = sparse_to_rows(data.get(self.schedule.microbatch(t, m))[2], self.cfg.model.rows_per_table)
                sb = self.plan.route(rows, k)
                ids = shard_row_ids(sb.lengths, sb.indices, offsets)
                lost_accesses += int((saved_at[ids] <= t).sum())
        return lost_accesses / NUM_SPARSE

    def await_shards(self, known_generation: int) -> dict:
        """Called by a trainer after a failed step. Returns the current shard handles, their
        generation and, after a full recovery, the step and dense state to roll back to.

        It does not answer "nothing changed" while a shard is dead but not yet recovered: a
        trainer whose own calls succeeded could otherwise redo the step with stale state
        while the others roll back. So on an unchanged generation it probes the shards and
        waits for the recovery of any that is gone.
        """
        deadline = time.monotonic() + self.cfg.embeddings.call_timeout_s * 2
        while time.monotonic() < deadline:
            with self._changed:
                self._changed.wait_for(lambda: self.state != RunState.RECOVERING, timeout=deadline - time.monotonic())
                generation = self.generation
                shards = list(self.shards)
                if generation > known_generation or self.state == RunState.FINISHED:
                    rollback = self.rollback if self.rollback and self.rollback["generation"] > known_generation else None
                    return {"generation": generation, "shards": shards, "rollback": rollback}
            try:
                ray.get([s.state.remote() for s in shards], timeout=self.cfg.embeddings.call_timeout_s)
                return {"generation": generation, "shards": shards, "rollback": None}
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                with self._changed:
                    self._changed.wait_for(lambda: self.generation > generation, timeout=deadline - time.monotonic())
        raise ShardUnavailable(
            f"shards not recovered within 2 x embeddings.call_timeout_s={self.cfg.embeddings.call_timeout_s}s"
        )

    # ------------------------------------------------------------------ trainers

    def trainer_setup(self) -> dict:
        """What a trainer needs: shard handles, the plan, the data, the step schedule, the
        step to resume from with its dense state, and when the next checkpoint is due."""
        with self._lock:
            return {
                "shards": list(self.shards),
                "generation": self.generation,
                "plan": self.plan,
                "schedule": self.schedule,
                "train_cache": self.train_cache,
                "eval_cache": self.eval_cache,
                "resume": self.resume_state if not self.training_started else self._restart_state(),
                "training_started": self.training_started,
                "finished": self.state == RunState.FINISHED,
                "next_checkpoint_step": self.next_checkpoint_step,
            }

    def _consistent_chain(self) -> list[int]:
        """The newest state that every shard and the dense model share: the newest valid full
        checkpoint, alone. An MFU/SSU incremental saves only its prioritized rows, so a chain
        through incrementals holds rows last saved at different steps. That is what partial
        recovery loads into the one respawned shard (and counts per row as lost samples); a
        rollback of everything (full recovery, every trainer dead, --resume) needs one step."""
        chain = self.store.chain_steps() if self.store is not None else []
        return chain[:1]

    def _restart_state(self) -> dict:
        """For a trainer started after training began (Ray Train replaced it): the last
        consistent checkpoint's step and dense state. A live peer further ahead heals it
        instead; if no trainer is alive, the run falls back to exactly this checkpoint."""
        chain = self._consistent_chain()
        if not chain:
            return {"step": 0, "dense": None}
        return {"step": chain[-1], "dense": self.store.read_blob(chain[-1], DENSE_FILE)}

    def fallback_to_checkpoint(self, step: int, rank: int) -> bool:
        """Every trainer died and the new ones start at checkpoint ``step``: roll the shards
        back to it too, so dense and embedding state agree. Idempotent (several trainers
        call it); waits for a shard that is being recovered. Returns whether it rolled back."""
        timeout = self.cfg.embeddings.call_timeout_s
        deadline = time.monotonic() + timeout * 2
        live = self._live_established_trainers(exclude=rank)
        if live:
            # Replacements can form a torchft quorum of their own before the survivors join
            # it; "nobody ahead in my quorum" then does not mean every trainer died.
            raise TrainerConflict(
                f"trainer(s) {live} are alive and ahead; replacement {rank} must heal from them, not fall back"
            )
        with self._fallback_lock:
            while True:
                with self._changed:
                    self._changed.wait_for(lambda: self.state != RunState.RECOVERING, timeout=timeout)
                    shards, generation = list(self.shards), self.generation
                try:
                    states = ray.get([sh.state.remote() for sh in shards], timeout=timeout)
                    break
                except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                    if time.monotonic() > deadline:
                        raise ShardUnavailable(f"shards not back within {2 * timeout}s for the fallback") from None
                    with self._changed:
                        self._changed.wait_for(lambda: self.generation > generation, timeout=timeout)
            ahead = max(st["applied_step"] + 1 for st in states)
            if ahead <= step:
                return False
            t0 = time.time()
            if step > 0:
                chain = self.store.chain_steps(step)
                loaded = ray.get([sh.load_checkpoint.remote(self.cfg.checkpoint_uri, chain) for sh in shards], timeout=timeout)
            else:
                ray.get([sh.reset_to_init.remote() for sh in shards], timeout=timeout)
                loaded = [{"rows": 0, "bytes": 0}]
            with self._lock:
                self.commits = {s: c for s, c in self.commits.items() if s < step}
                self.max_step_seen = step
        self.record_event(
            "all_trainers_failed",
            fallback_step=step,
            steps_lost=ahead - step,
            rows_reloaded=sum(x["rows"] for x in loaded),
            load_s=round(time.time() - t0, 3),
            reported_by=rank,
        )
        return True

    def _live_established_trainers(self, exclude: int) -> list[int]:
        """Ranks other than ``exclude`` whose current process has committed a step and is alive."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        with self._lock:
            candidates = {
                r: t for r, t in self.trainers.items()
                if r != exclude and t.get("committed_at", 0) > t["registered"] and t["pid"] is not None
            }
        probe = ray.remote(num_cpus=0, max_retries=0)(_pid_alive)
        refs = {
            r: probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(t["node_id"], soft=False)).remote(t["pid"])
            for r, t in candidates.items()
        }
        return sorted(r for r, ref in refs.items() if ray.get(ref, timeout=self.cfg.embeddings.call_timeout_s))

    def record_commit(
        self, step: int, rank: int, microbatches: tuple[int, ...], total: int, participants: int, wall_time: float
    ) -> None:
        """A trainer's share of a committed dense step (its microbatch ids) and the step's
        microbatch total as the all-reduce summed it (the same on every trainer, so one
        surviving report is enough)."""
        with self._lock:
            entry = self.commits.setdefault(
                step, {"microbatches": [], "total": total, "participants": participants, "time": wall_time}
            )
            entry["microbatches"].extend(microbatches)
            if rank in self.trainers:
                self.trainers[rank]["committed_at"] = wall_time

    def record_step_failed(self, step: int, rank: int, wall_time: float, cause: str) -> None:
        with self._lock:
            self.failed_steps.append({"step": step, "rank": rank, "time": wall_time, "cause": cause})

    def record_trainer_healed(self, rank: int, step: int, heal_s: float, wall_time: float) -> None:
        """A replacement trainer took its first share of a step after healing from a peer."""
        with self._lock:
            self.heals.append({"rank": rank, "step": step, "heal_s": heal_s, "time": wall_time})
        self.record_event("trainer_healed", rank=rank, step=step, heal_s=round(heal_s, 3))

    def _trainer_failures(self) -> list[dict]:
        """One record per killed trainer: detection, steps with fewer trainers, heal time."""
        out = []
        full = self.cfg.training.num_trainers
        for kill in (k for k in self.kills if k["target"].startswith("trainer:")):
            rank = int(kill["target"].split(":")[1])
            # Detected when the survivors first act on it: a failed step, or a commit by a
            # smaller quorum (the synchronous quorum often drops the dead trainer at once).
            seen = sorted(
                [f["time"] for f in self.failed_steps if f["time"] >= kill["time"]]
                + [c["time"] for c in self.commits.values() if c["time"] >= kill["time"] and c["participants"] < full]
            )
            heal = next((h for h in self.heals if h["rank"] == rank and h["time"] >= kill["time"]), None)
            end = heal["time"] if heal else float("inf")
            degraded = sorted(
                s for s, c in self.commits.items() if kill["time"] <= c["time"] <= end and c["participants"] < full
            )
            out.append(
                {
                    "actor": kill["target"],
                    "killed_at": kill["time"],
                    "detection_s": round(seen[0] - kill["time"], 3) if seen else None,
                    "steps_with_fewer_trainers": len(degraded),
                    "heal_s": round(heal["heal_s"], 3) if heal else None,
                    "rejoined_s": round(heal["time"] - kill["time"], 3) if heal else None,
                    "replacement_joined_at_step": heal["step"] if heal else None,
                }
            )
        return out

    def register_trainer(self, rank: int, pid: int | None = None, node_id: str | None = None) -> bool:
        """A trainer is ready to step. Returns True once the first step may begin: every
        trainer of the group has registered, or training is already under way (a
        replacement trainer joins the running quorum and heals from a peer)."""
        with self._lock:
            self.trainers[rank] = {"pid": pid, "node_id": node_id, "registered": time.time()}
            self._persist()
            return self.training_started or len(self.trainers) >= self.cfg.training.num_trainers

    def record_training_started(self, step: int, trainers: int, wall_time: float) -> None:
        with self._lock:
            if self.training_started:
                return
            self.training_started = True
        self.record_event("training_started", step=step, trainers=trainers, wall_time=wall_time)

    def record_progress(self, progress: dict) -> None:
        with self._lock:
            self.max_step_seen = max(self.max_step_seen, progress["step"])
            self.progress_log.append({"time": round(time.time(), 3), **progress})

    def record_eval(self, metrics: dict) -> None:
        self.eval_metrics = metrics
        with self._lock:
            self.state = RunState.FINISHED
        self.record_event("evaluated", **{k: v for k, v in metrics.items() if k != "positive_rate"})

    def is_finished(self) -> bool:
        return self.state == RunState.FINISHED

    def progress(self) -> dict | None:
        with self._lock:
            return self.progress_log[-1] if self.progress_log else None

    def events_since(self, index: int) -> list[dict]:
        with self._lock:
            return self.events[index:]

    # ------------------------------------------------------------------ chaos

    def targets(self) -> dict[str, dict]:
        """Every killable actor of the run: its process id and node."""
        me = {"pid": os.getpid(), "node_id": ray.get_runtime_context().get_node_id()}
        with self._lock:
            out = {f"shard:{k}": {"pid": i["pid"], "node_id": i["node_id"]} for k, i in enumerate(self.shard_info)}
            out.update({f"trainer:{r}": {"pid": t["pid"], "node_id": t["node_id"]} for r, t in self.trainers.items()})
            out["supervisor"] = me
            return out

    def record_kill(self, target: str, wall_time: float) -> None:
        """The chaos tool says it is about to kill ``target``: the start of detection time."""
        with self._lock:
            self.kills.append({"target": target, "time": wall_time})
            self._persist()

    # ------------------------------------------------------------------ checkpoints

    def _step_time_s(self) -> float | None:
        with self._lock:
            rates = [p["samples_per_s"] for p in self.progress_log[-5:] if p.get("samples_per_s")]
        if not rates:
            return None
        return self.samples_per_step / (sum(rates) / len(rates))

    def _after(self, step: int) -> int | None:
        """The step count at which the next checkpoint is due, or None when saves are off.

        MFU/SSU saves write r of the rows, 1/r times as often as full saves would come.
        With ``auto_interval`` the interval comes from the CPR cost model and is re-chosen
        (and logged) as the online estimates change.
        """
        ck = self.cfg.checkpoint
        if not ck.enabled:
            return None
        scale = ck.r if ck.policy != "full" else 1.0
        step_time_s = self._step_time_s()
        candidates = []
        if ck.every_steps is not None:
            candidates.append(max(1, round(ck.every_steps * scale)))
        if ck.every_s is not None:
            candidates.append(
                interval_steps(ck.every_s * scale, step_time_s) if step_time_s else self.cfg.training.progress_every_steps
            )
        if ck.auto_interval:
            decision, change = self.interval_controller.update()
            steps = (
                interval_steps(decision.interval_s * scale, step_time_s)
                if step_time_s
                else self.cfg.training.progress_every_steps
            )
            candidates.append(steps)
            if change is not None or steps != self.interval_steps_in_use:
                self.record_event(
                    "interval_changed",
                    interval_s=round(decision.interval_s * scale, 3),
                    interval_steps=steps,
                    step_time_s=round(step_time_s, 4) if step_time_s else None,
                    mode=decision.mode.value,
                    reason=change.reason if change is not None else "measured step time changed",
                )
        self.interval_steps_in_use = min(candidates)
        return step + self.interval_steps_in_use

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
            "samples_trained": step * self.samples_per_step,
        }

    def save_checkpoint(self, step: int, dense_blob: bytes) -> dict:
        """A full, consistent checkpoint after ``step`` committed steps: every shard writes
        its own file, the dense state and data position are written here, the manifest last.
        Called by the first participating trainer right after it committed ``step``.
        """
        if self.store is None:
            raise ConfigError("checkpoint: every_steps or every_s must be set to save checkpoints")
        if step in self.store.list_committed():
            # A call retried after a supervisor restart: the save already happened.
            return {"next_step": self.next_checkpoint_step, "duration_s": 0.0}
        t0 = time.perf_counter()
        uri = self.cfg.checkpoint_uri
        with self._lock:
            shards = list(self.shards)
            save_index = self.save_index
        refs = [shard.save_checkpoint.remote(uri, step, save_index) for shard in shards]
        entries = [
            write_blob(uri, step, DENSE_FILE, dense_blob),
            write_blob(uri, step, DATA_POSITION_FILE, json.dumps(self._position(step)).encode()),
        ]
        try:
            results = ray.get(refs, timeout=self.cfg.embeddings.call_timeout_s)
        except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError) as err:
            # A shard died or lags behind (just recovered): no manifest, so this checkpoint
            # does not exist; the trainer asks again at a later step.
            self.record_event("checkpoint_failed", step=step, error=str(err).splitlines()[0][:200])
            return {"next_step": step + 1, "duration_s": time.perf_counter() - t0}
        entries += [r["entry"] for r in results]
        full = all(r["full"] for r in results)
        if not full and self.last_full_step is None:
            raise RuntimeError(f"incremental save at step {step} without a full checkpoint before it")
        info = self.store.commit(
            step,
            entries,
            kind=FULL if full else INCREMENTAL,
            base_step=None if full else self.last_full_step,
            meta={"run_id": self.run_id, "save_index": save_index, "policy": self.cfg.checkpoint.policy},
        )
        duration_s = time.perf_counter() - t0
        self.costs.observe_save(duration_s)
        with self._lock:
            self.save_index += 1
            if full:
                self.last_full_step = step
            self.last_checkpoint_step = step
            self.next_checkpoint_step = self._after(step)
        self.record_event(
            "checkpoint_saved",
            step=step,
            checkpoint_kind=info.kind,
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
        steps = self._consistent_chain()
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
        return self.record_event(
            "resumed",
            step=step,
            chain=steps,
            rows_loaded=sum(x["rows"] for x in loaded),
            bytes_loaded=sum(x["bytes"] for x in loaded),
            duration_s=round(time.perf_counter() - t0, 4),
        )

    # ------------------------------------------------------------------ end of run

    def summary(self) -> dict:
        """Everything the report needs, including each shard's counters."""
        try:
            shard_states = ray.get([s.state.remote() for s in self.shards], timeout=self.cfg.embeddings.call_timeout_s)
        except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError) as err:
            shard_states = [{"error": str(err)}]
        step_time_s = self._step_time_s()
        with self._lock:
            return {
                "run_id": self.run_id,
                "events": list(self.events),
                "progress": list(self.progress_log),
                "failures": list(self.failures),
                "eval": self.eval_metrics,
                "shards": shard_states,
                "total_steps": self.schedule.total_steps,
                "resumed_from_step": self.resume_state["step"] if self.resume_state else None,
                "last_checkpoint_step": self.last_checkpoint_step,
                "recovery_mode": self._recovery_mode()[1],
                "checkpoint_policy": {
                    "policy": self.cfg.checkpoint.policy,
                    "interval_steps": self.interval_steps_in_use,
                    "interval_s": (
                        self.interval_steps_in_use * step_time_s if self.interval_steps_in_use and step_time_s else None
                    ),
                    "estimates": dataclasses.asdict(self.costs.inputs(self.plan.num_shards, self.cfg.checkpoint.pls_target)),
                },
                "trainer_failures": self._trainer_failures(),
                "commits": {
                    s: {"microbatches": sorted(c["microbatches"]), "total": c["total"], "participants": c["participants"]}
                    for s, c in sorted(self.commits.items())
                },
            }

    def shard_handles(self) -> list:
        with self._lock:
            return list(self.shards)

    def shutdown(self) -> None:
        """Stops watching and kills the (detached) shards."""
        self._stop.set()
        with self._lock:
            self.state = RunState.FINISHED
            shards = list(self.shards)
        for shard in shards:
            ray.kill(shard, no_restart=True)
