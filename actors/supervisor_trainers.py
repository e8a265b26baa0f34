"""The supervisor's book of trainers: registrations, committed steps, failed steps, heals,
progress, kills, and the faults a run's config ties to training steps (``faults.at_steps``).

A mixin of ``Supervisor``: it reads ``cfg``, ``_lock``, ``fired`` and calls ``_claim``, ``_fire``,
``_transition`` and ``record_event`` of the core.
"""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import ray

from core.accounting import trainer_failures
from actors.machine import BudgetExceeded

__all__ = ["TrainerBook"]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


class TrainerBook:
    def __init__(self):
        self.kills: list[dict] = []
        self.trainers: dict[int, dict] = {}
        self.commits: dict[int, dict] = {}
        self.failed_steps: list[dict] = []
        self.heals: list[dict] = []
        self.progress_log: list[dict] = []
        self.training_started = False
        self._redos: dict[int, dict[int, int]] = {}
        # (quorum id, step) whose all-reduce failed on some trainer: its group cannot finish.
        self._broken_groups: set[tuple[int, int]] = set()
        # Kill times of trainer failures whose detection is already in the metrics.
        self._detections_exported: set[float] = set()
        # _trainer_kills() as of (len(kills), len(events)): both only grow, and a degraded
        # commit asks for it at every step.
        self._trainer_kills_at: tuple[tuple[int, int], list[dict]] = ((-1, -1), [])

    def trainer_doc(self) -> dict:
        return {
            "kills": self.kills, "trainers": {str(r): t for r, t in self.trainers.items()},
            "failed_steps": self.failed_steps[-500:], "heals": self.heals, "progress": self.progress_log[-200:],
            "training_started": self.training_started, "detections_exported": sorted(self._detections_exported),
        }

    def load_trainer_doc(self, doc: dict) -> None:
        self.kills, self.failed_steps, self.heals = doc["kills"], doc["failed_steps"], doc["heals"]
        self.trainers = {int(r): t for r, t in doc["trainers"].items()}
        self.progress_log, self.training_started = doc["progress"], doc["training_started"]
        self._detections_exported = set(doc.get("detections_exported", ()))

    def prune_commits(self, step: int) -> None:
        """Everything went back to ``step``: commits from there on belong to an abandoned timeline."""
        self.commits = {s: c for s, c in self.commits.items() if s < step}
        for t in self.trainers.values():
            if t.get("committed_step", -1) >= step:
                t["committed_step"] = step - 1

    def register_trainer(
        self, rank: int, pid: int | None = None, node_id: str | None = None, marks: dict | None = None
    ) -> bool:
        """A trainer is ready to step. Returns True once the first step may begin: every
        trainer of the group has registered, or training is already under way (a
        replacement trainer joins the running quorum and heals from a peer). ``marks``: wall
        times of the trainer's start (process, imports, setup...), for the report of where a
        replacement's time goes."""
        with self._lock:
            known = self.trainers.get(rank)
            if known is None or known["pid"] != pid:  # a new process (the call repeats until all are in)
                starts = (known or {}).get("starts", 0) + 1
                self.trainers[rank] = {"pid": pid, "node_id": node_id, "registered": time.time(), "starts": starts}
                self._append_event("trainer_started", rank=rank, pid=pid, starts=starts, marks=marks or {})
                self._persist()
            return self.training_started or len(self.trainers) >= self.cfg.training.num_trainers

    def trainers_on_node(self, node_id: str) -> int:
        """How many trainers registered from node ``node_id`` (each rank's latest process)."""
        with self._lock:
            return sum(1 for t in self.trainers.values() if t.get("node_id") == node_id)

    def record_training_started(self, step: int, trainers: int, wall_time: float) -> None:
        with self._lock:
            if self.training_started:
                return
            self.training_started = True
        self.record_event("training_started", step=step, trainers=trainers, wall_time=wall_time)
        self.keep_spares()  # warm spares start once training runs, not during the startup

    def record_trainer_healed(self, rank: int, step: int, heal_s: float, wall_time: float) -> None:
        """A replacement trainer took its first share of a step after healing from a peer."""
        with self._lock:
            self.heals.append({"rank": rank, "step": step, "heal_s": heal_s, "time": wall_time})
        self.record_event("trainer_healed", rank=rank, step=step, heal_s=round(heal_s, 3))

    def record_commit(
        self, step: int, rank: int, microbatches: tuple, total: int, participants: int, wall_time: float,
        generation: int | None = None,
    ) -> None:
        """A trainer's share of a committed dense step (its microbatch ids) and the step's
        microbatch total as the all-reduce summed it (the same on every trainer). A commit on
        fleet ``generation`` settles recoveries up to it that no ``await_shards`` settled
        (trainers that learned the fleet from trainer_setup or a fallback)."""
        if generation is not None:
            self._settle(-1, step, upto_generation=generation)
        with self._lock:
            entry = self.commits.setdefault(
                step, {"microbatches": [], "total": total, "participants": participants, "time": wall_time}
            )
            entry["microbatches"].extend(microbatches)
            if rank in self.trainers:
                me = self.trainers[rank]
                me["committed_at"] = wall_time
                me["committed_step"] = max(step, me.get("committed_step", -1))
        if participants < self.cfg.training.num_trainers:
            self._export_trainer_detections()
        self._faults_at_step(step)

    def _export_trainer_detections(self) -> None:
        """Exports the detection time of each trainer failure the survivors just acted on
        (a failed step or a smaller quorum's commit), once per failure."""
        with self._lock:
            if all(k["time"] in self._detections_exported for k in self._trainer_kills()):
                return
        for t in self.trainer_failures():
            with self._lock:
                fresh = t["detection_s"] is not None and t["killed_at"] not in self._detections_exported
                if fresh:
                    self._detections_exported.add(t["killed_at"])
            if fresh:
                self.metrics.trainer_detected(t["detection_s"])

    def record_step_failed(
        self, step: int, rank: int, wall_time: float, cause: str, broken_quorum: int | None = None
    ) -> None:
        """Trainer ``rank`` did not commit ``step``. ``broken_quorum``: the quorum whose
        all-reduce failed on that trainer (a member died), if that is why."""
        with self._lock:
            self.failed_steps.append({"step": step, "rank": rank, "time": wall_time, "cause": cause})
            if broken_quorum is not None:
                self._broken_groups.add((broken_quorum, step))
            per_rank = self._redos.setdefault(step, {})
            per_rank[rank] = per_rank.get(rank, 0) + 1
            redos = max(per_rank.values())
        self._export_trainer_detections()
        budget = self.cfg.budgets.max_step_redos
        if 0 <= budget < redos:
            self._transition(BudgetExceeded(
                f"budget budgets.max_step_redos={budget} exceeded: step {step} failed {redos} times "
                f"(last on trainer {rank}: {cause[:200]})"
            ))

    def group_broken(self, quorum: int, step: int) -> bool:
        """Whether some trainer's all-reduce of ``step`` in ``quorum`` failed: asked by a
        trainer whose own all-reduce of it is taking long (see ``sum_over_trainers``)."""
        with self._lock:
            return (quorum, step) in self._broken_groups

    def record_progress(self, progress: dict) -> None:
        with self._lock:
            record = {"time": round(time.time(), 3), **progress}
            self.progress_log.append(record)
            self.run_log.progress(record)
        self.metrics.progress(record)

    def _step_time_s(self) -> float | None:
        with self._lock:
            rates = [p["samples_per_s"] for p in self.progress_log[-5:] if p.get("samples_per_s")]
        return self.samples_per_step / (sum(rates) / len(rates)) if rates else None

    def _faults_at_step(self, step: int) -> None:
        """``faults.at_steps``: kill a target once ``step`` committed (fired once, ever)."""
        f = self.cfg.faults
        if f is None or not f.at_steps:
            return
        for kind, steps in f.at_steps.items():
            if step not in steps or not self._claim(f"step {step}->{kind}"):
                continue
            target = kind
            if kind in ("shard", "trainer"):
                count = self.plan.num_shards if kind == "shard" else self.cfg.training.num_trainers
                target = f"{kind}:{int(np.random.default_rng([f.seed, step]).integers(count))}"
            threading.Thread(target=self._fire, args=(target, f"at step {step}"), daemon=True).start()

    def _live_established_trainers(self, exclude: int, timeout_s: float) -> dict[int, int | None]:
        """Ranks other than ``exclude`` whose current process has committed a step and is
        alive, with the last step each committed."""
        from actors.nodes import pinned

        with self._lock:
            candidates = {
                r: t for r, t in self.trainers.items()
                if r != exclude and t.get("committed_at", 0) > t["registered"] and t["pid"] is not None
            }
        refs = {r: pinned(_pid_alive, t["node_id"]).remote(t["pid"]) for r, t in candidates.items()}
        return {r: candidates[r].get("committed_step") for r, ref in refs.items() if ray.get(ref, timeout=timeout_s)}

    def trainer_failures(self) -> list[dict]:
        with self._lock:
            return trainer_failures(self._trainer_kills(), self.failed_steps, self.commits, self.heals, self.cfg.training.num_trainers)

    def _trainer_kills(self) -> list[dict]:
        """Trainer kills in time order (under the lock; not to be changed). A trainer lost with
        its host fails like a killed one, from when the host stopped answering."""
        key = (len(self.kills), len(self.events))
        if self._trainer_kills_at[0] != key:
            lost = [
                {"target": actor, "time": e.get("unreachable_since") or e["declared_dead_at"], "trigger": f"host {e['node_ip']} lost"}
                for e in self.events if e["kind"] == "host_lost" for actor in e["actors"] if actor.startswith("trainer:")
            ]
            kills = sorted([k for k in self.kills if k["target"].startswith("trainer:")] + lost, key=lambda x: x["time"])
            self._trainer_kills_at = (key, kills)
        return self._trainer_kills_at[1]
