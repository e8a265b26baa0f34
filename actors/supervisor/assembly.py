"""Builds the supervisor's parts and wires them together: each part owns its state and gets
what it needs from the others as constructor arguments (callables, never attribute reads),
in the manner of Ray Train V2's ``TrainController``, which takes its failure policy and
callbacks. ``Supervisor`` (the actor) only delegates to what this returns.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import ray

from actors.faults import FaultInjector, Killer
from actors.fleet import ShardFleet, shard_name
from actors.lease import Fences, LeaseSpec, trainer_place
from actors.metrics import MetricsHook, RunMetrics
from actors.nodes import HostWatch
from actors.shm import remove_process_files_on
from actors.supervisor.books import Books
from actors.supervisor.checkpoints import CheckpointCoordinator
from actors.supervisor.collaborators import RETRIED_ERRORS, Collaborators
from actors.supervisor.controller import RecoveryController
from actors.supervisor.costs import SharedCosts
from actors.supervisor.desk import TrainerDesk
from actors.supervisor.events import EventLog
from actors.supervisor.executor import RecoveryExecutor
from actors.supervisor.guard import start_guarded
from actors.supervisor.hooks import HookList, RunLogHook
from actors.supervisor.hosts import HostLossReporter
from actors.supervisor.ledger import FailureLedger
from actors.supervisor.machine import RECOVERING, TERMINAL, Running
from actors.supervisor.spares import SparePool
from actors.supervisor.survey import Surveyor
from actors.supervisor.mirrors import MirrorSet
from actors.supervisor.trainers import TrainerBook
from core.accounting import LostSpan, chain_rows, count_lost_samples, plan_held
from core.checkpoint import DataPosition
from core.config import RunConfig
from core.faultlog import fault_log_dir
from core.deadlines import Deadlines
from core.journal import BOOK_FILE, EVENTS_FILE, AppendLog, Journal, RunLog
from core.plan import ShardingPlan
from core.store import read_manifest
from core.books import FailureRecord, KillRecord
from core.records import Target, TrainerSetup
from core.schedule import StepSchedule
from policies import FailurePolicy, OnlineCostModel, RecoveryMode, decide_recovery

__all__ = ["Parts", "assemble", "RunInputs", "record_kill"]


@dataclass(frozen=True)
class RunInputs:
    cfg: RunConfig
    run_id: str
    run_dir: Path
    plan: ShardingPlan
    schedule: StepSchedule
    train_cache: str
    eval_cache: str


class _Value:
    """A journaled value of the facade's own (the evaluation)."""

    def __init__(self, value=None):
        self.value = value

    def doc(self):
        return self.value


@dataclass
class Parts:
    inputs: RunInputs
    lock: threading.RLock
    books: Books
    hooks: HookList
    events: EventLog
    ledger: FailureLedger
    trainers: TrainerBook
    spares: SparePool
    mirrors: MirrorSet
    checkpoints: CheckpointCoordinator
    controller: RecoveryController
    desk: TrainerDesk
    fleet: ShardFleet
    hosts: HostWatch
    costs: SharedCosts
    policy: FailurePolicy
    deadlines: Deadlines
    run_log: RunLog
    faults: FaultInjector | None
    killer: Killer
    eval: _Value


def assemble(inputs: RunInputs, on_crash: Callable[[str, BaseException], None], fresh_files: bool) -> Parts:
    cfg, run_id = inputs.cfg, inputs.run_id
    lock = threading.RLock()
    deadlines = Deadlines.of(cfg)
    policy = FailurePolicy(cfg.budgets.limits())
    header = {"run_id": run_id, "attempt": 1, "supervisor_restarts": 0, "attempt_restarts": 0}
    books = Books(Journal(inputs.run_dir), lock, header, on_unwritable=lambda reason: controller.fail(reason))
    persist, hooks, run_log = books.persist, HookList(), RunLog(inputs.run_dir, fresh=fresh_files)
    events = EventLog(lock, hooks, persist, file=AppendLog(inputs.run_dir / EVENTS_FILE, fresh=fresh_files))

    start_thread = partial(_start_thread, on_crash)
    ck = cfg.checkpoint
    costs = SharedCosts(OnlineCostModel(mtbf_s=ck.mtbf_s, save_cost_s=ck.save_cost_s, load_cost_s=ck.load_cost_s,
                                        reschedule_cost_s=ck.reschedule_cost_s, start_s=time.time()))
    n = inputs.plan.num_shards
    # The callables below name parts built further down: closures find them when called.
    ledger = FailureLedger(lock, events, persist, lambda f: _count_lost(inputs, checkpoints, f), start_thread, hooks,
                           protect=lambda owner, steps: checkpoints.targets.protect(owner, steps),
                           release=lambda owner: checkpoints.targets.release(owner))
    fences = Fences(LeaseSpec(run_id, cfg.ray.lease_s))
    trainers = TrainerBook(
        lock, events, persist, hooks, policy, fail=lambda reason: controller.fail(reason),
        kills=_TrainerKills(ledger, events), num_trainers=cfg.training.num_trainers,
        on_commit=lambda step, generation: controller.settle(-1, step, upto_generation=generation),
        book=AppendLog(inputs.run_dir / BOOK_FILE, fresh=fresh_files),
        samples_per_step=cfg.training.microbatches_per_step * cfg.training.microbatch_rows,
        on_replaced=lambda pid, node: remove_process_files_on(node, run_id, pid),
        place=lambda rank, pid, node: fences.grant([trainer_place(rank, pid, node)], wait=False),
        unwritable=books.unwritable,
    )
    hooks.add(RunLogHook(run_log))
    hooks.add(MetricsHook(RunMetrics(run_id, trainers.samples_per_step), trainers.failure_of))
    audit = str(inputs.run_dir / "audit") if cfg.audit_log else None
    checkpoints = CheckpointCoordinator(cfg, inputs.plan, costs, events.record, trainers.step_time_s, hooks, start_thread,
                                        keep=trainers.pinned, policy=policy, fail=lambda reason: controller.fail(reason),
                                        audit_dir=audit)

    def occupied(exclude=()) -> list:
        c = controller
        return c.served.shard_nodes(exclude) + spares.nodes(spares.ready() + c.assigned_spares()) + mirrors.nodes()

    hosts = HostWatch(lambda: _actor_nodes(controller, spares, trainers) | mirrors.known_nodes(), lambda info: _host_lost(info, reporter, trainers),
                      start_thread=start_thread, tick=lambda: hooks.at_point("thread.host-watch"))
    fleet = ShardFleet(
        cfg, inputs.plan, run_id, audit, on_death=lambda *a: controller.on_shard_death(*a),
        on_spare_death=lambda *a: mirrors.on_death(*a) or spares.on_death(*a), occupied=occupied, avoid=hosts.suspects,
        start_thread=start_thread, tick=lambda: hooks.at_point("thread.shard-watch"), fences=fences,
    )
    spares = _spares(inputs, lock, events, persist, fleet, hosts, lambda: controller, occupied, deadlines, start_thread, hooks)
    mirrors = _mirrors(inputs, lock, events, persist, fleet, lambda: controller, occupied, deadlines, start_thread, hooks,
                       lambda: spares)
    executor = RecoveryExecutor(fleet, checkpoints.restart_timeline, cfg.checkpoint_uri, deadlines.shard_call_s, hooks,
                                committed=trainers.committed_steps, read_dense=checkpoints.read_dense)
    surveyor = Surveyor(lambda: controller.served.serving(), mirrors.handles, trainers.workers, deadlines.survey_s)
    controller = _controller(inputs, lock, events, persist, Collaborators(
        executor=executor, fleet=fleet, ledger=ledger, spares=spares, prune_commits=trainers.prune, observe=costs,
        decide=lambda: _decide(cfg, costs, n),
        host_down_since=hosts.since, suspects=hosts.suspects, partial_chain=checkpoints.chain_candidates,
        consistent_chain=checkpoints.consistent_chain, policy=policy, hooks=hooks, start_thread=start_thread,
        retried=RETRIED_ERRORS + (ray.exceptions.RayError,), refuse=checkpoints.refuse, full_upto=checkpoints.full_upto,
        mirrors=mirrors, survey=lambda skip: surveyor.ask(skip), committed_steps=trainers.committed_steps,
        protect=checkpoints.targets.protect, release=checkpoints.targets.release,
    ))
    reporter = HostLossReporter(events, controller.served.shards_on, trainers.ranks_on, spares.on_node, mirrors.on_node)
    setup = TrainerSetup(
        finished=False, plan=inputs.plan, schedule=inputs.schedule, train_cache=inputs.train_cache,
        eval_cache=inputs.eval_cache, audit_dir=audit,
    )
    position = partial(_position, cfg, inputs.schedule, _train_data(inputs.train_cache))
    desk = TrainerDesk(lock, controller, checkpoints, trainers, events, policy, deadlines, setup, position,
                       ck.final, run_id, mirrors.wait_first,
                       survey=lambda: surveyor.ask(trainers_only=True))
    killer = Killer(lambda: _targets(controller, trainers, spares) | mirrors.targets(), lambda kill: record_kill(ledger, events, kill),
                    deadlines.shard_call_s, fault_log_dir(inputs.run_dir), cfg.checkpoint_uri,
                    seen_dead=lambda target, pid: _death_seen(controller, target, pid))
    faults = _faults(cfg, lock, persist, killer, start_thread, hooks)
    parts = Parts(inputs, lock, books, hooks, events, ledger, trainers, spares, mirrors, checkpoints, controller, desk, fleet,
                  hosts, costs, policy, deadlines, run_log, faults, killer, _Value())
    _register_books(parts)
    return parts


def _count_lost(inputs: RunInputs, checkpoints: CheckpointCoordinator, f: FailureRecord) -> float:
    """``f``'s lost samples, over the rows its dead shard held (an earlier attempt's plan, where a
    resume changed it before the count)."""
    span = LostSpan(f.shard, f.chain, f.first_step, f.failed_at_step)
    plan = plan_held(inputs.plan, f.shard, f.slices)
    with checkpoints.timeline():  # no rollback fences the chain's files meanwhile
        rows = chain_rows(plan, checkpoints.store, span)
    return count_lost_samples(inputs.cfg, plan, inputs.schedule, inputs.train_cache, span, rows)


def _death_seen(controller: RecoveryController, target: str, pid: int) -> bool:
    """Whether the supervisor has taken note of the death of ``target``'s process ``pid``: a
    shard being recovered, or served by another process; anything else is not waited for."""
    if not target.startswith("shard:"):
        return True
    k = int(target.split(":")[1])
    return k in getattr(controller.state_now(), "targets", {}) or controller.served.targets().get(k, (None,))[0] != pid


def _faults(cfg: RunConfig, lock, persist, killer: Killer, start_thread, hooks: HookList) -> FaultInjector | None:
    """The run's fault schedule as a hook (none without one)."""
    if cfg.faults is None or not (cfg.faults.at_points or cfg.faults.at_steps or cfg.faults.inject):
        return None
    faults = FaultInjector(cfg.faults, lock, persist, killer, start_thread, cfg.embeddings.num_shards,
                           cfg.training.num_trainers, killer.inject)
    hooks.add(faults)
    return faults


def _start_thread(on_crash: Callable[[str, BaseException], None], name: str, fn: Callable, *args) -> threading.Thread:
    return start_guarded(name, fn, on_crash, *args)


def _host_lost(info: dict, reporter: HostLossReporter, trainers: TrainerBook) -> None:
    trainers.lose_node(info["node_id"])
    reporter.on_host_lost(info)


def _controller(inputs: RunInputs, lock, events: EventLog, persist, parts: Collaborators) -> RecoveryController:
    run_id = inputs.run_id
    return RecoveryController(run_id, lambda k, g: shard_name(run_id, k, g), inputs.plan.num_shards, lock, events,
                              persist, parts)


def _register_books(p: Parts) -> None:
    """Every part with state gets its section of the journal."""
    for name, part in (("controller", p.controller), ("events", p.events), ("ledger", p.ledger),
                       ("trainers", p.trainers), ("spares", p.spares), ("mirrors", p.mirrors), ("checkpoints", p.checkpoints),
                       ("costs", p.costs), ("eval", p.eval), ("faults", p.faults)):
        if part is not None:
            p.books.add(name, part)


def _spares(inputs: RunInputs, lock, events, persist, fleet, hosts, controller, occupied, deadlines, start_thread,
            hooks) -> SparePool:
    return SparePool(
        lock, events, persist, fleet, hosts.usable, occupied, lambda: set(controller().served.shard_nodes()),
        lambda: not isinstance(controller().state_now(), TERMINAL), inputs.cfg.embeddings.spares, inputs.run_id,
        deadlines.shard_call_s, start_thread, hooks, start_timeout_s=deadlines.shard_start_s,
        recovering=lambda: isinstance(controller().state_now(), RECOVERING),
    )


def _mirrors(inputs: RunInputs, lock, events, persist, fleet, controller, occupied, deadlines, start_thread,
             hooks, spares) -> MirrorSet:
    return MirrorSet(
        lock, events, persist, fleet, lambda k: controller().served.primary(k), occupied,
        lambda: isinstance(controller().state_now(), Running), inputs.plan.num_shards,
        inputs.cfg.recovery == "replica", inputs.run_id, deadlines.shard_call_s, deadlines.shard_start_s,
        start_thread, hooks, spare=spares().claim,
    )


def _decide(cfg: RunConfig, costs: SharedCosts, n: int):
    """The recovery decision at the current estimates; replica's share of a step counts where
    the run keeps mirrors."""
    ck, replica = cfg.checkpoint, cfg.recovery == "replica"
    inputs = dataclasses.replace(costs.inputs(n, ck.pls_target), replica_step_frac=ck.replica_step_frac if replica else None)
    return decide_recovery(RecoveryMode(cfg.recovery), inputs)


def _position(cfg: RunConfig, schedule: StepSchedule, data: tuple[str, tuple, str], step: int) -> DataPosition:
    tr = cfg.training
    return DataPosition(
        next_step=step, microbatches_per_step=tr.microbatches_per_step, microbatch_rows=tr.microbatch_rows,
        num_microbatches=schedule.num_microbatches, seed=schedule.seed,
        samples_trained=step * tr.microbatches_per_step * tr.microbatch_rows, store_key=data[0], inputs=data[1],
        content=data[2],
    )


def _train_data(uri: str) -> tuple[str, tuple, str]:
    """(key, input files, content) of the training store at ``uri``, as its manifest says."""
    manifest = read_manifest(uri)
    return ("", (), "") if manifest is None else (manifest.key, tuple(manifest.inputs), manifest.content)


def record_kill(ledger: FailureLedger, events: EventLog, kill: KillRecord) -> None:
    """A kill is about to happen (chaos tool, fault schedule, named point): journaled with an
    event before the signal, and the start of that failure's detection time."""
    ledger.record_kill(kill)
    events.record("fault_injected", target=kill.target, pid=kill.pid, at=kill.time, trigger=kill.trigger)


class _TrainerKills:
    """Trainer kills in time order. A trainer lost with its host fails like a killed one, from
    when the host stopped answering. Kept until kills or events grow: a run that trains with
    fewer trainers asks at every commit."""

    def __init__(self, ledger: FailureLedger, events: EventLog):
        self._ledger, self._events = ledger, events
        self._cached: tuple[tuple[int, int], list[KillRecord]] = ((-1, -1), [])

    def __call__(self) -> list[KillRecord]:
        key = (len(self._ledger.kills()), self._events.count())
        if self._cached[0] != key:
            lost = [KillRecord(actor, e.get("unreachable_since") or e["declared_dead_at"], None,
                               f"host {e['node_ip']} lost")
                    for e in self._events.of("host_lost") for actor in e["actors"] if actor.startswith("trainer:")]
            kills = [k for k in self._ledger.kills() if k.target.startswith("trainer:")] + lost
            self._cached = (key, sorted(kills, key=lambda k: k.time))
        return self._cached[1]


def _actor_nodes(controller: RecoveryController, spares: SparePool, trainers: TrainerBook) -> set:
    return set(controller.served.shard_nodes()) | spares.known_nodes() | trainers.nodes()


def _targets(controller: RecoveryController, trainers: TrainerBook, spares: SparePool) -> dict[str, Target]:
    """Every killable actor of the run: its process id and node."""
    out = {f"shard:{k}": Target(pid, node) for k, (pid, node) in controller.served.targets().items()}
    out.update(trainers.targets())
    out.update(spares.targets())
    out["supervisor"] = Target(os.getpid(), ray.get_runtime_context().get_node_id())
    return out
