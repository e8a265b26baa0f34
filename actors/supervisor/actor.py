"""The Supervisor actor: a thin facade whose remote methods delegate to the parts
(``actors.supervisor.assembly``): the recovery controller, the trainer desk and book, the
failure ledger, the spare pool, the checkpoint coordinator and the event log. One per run, a
named actor that Ray restarts (``max_restarts=-1``); the restarted process rebuilds its books
from the journal and what is alive. A background thread that crashes ends the run as Failed,
naming the thread and the error.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import ray

from actors.fleet import kill_run_shards
from actors.supervisor.assembly import Parts, RunInputs, assemble, record_kill
from actors.supervisor.books import JOURNAL_FORMAT
from actors.supervisor.machine import TERMINAL, ResumeRequested, StopRequested
from actors.supervisor.restart import continue_history, rebuild
from actors.supervisor.summary import run_summary
from core.checkpoint import other_data, read_position
from core.checkpoint.plans import plan_after, same_rows
from core.checkpoint.reader import CheckpointReader
from core.codec import encode
from core.config import config_from_dict
from core.errors import ConfigError
from core.journal import Journal
from core.logs import LOG_DIR, configure_process_logging
from core.plan import make_plan
from core.replan import moved_rows, moves
from core.books import KillRecord, RunSummary, StartInfo
from core.records import (
    CommitRecord, EvalResult, FinalView, FleetView, Progress, RunStatus, SaveRequest, SaveResult, StepFailure,
    Target, TrainerSetup, TrainerStart,
)
from core.schedule import StepSchedule
from core.step_protocol import Decision, StepStart, Vote

__all__ = ["Supervisor", "supervisor_name", "history_to_use"]

logger = logging.getLogger(__name__)


def supervisor_name(run_id: str) -> str:
    return f"cpr-supervisor-{run_id}"


def history_to_use(journal_run_id: str | None, run_id: str, resume: bool, reconstructed: bool) -> str | None:
    """What a new supervisor process does with the journal it finds in the run directory:
    "rebuild" its own run's (Ray restarted it), "continue" the attempt before a resumed one's,
    or None: start afresh. Another run's journal is never this run's history, nor is this run's
    first process's own (not yet written) when Ray restarts it before its first write."""
    if journal_run_id is None:
        return None
    if journal_run_id == run_id:
        return "rebuild" if reconstructed else None
    return "continue" if resume else None


class Supervisor:
    """One per run, named ``supervisor_name(run_id)`` in the config's namespace. ``resume``:
    a new attempt of a run whose journal is in ``run_dir`` (``cpr train --resume``)."""

    def __init__(self, config: dict, run_id: str, train_cache: str, eval_cache: str, num_microbatches: int,
                 resume: bool = False):
        cfg = config_from_dict(config)
        run_dir = Path(cfg.run_dir).resolve()
        configure_process_logging(run_dir / LOG_DIR, "supervisor", ray.util.get_node_ip_address())
        tr = cfg.training
        journal = Journal(run_dir)
        previous = journal.load() if journal.exists() else None
        if previous is not None and previous.get("format") != JOURNAL_FORMAT:
            logger.warning("the journal in %s has another format (%s); its history is left out", run_dir,
                           previous.get("format"))
            previous = None
        use = history_to_use(previous and previous.get("run_id"), run_id, resume,
                             ray.get_runtime_context().was_current_actor_reconstructed)
        if previous is not None and use is None:
            logger.warning("the journal in %s is run %s's, not this run's (%s): it is not used", run_dir,
                           previous.get("run_id"), run_id)
        plan = make_plan(cfg.embeddings.sharding, cfg.model.rows_per_table, cfg.embeddings.num_shards)
        if use is not None and cfg.checkpoint.stored:  # a resume on another plan starts its next generation
            plan = plan_after(CheckpointReader(cfg.checkpoint_uri), plan)
        inputs = RunInputs(
            cfg, run_id, run_dir, plan,
            StepSchedule.from_config(num_microbatches, tr.microbatches_per_step, tr.epochs, tr.max_steps, cfg.seed),
            train_cache, eval_cache,
        )
        self._p: Parts = assemble(inputs, self._crashed, fresh_files=use is None)
        if use == "rebuild":
            self._rebuild(previous)
        elif use == "continue":
            continue_history(self._p, previous)
        self._p.controller.start_executor()

    def _rebuild(self, previous: dict) -> None:
        """Ray restarted this actor. A journal that cannot be read back fails the run (kept on
        disk as it is) instead of failing this constructor, which Ray would restart forever."""
        try:
            rebuild(self._p, previous)
        except Exception as err:  # noqa: BLE001 - the run stops, saying why
            logger.exception("rebuilding the supervisor's books failed")
            self._p.books.freeze()
            self._p.controller.fail(f"the supervisor could not rebuild its books after a restart: {err!r}"[:500])

    def _crashed(self, thread: str, err: BaseException) -> None:
        """A guarded thread died: the run ends as Failed with the thread and the error."""
        self._p.controller.fail(f"thread {thread} crashed: {type(err).__name__}: {err}"[:500])

    # ------------------------------------------------------------------ start and resume

    def start(self) -> StartInfo:
        """Creates every shard (its first generation, reserved in the journal first) and waits
        until each answers. Idempotent across a supervisor restart."""
        p, t0 = self._p, time.perf_counter()
        if not p.controller.has_started():
            p.checkpoints.start(0)  # before the trainers can see the fleet and ask when to save
            p.controller.reserve_first_fleet()
            gens = p.controller.first_fleet()
            try:
                taken: list = []  # spread over the nodes (actors.nodes.placement)
                handles = [p.fleet.find(k, g) or p.fleet.spawn(k, g, taken) for k, g in enumerate(gens)]
                infos = p.fleet.ready(handles)
            except Exception as err:  # trainers waiting in trainer_setup end; the driver raises it
                p.controller.start_failed(repr(err)[:500])
                raise
            p.controller.commit_start(handles, infos)
            for k, h in enumerate(handles):
                p.fleet.watch(k, gens[k], h)
            p.hosts.start()
            # Warm spares start now, beside the trainers' start (they warm up at idle priority):
            # started once training ran, one took CPU from the first seconds of steps.
            p.spares.keep()
            p.mirrors.keep()
            p.events.record("shards_ready", shards=len(handles), sharding=p.inputs.plan.kind,
                            rows=[p.inputs.plan.shard_rows(k) for k in range(len(handles))],
                            nodes=[i.node_ip for i in infos], startup_s=round(time.perf_counter() - t0, 3))
        return StartInfo(p.controller.served.infos_now(), time.perf_counter() - t0,
                         p.inputs.schedule.total_steps)

    def restore(self) -> int | None:
        """--resume: rolls every shard back to the newest full checkpoint (the one rollback
        path) and keeps its step for the trainers. Returns that step, or None without one."""
        p = self._p
        if p.checkpoints.store is None:
            raise ConfigError("checkpoint: every_steps, every_s or auto_interval must be set to resume a run")
        chain = p.checkpoints.consistent_chain()
        p.checkpoints.targets.protect("resume", chain)  # until the rollback to it is done
        for step, reason in p.checkpoints.store.fallbacks:
            p.events.record("checkpoint_fallback", step=step, reason=reason)
        if not chain:
            return None
        position, expected = read_position(p.checkpoints.store, chain[-1]), p.desk.position(chain[-1])
        if (why := other_data(position, expected, chain[-1])) is not None:
            raise ConfigError(why)
        for key in ("microbatches_per_step", "microbatch_rows", "num_microbatches", "seed"):
            if getattr(position, key) != getattr(expected, key):
                raise ConfigError(
                    f"checkpoint step {chain[-1]} was made with {key}={getattr(position, key)}, the config now "
                    f"gives {getattr(expected, key)}; resume with the run's own config"
                )
        self._record_plan_change(chain[-1])
        p.controller.transition(ResumeRequested(chain[-1], chain))
        p.controller.wait_settled(p.deadlines.supervisor_wait_s)  # inner_s("restore") = this + the verification
        p.checkpoints.targets.release("resume")
        return p.controller.resume_point()

    def _record_plan_change(self, step: int) -> None:
        """A resume whose plan is not the one checkpoint ``step`` was written under: the rows
        go to the shards of the new plan as they load (each reads the files holding its rows)."""
        p = self._p
        written = p.checkpoints.store.plan(p.checkpoints.store.info(step))
        now = p.inputs.plan
        if written is None or same_rows(written, now):
            return
        moved = moved_rows(moves(written, now))  # rows a shard reads from another shard's file
        p.events.record(
            "plan_changed", step=step, why="resume", generation=now.generation, previous_generation=written.generation,
            shards=now.num_shards, previous_shards=written.num_shards, sharding=now.kind,
            previous_sharding=written.kind, rows=[now.shard_rows(k) for k in range(now.num_shards)],
            rows_moved=moved, bytes_moved=moved * (p.inputs.cfg.model.embedding_dim + 1) * 4,
        )

    # ------------------------------------------------------------------ trainers

    def trainer_setup(self, rank: int) -> TrainerSetup:
        return self._p.desk.trainer_setup(rank)

    def status(self) -> RunStatus:
        return self._p.desk.status()

    def register_trainer(self, start: TrainerStart) -> bool:
        return self._p.trainers.register(start)

    def trainers_on_node(self, node_id: str) -> int:
        return self._p.trainers.on_node(node_id)

    def record_training_started(self, step: int, trainers: int, wall_time: float) -> None:
        if self._p.trainers.start_training(step, trainers, wall_time):
            self._p.spares.keep()  # (started with the shards; again after a supervisor restart)

    def record_trainer_healed(self, rank: int, step: int, heal_s: float, wall_time: float) -> None:
        self._p.trainers.healed(rank, step, heal_s, wall_time)

    def record_commit(self, commit: CommitRecord) -> None:
        self._p.trainers.commit(commit)

    def record_step_failed(self, failure: StepFailure) -> None:
        self._p.trainers.step_failed(failure)

    def group_broken(self, quorum: int, step: int) -> bool:
        return self._p.trainers.group_broken(quorum, step)

    def decide_step(self, vote: Vote) -> Decision:
        return self._p.trainers.decide(vote)

    def commit_voted(self, vote: Vote, commit: CommitRecord) -> Decision:
        """A trainer's vote with its commit report: the report counts only if the try commits."""
        decision = self._p.trainers.decide(vote)
        if decision.commit:
            self._p.trainers.commit(commit)
        return decision

    def start_step(self, rank: int, generation: int, step: int, healed_from: int | None) -> StepStart:
        return self._p.trainers.start_step(rank, generation, step, healed_from)

    def record_progress(self, progress: Progress) -> None:
        self._p.trainers.progress(progress)

    def report_shard_failure(self, k: int, generation: int, reason: str, step: int) -> None:
        """A trainer's call to shard ``k`` failed or timed out at ``step``. A shard that hangs
        is killed, so that hangs and deaths take the same recovery path (the watch sees it)."""
        handle = self._p.controller.handle_if_current(k, generation)
        if handle is not None:
            logger.warning("trainer reports shard %d unavailable (%s); killing it", k, reason)
            self._p.fleet.kill(handle)

    def await_shards(self, known_generation: int, step: int) -> FleetView:
        return self._p.desk.await_shards(known_generation, step)

    def fallback_to_checkpoint(self, step: int, rank: int) -> FleetView:
        return self._p.desk.fallback_to_checkpoint(step, rank)

    def save_checkpoint(self, request: SaveRequest) -> SaveResult:
        return self._p.desk.save_checkpoint(request)

    def checkpoint_due(self) -> int | None:
        return self._p.checkpoints.next_checkpoint_step

    def await_final(self, known_generation: int, step: int) -> FinalView:
        return self._p.desk.await_final(known_generation, step)

    def record_training_finished(self, step: int, wall_time: float) -> None:
        self._p.events.record("training_finished", step=step, wall_time=wall_time)

    def record_eval(self, result: EvalResult) -> None:
        """The run's evaluation: it is complete only with its final full checkpoint committed
        (``checkpoint.final``), which ``cpr export`` and ``--resume`` of a finished run read."""
        p = self._p
        p.checkpoints.drain()  # the final checkpoint, written while evaluation ran, commits first
        with p.lock:
            p.eval.value = encode(result)
        p.events.record("evaluated", **{k: v for k, v in encode(result).items() if k != "positive_rate"})
        if p.inputs.cfg.checkpoint.final and not p.checkpoints.full_checkpoint_of(result.steps):
            p.controller.fail(f"invariant: the run trained {result.steps} steps but no full checkpoint of step "
                              f"{result.steps} is committed (checkpoint.final)")
            return
        p.controller.transition(StopRequested("completed"))

    # ------------------------------------------------------------------ driver and chaos

    def request_stop(self, how: str = "interrupted") -> None:
        """The driver was interrupted (SIGINT/SIGTERM): trainers stop at their next step."""
        self._p.controller.transition(StopRequested(how))

    def fail_run(self, reason: str) -> None:
        """The driver saw the run fail outside the supervisor (the trainers' worker group)."""
        self._p.controller.fail(reason)

    def record_group_restarted(self, attempt: int, reason: str) -> None:
        self._p.events.record("trainer_group_restarted", attempt=attempt, reason=reason)

    def is_finished(self) -> bool:
        return isinstance(self._p.controller.state, TERMINAL)

    def progress(self) -> Progress | None:
        return self._p.trainers.last_progress()

    def events_since(self, index: int) -> list[dict]:
        return self._p.events.since(index)

    def targets(self) -> dict[str, Target]:
        return self._p.killer.targets()

    def shard_handles(self) -> list:
        return list(self._p.controller.fleet()[1])

    def fault_log_dir(self) -> str:
        """Where the processes that inject faults write their own log (``core.faultlog``)."""
        return self._p.killer.log_dir

    def record_kill(self, kill: KillRecord) -> None:
        """A kill is about to happen (chaos tool, fault schedule, named point): an event, and
        the start of that failure's detection time."""
        record_kill(self._p.ledger, self._p.events, kill)

    def withdraw_kill(self, kill: KillRecord) -> None:
        """The signal of a recorded kill found no process: the kill did not happen."""
        if self._p.ledger.withdraw_kill(kill):
            self._p.events.record("fault_withdrawn", target=kill.target, pid=kill.pid, at=kill.time)

    def summary(self) -> RunSummary:
        """Everything the report needs; failures whose redo step never came are closed at the
        last committed step and their lost samples counted now."""
        return run_summary(self._p)

    def shutdown(self) -> None:
        """Stops watching and recovering, and kills every shard actor of the run by name
        (half-started ones of an unfinished recovery too)."""
        p = self._p
        p.controller.stop()
        p.spares.stop()
        p.mirrors.stop()
        p.hosts.stop()
        p.checkpoints.drain()
        p.fleet.stop()
        kill_run_shards(p.inputs.run_id, p.inputs.cfg.ray.namespace)
