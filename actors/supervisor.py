"""The Supervisor actor: the facade trainers, the driver and the chaos tool call.

Recovery is the state machine of ``actors.machine``; ``_transition`` is the only place the
state changes, and it persists the new state (the intent: which shards, which generations,
which chain) to the journal before the executor thread acts on it. A supervisor that Ray
restarts at any point reloads the journal, re-acquires its shards by name and runs the state
in flight again (every step of it is idempotent).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from pathlib import Path

import ray

from core.accounting import chain_rows, count_lost_samples
from actors.checkpointing import CheckpointCoordinator
from core.deadlines import Deadlines
from actors.faults import sigkill_on_node
from actors.fleet import ShardFleet, shard_name, spare_name, spare_target
from actors.nodes import HostWatch
from core.journal import Journal, RunLog
from actors.machine import (
    EVERY_TRAINER_DIED, FULL_RECOVERY, RECOVERING, RESUME, TERMINAL, BudgetExceeded, Budgets, RecoveringShards,
    RespawnRetry, RollingBack, Running, ShardDied, WorkDone, state_from_dict, state_to_dict, transition,
)
from actors.metrics import RunMetrics
from core.plan import make_plan
from actors.recovery import RecoveryExecutor, ShardsLost
from actors.supervisor_api import RunApi
from actors.supervisor_trainers import TrainerBook
from core.schedule import StepSchedule
from core.config import config_from_dict
from core.logs import LOG_DIR, configure_process_logging
from policies import OnlineCostModel, RecoveryMode, decide_recovery

__all__ = ["Supervisor", "supervisor_name", "shard_name"]

logger = logging.getLogger(__name__)


def supervisor_name(run_id: str) -> str:
    return f"cpr-supervisor-{run_id}"


class Supervisor(RunApi, TrainerBook):
    """One per run, a named actor: ``supervisor_name(run_id)`` in the config's namespace."""

    def __init__(self, config: dict, run_id: str, train_cache: str, eval_cache: str, num_microbatches: int):
        self.cfg = cfg = config_from_dict(config)
        self.run_id = run_id
        self.run_dir = Path(cfg.run_dir).resolve()
        configure_process_logging(self.run_dir / LOG_DIR, "supervisor", ray.util.get_node_ip_address())
        self.plan = make_plan(cfg.embeddings.sharding, cfg.model.rows_per_table, cfg.embeddings.num_shards)
        tr = cfg.training
        self.samples_per_step = tr.microbatches_per_step * tr.microbatch_rows
        self.schedule = StepSchedule.from_config(num_microbatches, tr.microbatches_per_step, tr.epochs, tr.max_steps, cfg.seed)
        self.train_cache, self.eval_cache = train_cache, eval_cache
        self.deadlines = Deadlines(cfg.embeddings.call_timeout_s)
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)
        self._fallback_lock = threading.Lock()
        self._work = threading.Event()
        self._stop = threading.Event()
        self._outcome = None
        ck = cfg.checkpoint
        self.costs = OnlineCostModel(
            mtbf_s=ck.mtbf_s, save_cost_s=ck.save_cost_s, load_cost_s=ck.load_cost_s,
            reschedule_cost_s=ck.reschedule_cost_s, start_s=time.time(),
        )
        self.ckpt = CheckpointCoordinator(cfg, self.plan.num_shards, self.costs, self.record_event, self._step_time_s)
        audit = str(self.run_dir / "audit") if cfg.audit_log else None
        self.hosts = HostWatch(self._actor_nodes, self._on_host_lost)
        self._deaths: list[tuple] = []  # (node id, actor, detected at) of each shard death
        self._move_tried: set = set()  # nodes a spare was moved to (_misplaced_spare)
        self.fleet = ShardFleet(
            cfg, self.plan, run_id, audit, self._on_death, self._on_spare_death, self._occupied, self.hosts.suspects
        )
        self.executor = RecoveryExecutor(self.fleet, self.ckpt, cfg.checkpoint_uri, cfg.embeddings.call_timeout_s, self._at_point)
        self.journal = Journal(self.run_dir)
        n = self.plan.num_shards
        self.state = Running()
        self.shards: list = [None] * n
        self.shard_info = [{"pid": None, "node_id": None} for _ in range(n)]
        self.shard_gens = [0] * n  # generation of each shard in the live fleet
        self.next_gens = [0] * n  # lowest generation never reserved, per shard
        self.live_since: list[int | None] = [0] * n  # first step the live actor of each shard applies
        self.shard_names = [shard_name(run_id, k, 0) for k in range(n)]  # the actor serving each shard
        self.spares: list[str] = []  # warm spares ready to adopt, oldest first
        self.spares_starting: list[str] = []  # reserved in the journal before they are spawned
        self.spare_info: dict[str, dict] = {}  # name -> pid, node, start time (chaos targets, report)
        self.next_spare = 0
        self._spare_wake = threading.Event()
        self._spare_keeper: threading.Thread | None = None
        self.generation = 0  # bumped whenever the fleet or the timeline changes
        self.rollback: dict | None = None
        self.events: list[dict] = []
        self.failures: list[dict] = []
        self.eval_metrics: dict | None = None
        self.resume_step: int | None = None
        self.started = False
        self.start_error: str | None = None
        self.supervisor_restarts = 0
        self.fired: list[str] = []
        TrainerBook.__init__(self)
        # Defect fixed: nothing is written before a restarted supervisor has read its journal.
        restarted = ray.get_runtime_context().was_current_actor_reconstructed and self.journal.exists()
        self.run_log = RunLog(self.run_dir, fresh=not restarted)
        self.metrics = RunMetrics(run_id, self.samples_per_step)
        if restarted:
            self._rebuild()
        threading.Thread(target=self._executor_loop, name="recovery-executor", daemon=True).start()

    # ------------------------------------------------------------------ journal

    def _persist(self) -> None:
        with self._lock:
            doc = {
                "run_id": self.run_id, "state": state_to_dict(self.state), "shard_gens": self.shard_gens,
                "next_gens": self.next_gens, "live_since": self.live_since, "generation": self.generation,
                "rollback": self.rollback, "events": self.events, "failures": self.failures,
                "resume_step": self.resume_step, "started": self.started, "fired": self.fired,
                "shard_names": self.shard_names, "spares": self.spares, "spares_starting": self.spares_starting,
                "spare_info": self.spare_info, "next_spare": self.next_spare,
                "supervisor_restarts": self.supervisor_restarts, "schedule": self.ckpt.to_doc(),
                "costs": {k: v for k, v in vars(self.costs).items() if isinstance(v, (int, float))},
                "eval": self.eval_metrics, **self.trainer_doc(),
            }
            self.journal.write(doc)

    def _rebuild(self) -> None:
        t0 = time.time()
        doc = self.journal.load()
        self.state = state_from_dict(doc["state"])
        for key in ("shard_gens", "next_gens", "live_since", "generation", "rollback", "events", "failures",
                    "resume_step", "started", "fired", "supervisor_restarts", "shard_names", "spares",
                    "spares_starting", "spare_info", "next_spare"):
            setattr(self, key, doc[key])
        self.eval_metrics = doc["eval"]
        self.ckpt.load_doc(doc["schedule"])
        vars(self.costs).update(doc["costs"])
        self.load_trainer_doc(doc)
        self.run_log.rewrite_events(self.events)
        self.supervisor_restarts += 1
        missing = []
        for k, gen in enumerate(self.shard_gens):
            handle = self.fleet.find_name(self.shard_names[k]) if self.started else None
            try:
                info = ray.get(handle.ready.remote(), timeout=self.deadlines.shard_call_s) if handle else None
            except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError):
                info = None
            if info is None:
                missing.append(k)
            else:
                self.shards[k], self.shard_info[k] = handle, info
                self.fleet.watch(k, gen, handle)
        self._persist()
        kill = next((k for k in reversed(self.kills) if k["target"] == "supervisor"), None)
        self.record_event(
            "supervisor_restarted", rebuilt_s=round(time.time() - t0, 3), state=self.state.name,
            detection_s=round(t0 - kill["time"], 3) if kill else None, restarts=self.supervisor_restarts,
            shards_found=self.plan.num_shards - len(missing), last_checkpoint_step=self.ckpt.last_checkpoint_step,
        )
        budget = self.cfg.budgets.max_supervisor_restarts
        if 0 <= budget < self.supervisor_restarts:
            self._transition(BudgetExceeded(
                f"budget budgets.max_supervisor_restarts={budget} exceeded: {self.supervisor_restarts} restarts"
            ))
        for k in missing:
            if self.started:
                self._on_death(k, self.shard_gens[k], "not found after supervisor restart", time.time())
        # Counts that were in flight when the previous supervisor died.
        uncounted = [f for f in self.failures if f["recovery"] == "partial" and f["failed_at_step"] is not None
                     and f["lost_samples"] is None]
        self._count_lost_later(uncounted)
        self._readopt_spares()
        if self.started:
            self.hosts.start()
        self._work.set()

    def record_event(self, kind: str, **fields) -> dict:
        with self._lock:
            event = self._append_event(kind, **fields)
            self._persist()
        return event

    def _append_event(self, kind: str, event_time: float | None = None, **fields) -> dict:
        """Adds an event without writing the journal; the caller persists (under the lock)."""
        event = {"time": round(time.time() if event_time is None else event_time, 3), "kind": kind, **fields}
        self.events.append(event)
        self.run_log.event(event)
        self.metrics.event(event, self._trainer_failure_of(event) if kind == "trainer_healed" else None)
        logger.info("event %s", event)
        return event

    def _trainer_failure_of(self, healed: dict) -> dict | None:
        """The trainer failure a heal ended (detection and rejoin times), if its kill is known."""
        mine = [t for t in self.trainer_failures() if t["actor"] == f"trainer:{healed['rank']}" and t["rejoined_s"] is not None]
        return mine[-1] if mine else None

    # ------------------------------------------------------------------ transitions

    def _transition(self, event) -> bool:
        """The only place the state changes: decide, persist the intent, then wake the executor."""
        with self._lock:
            pending = len(self.state.targets) if isinstance(self.state, RECOVERING) else 0
            budgets = Budgets(len(self.failures) + pending, self.cfg.budgets.max_shard_recoveries)
            t = transition(self.state, event, budgets)
            if t is None:
                return False
            previous, self.state = self.state, t.state
            for k, g in getattr(t.state, "targets", {}).items():
                self.next_gens[k] = max(self.next_gens[k], g + 1)  # reserved before any spawn
            for name in getattr(t.state, "spares", {}).values():
                if name in self.spares:
                    self.spares.remove(name)  # assigned: no other recovery takes it
            if isinstance(event, WorkDone):
                self._commit_outcome(previous)
            self._append_event("state_changed", previous=previous.name, state=t.state.name, reason=t.reason)
            self._persist()
            self._changed.notify_all()
        logger.warning("supervisor: %s -> %s: %s", previous.name, t.state.name, t.reason)
        self._work.set()
        return True

    def _recovery_mode(self) -> tuple[RecoveryMode, dict]:
        requested = RecoveryMode(self.cfg.recovery)
        decision = decide_recovery(requested, self.costs.inputs(self.plan.num_shards, self.cfg.checkpoint.pls_target))
        return decision.mode, {"mode": decision.mode.value, "requested": requested.value, "reason": decision.reason}

    def _on_death(self, k: int, generation: int, cause: str, detected: float) -> None:
        with self._lock:
            if isinstance(self.state, TERMINAL) or generation != self.shard_gens[k]:
                return
            if isinstance(self.state, RECOVERING) and k in self.state.targets:
                return
            kill = next((x for x in reversed(self.kills) if x["target"] == f"shard:{k}" and x["time"] <= detected), None)
            node = self.shard_info[k].get("node_id")
            self._deaths.append((node, f"shard:{k}", detected))  # a host's loss names it (_on_host_lost)
            lost = self.hosts.since(node)
            if kill is None and lost is not None:
                kill = {"time": lost}  # its host stopped answering then (actors.nodes.HostWatch)
            self.costs.observe_failure(max(detected, self.costs.clock_s))
            mode, decision = self._recovery_mode()
            partial = mode == RecoveryMode.PARTIAL
            # The oldest ready spare, but none on a host that stopped answering (it is dying too).
            suspects = self.hosts.suspects()
            spare = next((s for s in self.spares if self.spare_info.get(s, {}).get("node_id") not in suspects), None)
            record = {
                "actor": f"shard:{k}", "shard": k, "generation": generation, "cause": cause,
                "detected_at": round(detected, 3), "killed_at": kill["time"] if kill else None,
                "detection_s": round(detected - kill["time"], 3) if kill else None, "first_step": self.live_since[k],
            }
            # Only the chain the decision needs: a partial recovery's from the manifests (the
            # shard reads and verifies its own files), a rollback's verified in full.
            event = ShardDied(
                k, generation, self.shard_gens[k], self.next_gens[k], record, partial, decision,
                tuple(self.ckpt.chain_candidates()) if partial else (),
                () if partial else tuple(self.ckpt.consistent_chain()), spare,
            )
            self._transition(event)

    # ------------------------------------------------------------------ the executor

    def _executor_loop(self) -> None:
        errors = 0
        while not self._stop.is_set():
            self._work.wait(0.5)
            self._work.clear()
            with self._lock:
                state, committed = self.state, list(self.shards)
            if not isinstance(state, RECOVERING):
                continue
            try:
                outcome = self.executor.run(state, committed)
            except ShardsLost as lost:
                for k in lost.shards:
                    if k in state.targets:
                        self._transition(RespawnRetry(k, self.next_gens[k]))
                    else:
                        self._on_death(k, self.shard_gens[k], "died during a recovery", time.time())
                self._work.set()
                continue
            except Exception as err:  # retried a few times, then the run stops with the reason
                errors += 1
                self.record_event("recovery_error", state=state.name, error=repr(err)[:300], attempt=errors)
                logger.exception("recovery attempt %d failed", errors)
                if errors >= 3:
                    self._transition(BudgetExceeded(f"recovery failed {errors} times, last: {err!r}"[:500]))
                else:
                    time.sleep(1.0)
                    self._work.set()
                continue
            errors = 0
            with self._lock:
                self._outcome = outcome
                self._transition(WorkDone(state))

    def _commit_outcome(self, done) -> None:
        """Makes what the executor did for ``done`` the live fleet (called under the lock,
        inside the transition that persists it)."""
        out, now = self._outcome, time.time()
        earlier = len(self.failures)
        for k, (handle, info) in out.handles.items():
            self.shards[k], self.shard_info[k], self.shard_gens[k] = handle, info, done.targets[k]
            self.shard_names[k] = done.spares.get(k) or shard_name(self.run_id, k, done.targets[k])
            self.fleet.watch(k, done.targets[k], handle)
            self.live_since[k] = None  # known once trainers redo a step on it
        for k, result in out.loaded.items():
            for fb in result.get("fallbacks", []):
                self._append_event("checkpoint_fallback", event_time=now, shard=k, **fb)
        self.generation += 1
        if out.handles:
            self.costs.observe_reschedule(out.reschedule_s)
        if done.chain:
            self.costs.observe_load(out.load_s)
        partial = isinstance(done, RecoveringShards)
        total = {key: int(sum(x.get(key, 0) for x in out.loaded.values())) for key in ("rows", "bytes")}
        for cause in (c for c in done.causes if c.get("shard") is not None):
            mine = out.loaded.get(cause["shard"], {}) if partial else total
            # The chain the shard loaded: its own files may have sent it back further.
            chain = list(mine.get("chain", done.chain)) if partial else list(done.chain)
            killed = cause.get("killed_at")
            failure = {
                **cause, "recovery": "partial" if partial else "full", "decision": done.decision,
                "generation_after": self.generation, "spare": done.spares.get(cause["shard"]),
                "adoption_s": round(out.reschedule_s, 3), "reschedule_s": round(out.reschedule_s, 3),
                "load_s": round(out.load_s, 3), "recovery_s": round(now - cause["detected_at"], 3),
                "serving_s": round(now - killed, 3) if killed is not None else None,
                "restored_step": (chain[-1] if chain else 0) if partial else done.step,
                "chain": chain, "rows_reloaded": int(mine.get("rows", 0)),
                "bytes_reloaded": int(mine.get("bytes", 0)), "failed_at_step": None,
                "lost_samples": None if partial else 0.0, "lost_steps_recomputed": 0 if partial else None,
            }
            self.failures.append(failure)
            self._append_event("shard_recovered", event_time=now, **failure)
        if done.spares:
            self._spare_wake.set()  # a new spare starts in the background for each one used
        if isinstance(done, RollingBack):
            self._reopen_after_rollback(done.step, earlier)
            if done.why != FULL_RECOVERY:
                # Shards that died in a fallback or a resume: the new trainers start at the
                # rollback step through trainer_setup (no await_shards to settle them); the
                # work redone is the fallback's own (all_trainers_failed.steps_lost).
                for f in self.failures[earlier:]:
                    self._close(f, done.step)
            self.live_since = [done.step] * self.plan.num_shards
            self.prune_commits(done.step)
            self.rollback = {"generation": self.generation, "step": done.step} if done.why == FULL_RECOVERY else None
            extra = {"fenced": out.fenced, "rows_reloaded": total["rows"], "load_s": round(out.load_s, 3)}
            if done.why == RESUME:
                self.resume_step = done.step
                self._append_event("resumed", event_time=now, step=done.step, chain=list(done.chain),
                                   bytes_loaded=total["bytes"], **extra)
            elif done.why == EVERY_TRAINER_DIED:
                ahead = max((c.get("ahead", done.step) for c in done.causes), default=done.step)
                self._append_event("all_trainers_failed", event_time=now, fallback_step=done.step,
                                   steps_lost=ahead - done.step, **extra)
            if out.fenced:
                self._append_event("checkpoints_fenced", event_time=now, steps=out.fenced,
                                   rollback_step=done.step, why=done.why)

    # ------------------------------------------------------------------ warm spares

    def keep_spares(self) -> None:
        """Starts (once) the thread that keeps ``embeddings.spares`` warm spares ready."""
        with self._lock:
            if self._spare_keeper is None and self.cfg.embeddings.spares > 0:
                self._spare_keeper = threading.Thread(target=self._keep_spares, name="spare-keeper", daemon=True)
                self._spare_keeper.start()
        self._spare_wake.set()

    def _keep_spares(self) -> None:
        while not self._stop.is_set():
            self._spare_wake.wait(1.0)
            self._spare_wake.clear()
            misplaced = self._misplaced_spare() if self.spares and not self.spares_starting else None
            with self._lock:
                short = self.cfg.embeddings.spares - len(self.spares) - len(self.spares_starting)
                if short <= 0 and misplaced is not None:
                    short = 1  # one more spare, on the empty node; the misplaced one retires when it is ready
                if short <= 0 or isinstance(self.state, TERMINAL):
                    continue
                names = [spare_name(self.run_id, self.next_spare + i) for i in range(short)]
                self.next_spare += short
                self.spares_starting += names  # reserved before spawning: a restart finds them
                nodes = self._occupied()
                self._persist()
            t0 = time.perf_counter()
            handles = {name: self.fleet.spawn_spare(name, nodes) for name in names}
            for name, handle in handles.items():
                self._spare_ready(name, handle, t0, retire=misplaced)

    def _misplaced_spare(self) -> str | None:
        """A ready spare on a node that holds shards, while an alive node holds neither shards
        nor spares (a host added back, or one that joined): moved there, a spare no longer
        dies with the shards it would replace."""
        nodes = self.hosts.usable()
        with self._lock:
            taken = self._occupied()
            empty = {node for node in nodes if node not in taken} - self._move_tried
            if not empty:
                return None
            shard_nodes = {i.get("node_id") for i in self.shard_info}
            spare = next((s for s in self.spares if self.spare_info.get(s, {}).get("node_id") in shard_nodes), None)
            if spare is not None:
                self._move_tried |= empty  # one move per new node, wherever Ray puts the new spare
            return spare

    def _spare_ready(self, name: str, handle, t0: float, retire: str | None = None) -> None:
        """Adds the spare ``name`` to the pool once it answers; ``retire``: a ready spare that
        it replaces if it landed on another node (``_misplaced_spare``)."""
        try:
            info = ray.get(handle.ready.remote(), timeout=self.deadlines.shard_call_s)
        except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError) as err:
            self.fleet.kill(handle)
            with self._lock:
                if name in self.spares_starting:
                    self.spares_starting.remove(name)
            if self._stop.is_set():
                return  # the run ended while it was starting
            self.record_event("spare_failed", spare=name, error=str(err).splitlines()[0][:200])
            time.sleep(1.0)  # do not spin on a cluster that cannot place one
            self._spare_wake.set()
            return
        with self._lock:
            if name in self.spares_starting:
                self.spares_starting.remove(name)
            if self._stop.is_set() or isinstance(self.state, TERMINAL):
                self.fleet.kill(handle)
                return
            self.spares.append(name)
            self.spare_info[name] = {"pid": info["pid"], "node_id": info["node_id"], "node_ip": info.get("node_ip")}
            self.fleet.watch(name, None, handle)
            self._append_event("spare_ready", spare=name, start_s=round(time.perf_counter() - t0, 3),
                               node_id=info["node_id"], node_ip=info.get("node_ip"), pool=len(self.spares))
            old = self.spare_info.get(retire or "", {}).get("node_id")
            retired = retire in self.spares
            if retired:
                self.spares.remove(retire)
                self._append_event("spare_moved", spare=retire, to=name, from_node=old, to_node=info["node_id"],
                                   to_ip=info.get("node_ip"))
            self._persist()
        if retired:
            self.fleet.kill(self.fleet.find_name(retire))

    def _occupied(self, exclude=()) -> list:
        """Node ids of the live shards (but those in ``exclude``) and of the spares, ready or
        being adopted: where the next shard or spare should not go (``actors.nodes.placement``)."""
        with self._lock:
            spares = self.spares + list(getattr(self.state, "spares", {}).values())
            return [i.get("node_id") for k, i in enumerate(self.shard_info) if k not in exclude] + [
                self.spare_info[n]["node_id"] for n in spares if n in self.spare_info
            ]

    # ------------------------------------------------------------------ hosts

    def _actor_nodes(self) -> set:
        with self._lock:
            return {i.get("node_id") for i in self.shard_info} | {i.get("node_id") for i in self.spare_info.values()} | {
                t.get("node_id") for t in self.trainers.values()}

    def _on_host_lost(self, info: dict) -> None:
        """Ray declared a node of the run dead: one event names the host and every actor of the
        run it held (their own deaths and recoveries follow as usual)."""
        node = info["node_id"]
        since = (info["unreachable_since"] or info["declared_dead_at"]) - 5.0
        with self._lock:
            # Its shards: those still placed there, and those whose recovery began already.
            actors = sorted({f"shard:{k}" for k, i in enumerate(self.shard_info) if i.get("node_id") == node}
                            | {a for n, a, t in self._deaths if n == node and t >= since})
            actors += [f"trainer:{r}" for r, t in sorted(self.trainers.items()) if t.get("node_id") == node]
            # Its spares: those still in the pool, and those whose watch saw them die first.
            gone = {e["spare"] for e in self.events if e["kind"] == "spare_lost" and e["time"] >= since}
            actors += [spare_target(s) for s, i in self.spare_info.items()
                       if i.get("node_id") == node and (s in self.spares or s in gone)]
        if actors:
            self.record_event("host_lost", actors=actors, **info)
        else:
            logger.info("node %s (%s) died holding none of this run's actors", info["node_ip"], node[:8])

    def _on_spare_death(self, name: str, cause: str, detected: float) -> None:
        """A warm spare died: it leaves the pool and another one starts. An adopted spare is
        a shard; its death is seen by the shard watch."""
        with self._lock:
            if name not in self.spares:
                return
            self.spares.remove(name)
            self._append_event("spare_lost", spare=name, cause=cause, detected_at=round(detected, 3))
            self._persist()
        self._spare_wake.set()

    def _readopt_spares(self) -> None:
        """After a supervisor restart: the journaled spares (ready or being started) that
        answer are the pool again; the others are killed and replaced."""
        names = list(dict.fromkeys(self.spares + self.spares_starting))
        keep = []
        for name in names:
            handle = self.fleet.find_name(name)
            try:
                info = ray.get(handle.ready.remote(), timeout=self.deadlines.shard_call_s) if handle else None
            except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError):
                info = None
            if info is not None and info.get("shard_id") is None:
                keep.append(name)
                self.spare_info[name] = {"pid": info["pid"], "node_id": info["node_id"], "node_ip": info.get("node_ip")}
                self.fleet.watch(name, None, handle)
            elif info is None:
                self.fleet.kill(handle)
        with self._lock:
            self.spares, self.spares_starting = keep, []
            self._persist()
        if self.training_started:
            self.keep_spares()

    # ------------------------------------------------------------------ named fault points

    def _at_point(self, point: str) -> None:
        f = self.cfg.faults
        for spec in (f.at_points if f is not None else []):
            if spec.at == point and self._claim(f"{point}->{spec.kill}"):
                self._fire(spec.kill, f"at {point}")

    def _claim(self, key: str) -> bool:
        """Marks a fault as fired, atomically and persisted before it fires: concurrent
        triggers (every trainer reports the same commit) and a restart never repeat it."""
        with self._lock:
            if key in self.fired:
                return False
            self.fired.append(key)
            self._persist()
            return True

    def _fire(self, target: str, trigger: str) -> None:
        """Kills ``target`` now; the caller has claimed the fault."""
        if target == "supervisor":
            self.record_kill("supervisor", time.time(), os.getpid(), trigger)
            os.kill(os.getpid(), signal.SIGKILL)
        me = ray.get_runtime_context().current_actor
        targets = self.targets()
        names = sorted(t for t in targets if t.startswith("trainer:")) if target == "all_trainers" else [target]
        for name in names:
            if name in targets and targets[name]["pid"] is not None:
                try:
                    sigkill_on_node(me, name, targets[name], trigger, timeout_s=self.deadlines.shard_call_s)
                except Exception as err:  # a target that is already gone is not an error of the run
                    logger.warning("injected kill of %s failed: %s", name, err)

    def record_kill(self, target: str, wall_time: float, pid: int | None = None, trigger: str = "chaos") -> None:
        """A kill is about to happen (chaos tool, fault schedule, named point): an event, and
        the start of that failure's detection time."""
        with self._lock:
            self.kills.append({"target": target, "time": wall_time, "pid": pid, "trigger": trigger})
        self.record_event("fault_injected", target=target, pid=pid, at=wall_time, trigger=trigger)

    # ------------------------------------------------------------------ lost samples, off the recovery path

    def _settle(self, known_generation: int, redo_step: int, upto_generation: float = float("inf")) -> None:
        """Trainers redo ``redo_step`` on a fleet newer than ``known_generation`` (up to
        ``upto_generation``): the failures recovered since are now complete, and their lost
        samples can be counted."""
        with self._lock:
            closed = [f for f in self.failures if known_generation < f["generation_after"] <= upto_generation
                      and f["failed_at_step"] is None]
            todo = [f for f in closed if self._close(f, redo_step)]
            for f in todo:  # a rollback already set live_since; a partial recovery's starts here
                if self.live_since[f["shard"]] is None:
                    self.live_since[f["shard"]] = redo_step
            if closed:
                # Journaled: a supervisor restarted later must not close them again at a
                # later step (seen in the soak: closed at a rollback 80 steps on).
                self._persist()
        self._count_lost_later(todo)

    def _reopen_after_rollback(self, step: int, before: int) -> None:
        """Everything went back to ``step`` and trainers redo every step from there: a
        partial recovery among the first ``before`` failures loses only updates before
        ``step``, so it closes (or closes again) there and is counted again."""
        todo = []
        for f in self.failures[:before]:
            if f["recovery"] == "partial" and (f["failed_at_step"] is None or f["failed_at_step"] > step):
                f["failed_at_step"] = None
                if self._close(f, step):
                    todo.append(f)
        self._count_lost_later(todo)

    @staticmethod
    def _close(f: dict, redo_step: int) -> bool:
        """Closes an open failure at ``redo_step``: a full recovery's recomputed steps are
        known now; returns True for a partial one, whose lost samples are still to count."""
        if f["failed_at_step"] is not None:
            return False
        f["failed_at_step"] = redo_step
        if f["recovery"] != "partial":
            f["lost_steps_recomputed"] = max(redo_step - f["restored_step"], 0)
        return f["recovery"] == "partial"

    def _count_lost_later(self, failures: list[dict]) -> None:
        """Counts on a thread: off the recovery path and out of the lock."""
        if failures:
            threading.Thread(target=self._count_lost, args=(failures,), daemon=True).start()

    def _count_lost(self, failures: list[dict]) -> None:
        for f in failures:
            redo = f["failed_at_step"]
            error = None
            try:
                # The chain's row lists are read while no rollback can fence them; the count
                # itself (the data of every step in between) runs outside the lock.
                with self.ckpt.timeline():
                    rows = chain_rows(self.plan, self.ckpt.store, f)
                lost = count_lost_samples(self.cfg, self.plan, self.schedule, self.train_cache, f, rows)
            except Exception as err:  # counted from the data and the store; never blocks training
                logger.exception("counting lost samples of %s failed", f["actor"])
                lost, error = 0.0, repr(err)
            with self._lock:
                if f["failed_at_step"] != redo:
                    continue  # a rollback moved the redo step meanwhile and counts it again
                f["lost_samples"] = lost
                if error:
                    f["lost_samples_error"] = error
            self.record_event("lost_samples_counted", actor=f["actor"], lost_samples=lost,
                              first_step=f["first_step"], failed_at_step=redo)
