"""Calls to the supervisor from trainers, the driver and the chaos tool: typed, and each with
the caller's deadline from ``core.deadlines`` (longer than anything the supervisor waits for
inside the method), so a timeout never fires on a call that was still going to answer."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import ray

from core.deadlines import Deadlines
from core.books import KillRecord, RunSummary
from core.records import (
    CommitRecord, EvalResult, FinalView, FleetView, Progress, RunStatus, SaveRequest, SaveResult, StepFailure,
    Target, TrainerSetup, TrainerStart,
)
from core.step_protocol import Decision, StepStart, Vote

__all__ = ["SupervisorClient"]


class SupervisorClient:
    """``handle``: the supervisor actor. ``get`` is ``ray.get``, or a recorder in a test."""

    def __init__(self, handle, deadlines: Deadlines, get: Callable[..., Any] = ray.get):
        self.handle = handle
        self.deadlines = deadlines
        self._get = get
        # A trainer's lease (actors.lease.Lease.hold): it calls only while it holds its place.
        self.guard: Callable[[], object] | None = None

    def _start(self, method: str, *args: object):
        """``method`` started at the supervisor, while this caller holds its place: its ref."""
        if self.guard is not None:
            self.guard()
        return getattr(self.handle, method).remote(*args)

    def _call(self, method: str, *args: object) -> Any:
        return self._get(self._start(method, *args), timeout=self.deadlines.caller_s(method))

    def _tell(self, method: str, *args: object) -> None:
        """A report the caller does not wait for."""
        self._start(method, *args)

    def wait(self, method: str, ref) -> Any:
        """The answer of a call started with ``.remote()`` earlier (the driver's ``start``)."""
        return self._get(ref, timeout=self.deadlines.caller_s(method))

    # ------------------------------------------------------------------ trainers

    def trainer_setup(self, rank: int) -> TrainerSetup:
        return self._call("trainer_setup", rank)

    def register_trainer(self, start: TrainerStart) -> bool:
        return self._call("register_trainer", start)

    def trainers_on_node(self, node_id: str) -> int:
        return self._call("trainers_on_node", node_id)

    def status_ref(self):
        """``status()`` started, for a poll that must not block the step."""
        return self.handle.status.remote()

    def status(self) -> RunStatus:
        return self._call("status")

    def await_shards(self, known_generation: int, step: int) -> FleetView:
        return self._call("await_shards", known_generation, step)

    def await_final(self, known_generation: int, step: int) -> FinalView:
        return self._call("await_final", known_generation, step)

    def fallback_to_checkpoint(self, step: int, rank: int) -> FleetView:
        return self._call("fallback_to_checkpoint", step, rank)

    def group_broken(self, quorum: int, step: int) -> bool:
        return self._call("group_broken", quorum, step)

    def decide_step(self, vote: Vote) -> Decision:
        return self._call("decide_step", vote)

    def commit_voted(self, vote: Vote, commit: CommitRecord):
        """A vote of a sum that completed with no failure, with this trainer's commit report,
        started: its ``Decision`` waited for later (``wait("commit_voted", ref)``)."""
        return self._start("commit_voted", vote, commit)

    def start_step(self, rank: int, generation: int, step: int, healed_from: int | None) -> StepStart:
        return self._call("start_step", rank, generation, step, healed_from)

    def checkpoint_due(self) -> int | None:
        return self._call("checkpoint_due")

    def save_checkpoint(self, request: SaveRequest) -> SaveResult:
        return self._call("save_checkpoint", request)

    def record_eval(self, result: EvalResult) -> None:
        self._call("record_eval", result)

    def record_commit(self, commit: CommitRecord) -> None:
        self._tell("record_commit", commit)

    def record_step_failed(self, failure: StepFailure) -> None:
        self._tell("record_step_failed", failure)

    def record_progress(self, progress: Progress) -> None:
        self._tell("record_progress", progress)

    def record_training_started(self, step: int, trainers: int, wall_time: float) -> None:
        self._tell("record_training_started", step, trainers, wall_time)

    def record_trainer_healed(self, rank: int, step: int, heal_s: float, wall_time: float) -> None:
        self._tell("record_trainer_healed", rank, step, heal_s, wall_time)

    def record_training_finished(self, step: int, wall_time: float) -> None:
        self._tell("record_training_finished", step, wall_time)

    def report_shard_failure(self, k: int, generation: int, reason: str, step: int) -> None:
        self._tell("report_shard_failure", k, generation, reason, step)

    # ------------------------------------------------------------------ driver and chaos

    def start(self):
        """Starts the shards; the answer (``StartInfo``) comes through ``wait("start", ref)``."""
        return self.handle.start.remote()

    def restore(self) -> int | None:
        return self._call("restore")

    def summary(self) -> RunSummary:
        return self._call("summary")

    def request_stop(self, how: str = "interrupted") -> None:
        self._call("request_stop", how)

    def fail_run(self, reason: str) -> None:
        self._call("fail_run", reason)

    def record_group_restarted(self, attempt: int, reason: str) -> None:
        self._call("record_group_restarted", attempt, reason)

    def shutdown(self) -> None:
        self._call("shutdown")

    def is_finished(self) -> bool:
        return self._call("is_finished")

    def progress(self) -> Progress | None:
        return self._call("progress")

    def events_since(self, index: int) -> list[dict]:
        return self._call("events_since", index)

    def targets(self) -> dict[str, Target]:
        return self._call("targets")

    def shard_handles(self) -> list:
        return self._call("shard_handles")

    def record_kill(self, kill: KillRecord) -> None:
        self._call("record_kill", kill)

    def fault_log_dir(self) -> str:
        return self._call("fault_log_dir")
