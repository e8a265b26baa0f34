"""The recovery controller driven with fakes and no Ray, one executor pass at a time (the
pattern of Ray Train's ``tests/test_controller.py``): a shard's death is journaled as an
intent before the executor acts on it, a second controller built on the same journal
finishes the recovery, state changes only once its intent is on disk, and a recovery that
keeps failing stops the run on its budget."""

from __future__ import annotations

import copy
import dataclasses
import threading

import pytest

from actors.supervisor.books import Books, JournalUnwritable
from actors.supervisor.collaborators import Collaborators
from actors.supervisor.controller import RecoveryController
from actors.supervisor.costs import SharedCosts
from actors.supervisor.events import EventLog
from actors.supervisor.guard import start_guarded
from actors.supervisor.hooks import HookList
from actors.supervisor.ledger import FailureLedger
from actors.supervisor.machine import Failed, RecoveringShards, Running, state_from_dict
from actors.supervisor.outcome import Outcome, ShardsLost
from core.records import LoadResult, ShardFacts, ShardInfo
from policies import BudgetLimits, CostInputs, FailurePolicy, OnlineCostModel, RecoveryMode, decide_recovery

pytestmark = pytest.mark.timeout(30)


class MemoryJournal:
    """The journal's interface, in memory; ``fail`` makes the next writes raise."""

    def __init__(self):
        self.docs: list[dict] = []
        self.fail = False

    def write(self, doc: dict) -> None:
        if self.fail:
            raise OSError("no space left on device")
        self.docs.append(copy.deepcopy(doc))

    def last(self) -> dict:
        return self.docs[-1]


class FakeExecutor:
    """Records what it was asked to carry out and what the journal held at that moment."""

    def __init__(self, journal: MemoryJournal, lose: list[int] | None = None):
        self.journal = journal
        self.runs: list[tuple] = []
        self.lose = lose

    def run(self, state, committed):
        self.runs.append((state, self.journal.last()["controller"]["state"]))
        if self.lose:
            raise ShardsLost(self.lose)
        info = {k: ShardInfo(k, None, g, 100 + g, "node-a", "127.0.0.1", 10, "cpu") for k, g in state.targets.items()}
        return Outcome(
            handles={k: (f"handle-{k}-g{g}", info[k]) for k, g in state.targets.items()},
            loaded={k: LoadResult(rows=10, bytes=80, chain=state.chain) for k in state.targets},
            reschedule_s=0.1, load_s=0.2,
        )


class FakeFleet:
    def __init__(self):
        self.watched: list[tuple] = []

    def watch(self, k, generation, handle) -> None:
        self.watched.append((k, generation, handle))


class NoSpares:
    def candidate(self, avoid):
        return None

    def take(self, names) -> None:
        pass

    def wake(self) -> None:
        pass


def _controller(journal: MemoryJournal, executor, limits: BudgetLimits = BudgetLimits(),
                prune_commits=lambda step, generation: None, previous: dict | None = None):
    """A started controller of two shards; ``previous``: the last attempt's journaled section
    (``--resume``)."""
    lock = threading.RLock()
    books = Books(journal, lock, {"run_id": "r1", "attempt": 1, "supervisor_restarts": 0})
    hooks = HookList()
    events = EventLog(lock, hooks, books.persist, clock=lambda: 1000.0)
    ledger = FailureLedger(lock, events, books.persist, count_lost=lambda f: 0.0,
                           start_thread=lambda name, fn, *args: fn(*args), hooks=hooks)
    costs = SharedCosts(OnlineCostModel(mtbf_s=3600.0, save_cost_s=1.0, load_cost_s=1.0, reschedule_cost_s=3.0,
                                        start_s=0.0))
    policy = FailurePolicy(limits)
    decision = decide_recovery(RecoveryMode.PARTIAL, CostInputs(3600.0, 1.0, 1.0, 3.0, 2, 0.02))
    parts = Collaborators(
        executor=executor, fleet=FakeFleet(), ledger=ledger, spares=NoSpares(), prune_commits=prune_commits,
        observe=costs, decide=lambda: decision, host_down_since=lambda node: None, suspects=set,
        partial_chain=lambda: (10,), consistent_chain=lambda: (10,), policy=policy, hooks=hooks,
        start_thread=lambda name, fn, *args: None,
    )
    controller = RecoveryController("r1", lambda k, g: f"shard-{k}-g{g}", 2, lock, events, books.persist, parts,
                                    clock=lambda: 1000.0)
    for name, part in (("controller", controller), ("events", events), ("ledger", ledger)):
        books.add(name, part)
    if previous is not None:
        controller.continue_from(previous)
    controller.reserve_first_fleet()
    gens = controller.first_fleet()
    controller.commit_start([f"handle-{k}-g{g}" for k, g in enumerate(gens)],
                            [ShardInfo(k, None, g, 10 + k, "node-a", "127.0.0.1", 10, "cpu") for k, g in enumerate(gens)])
    return controller, ledger, events


def test_a_shard_death_is_journaled_as_an_intent_before_the_executor_acts():
    journal = MemoryJournal()
    executor = FakeExecutor(journal)
    controller, ledger, _ = _controller(journal, executor)
    controller.on_shard_death(1, 0, "ActorDiedError", 999.5)
    intent = state_from_dict(journal.last()["controller"]["state"])
    assert isinstance(intent, RecoveringShards) and intent.targets == {1: 1} and intent.chain == (10,)
    assert journal.last()["controller"]["next_gens"][1] == 2, "the new actor's name is reserved before it exists"
    assert executor.runs == [], "nothing acted yet"
    controller.loop.execute_once()
    (ran, journaled), = executor.runs
    assert ran == intent and state_from_dict(journaled) == intent, "the executor ran what was on disk"
    assert isinstance(controller.state, Running) and controller.generation == 1
    [failure] = ledger.records()
    assert (failure.actor, failure.recovery, failure.restored_step, failure.rows_reloaded) == ("shard:1", "partial", 10, 10)
    assert journal.last()["ledger"]["failures"][0]["actor"] == "shard:1"


def test_a_second_controller_on_the_same_journal_finishes_the_recovery():
    journal = MemoryJournal()
    first, _, _ = _controller(journal, FakeExecutor(journal))
    first.on_shard_death(0, 0, "ActorDiedError", 999.5)
    doc = journal.last()  # the first controller dies here, before its executor ran
    executor = FakeExecutor(journal)
    second, ledger, events = _controller(journal, executor)
    second.load(doc["controller"])
    ledger.load(doc["ledger"])
    events.load(doc["events"])
    assert isinstance(second.state, RecoveringShards) and second.state.targets == {0: 1}
    second.loop.execute_once()
    assert [run[0].targets for run in executor.runs] == [{0: 1}]
    assert isinstance(second.state, Running) and second.served.names[0] == "shard-0-g1"
    assert [f.actor for f in ledger.records()] == ["shard:0"]
    assert journal.last()["controller"]["state"]["state"] == "running"


def test_the_state_changes_only_once_its_intent_is_persisted():
    journal = MemoryJournal()
    executor = FakeExecutor(journal)
    controller, _, _ = _controller(journal, executor)
    journal.fail = True
    with pytest.raises(JournalUnwritable):
        controller.on_shard_death(1, 0, "ActorDiedError", 999.5)
    assert isinstance(controller.state, Running), "memory agrees with the journal: nothing was decided"
    controller.loop.execute_once()
    assert executor.runs == []
    controller.fail("the journal cannot be written")  # cannot be journaled either: the run still stops
    assert isinstance(controller.state, Failed)


def test_a_replacement_that_never_answers_is_respawned_within_a_budget():
    journal = MemoryJournal()
    executor = FakeExecutor(journal, lose=[1])
    controller, _, _ = _controller(journal, executor, BudgetLimits(max_executor_errors=2))
    controller.on_shard_death(1, 0, "ActorDiedError", 999.5)
    attempts = 0
    for _ in range(5):
        attempts = controller.loop.execute_once(attempts)
    assert [run[0].targets[1] for run in executor.runs] == [1, 2, 3], "a new name for each try, never a reused one"
    assert isinstance(controller.state, Failed)
    assert controller.state.reason.startswith("budgets.max_executor_errors: 3 (max 2)"), controller.state.reason


def test_a_thread_that_raises_reports_its_name_and_error():
    crashes = []
    done = threading.Event()

    def crash(name, err):
        crashes.append((name, repr(err)))
        done.set()

    def boom():
        raise KeyError("no such shard")

    start_guarded("spare-keeper", boom, crash)
    assert done.wait(5)
    assert crashes == [("spare-keeper", "KeyError('no such shard')")]


def test_a_load_that_does_not_answer_in_time_kills_the_slow_actor_before_it_is_replaced():
    # Before, a load that always exceeded its timeout respawned forever and left every slow
    # shard process running beside its replacement.
    import ray

    from actors.supervisor.executor import RecoveryExecutor
    from actors.supervisor.machine import RecoveringShards

    class Method:
        def __init__(self, name):
            self.name = name

        def remote(self, *args):
            return self.name

    class Actor:
        def __init__(self, k):
            self.load_checkpoint = Method(f"load of shard {k}")

    class Fleet:
        def __init__(self):
            self.killed: list = []

        def adopt_or_spawn(self, targets, spares, predecessors_exited=False, committed=None):
            return {k: (Actor(k), None) for k in targets}, []

        def kill(self, handle):
            self.killed.append(handle)

    def get(ref, timeout):
        raise ray.exceptions.GetTimeoutError(f"{ref} did not answer")

    fleet = Fleet()
    executor = RecoveryExecutor(fleet, lambda step, chain: [], "uri", 0.01, HookList(), wait=lambda *a, **k: None, get=get)
    with pytest.raises(ShardsLost) as lost:
        executor.run(RecoveringShards({1: 3}, (10,), (), None), [])
    assert lost.value.shards == [1]
    assert len(fleet.killed) == 1, "the slow actor is killed, not left beside its replacement"


def _rollback_executor(loaded_chain):
    from actors.supervisor.executor import RecoveryExecutor

    class Method:
        def __init__(self, name):
            self.name = name

        def remote(self, *args):
            return self.name

    class Actor:
        def __init__(self, k):
            self.load_checkpoint = Method(k)

    class Fleet:
        def adopt_or_spawn(self, targets, spares, predecessors_exited=False, committed=None):
            return {}, []

        def kill(self, handle):
            pass

    fenced = []
    executor = RecoveryExecutor(Fleet(), lambda step, chain: fenced.append(step) or [], "uri", 1.0, HookList(),
                                wait=lambda *a, **k: None,
                                get=lambda k, timeout: LoadResult(10, 80, loaded_chain(k)))
    return executor, [Actor(0), Actor(1)], fenced


def test_a_rollback_whose_chain_does_not_end_at_its_step_is_refused():
    # Before, a rollback could go ahead on chain [] (its checkpoint deleted by retention):
    # every shard reset to its initial rows under a later dense model, with no error.
    from actors.supervisor.machine import EVERY_TRAINER_DIED, RollingBack
    from actors.supervisor.outcome import ChainMismatch

    executor, actors, fenced = _rollback_executor(lambda k: ())
    with pytest.raises(ChainMismatch, match="ends at step 0"):
        executor.run(RollingBack(40, EVERY_TRAINER_DIED, ()), actors)
    assert fenced == [], "nothing was fenced: the abandoned timeline is still there to resume from"


def test_a_rollback_where_a_shard_loaded_another_chain_is_refused():
    from actors.supervisor.machine import FULL_RECOVERY, RollingBack
    from actors.supervisor.outcome import ChainMismatch

    executor, actors, fenced = _rollback_executor(lambda k: (40,) if k == 0 else (30,))
    with pytest.raises(ChainMismatch, match=r"shards \[1\] loaded chains \[\[30\]\]"):
        executor.run(RollingBack(40, FULL_RECOVERY, (40,)), actors)
    assert fenced == []
    executor, actors, fenced = _rollback_executor(lambda k: (40,))
    assert executor.run(RollingBack(40, FULL_RECOVERY, (40,)), actors).fenced == [] and fenced == [40]


def test_a_refused_rollback_fails_the_run_saying_why():
    from actors.supervisor.machine import ResumeRequested
    from actors.supervisor.outcome import ChainMismatch

    class Refusing:
        def run(self, state, committed):
            raise ChainMismatch("rollback to step 40 has chain [], which ends at step 0")

    journal = MemoryJournal()
    controller, _, _ = _controller(journal, Refusing())
    controller.transition(ResumeRequested(40, ()))
    controller.loop.execute_once()
    assert isinstance(controller.state, Failed) and controller.state.reason.startswith("invariant: rollback to step 40")


def test_trainers_restarting_where_the_recovered_shards_stand_redo_the_lost_steps():
    """Seen on the namespace cluster: a host with every shard and every trainer was cut off; the
    shards were recovered from checkpoint 301 and their failures closed at the last committed
    step + 1 (312), counting lost samples; then the new trainers started at 301, where the
    shards already stood: steps 301.. were redone and nothing was lost."""
    from tests.unit.test_supervisor_books import _failure

    journal, pruned = MemoryJournal(), []
    controller, ledger, _ = _controller(journal, FakeExecutor(journal), prune_commits=lambda step, generation: pruned.append(step))
    ledger.add([_failure("partial", 312, 301, shard=0), _failure("partial", 312, 301, shard=1),
                _failure("partial", 120, 90, shard=0)])  # an older one: its loss stands
    controller.trainers_restarted_at(301)
    assert [f.failed_at_step for f in ledger.records()] == [301, 301, 120]
    # The commits of steps 301..311 died with their trainers: left in the book, every trainer
    # failing a step below 312 would look left behind and rejoin (a needless fallback).
    assert pruned == [301]
    assert controller.served.first_steps == [0, 0]  # the live shards apply from step 0 (< 301) on: unchanged
    # Journaled: a restarted supervisor does not close them at 312 again.
    assert [f["failed_at_step"] for f in journal.last()["ledger"]["failures"]] == [301, 301, 120]


# --------------------------------------------------------------------------- one journal write


class RecordingFleet(FakeFleet):
    """Every effect the controller has on actors, in order, beside the journal's writes."""

    def __init__(self, effects: list):
        super().__init__()
        self.effects = effects

    def watch(self, k, generation, handle) -> None:
        self.effects.append(("watch", k, generation))

    def kill(self, handle) -> None:
        self.effects.append(("kill", handle))

    def find_name(self, name):
        return f"handle of {name}"


class RecordingJournal(MemoryJournal):
    def __init__(self, effects: list):
        super().__init__()
        self.effects = effects

    def write(self, doc: dict) -> None:
        super().write(doc)
        self.effects.append(("journal", len(self.docs) - 1))


def _mirrored_controller(decision_mode=RecoveryMode.PARTIAL):
    """A controller whose shards both have a mirror ready (the real MirrorSet, fakes below it)."""
    from actors.supervisor.mirrors import MirrorSet

    effects: list = []
    journal = RecordingJournal(effects)
    lock = threading.RLock()
    books = Books(journal, lock, {"run_id": "r1", "attempt": 1, "supervisor_restarts": 0})
    hooks = HookList()
    events = EventLog(lock, hooks, books.persist, clock=lambda: 1000.0)
    ledger = FailureLedger(lock, events, books.persist, count_lost=lambda f: 0.0,
                           start_thread=lambda name, fn, *args: effects.append(("count", name)), hooks=hooks)
    fleet = RecordingFleet(effects)
    mirrors = MirrorSet(lock, events, books.persist, fleet, primary=lambda k: (None, None), occupied=list,
                        running=lambda: True, num_shards=2, enabled=True, run_id="r1", timeout_s=1.0,
                        start_timeout_s=1.0, start_thread=lambda *a: None, hooks=hooks)
    mirrors._ready = {0: "m0", 1: "m1"}
    costs = SharedCosts(OnlineCostModel(mtbf_s=3600.0, save_cost_s=1.0, load_cost_s=1.0, reschedule_cost_s=3.0,
                                        start_s=0.0))
    decision = decide_recovery(decision_mode, CostInputs(3600.0, 1.0, 1.0, 3.0, 2, 0.02))
    parts = Collaborators(
        executor=FakeExecutor(journal), fleet=fleet, ledger=ledger, spares=NoSpares(), prune_commits=lambda step, generation: None,
        observe=costs, decide=lambda: decision, host_down_since=lambda node: None, suspects=set,
        partial_chain=lambda: (10,), consistent_chain=lambda: (10,), policy=FailurePolicy(BudgetLimits()),
        hooks=hooks, start_thread=lambda name, fn, *args: None, mirrors=mirrors,
    )
    controller = RecoveryController("r1", lambda k, g: f"shard-{k}-g{g}", 2, lock, events, books.persist, parts,
                                    clock=lambda: 1000.0)
    for name, part in (("controller", controller), ("events", events), ("ledger", ledger), ("mirrors", mirrors)):
        books.add(name, part)
    controller.reserve_first_fleet()
    controller.commit_start(["handle-0-g0", "handle-1-g0"],
                            [ShardInfo(k, None, 0, 10 + k, "node-a", "127.0.0.1", 10, "cpu") for k in range(2)])
    effects.clear()
    return controller, journal, effects


def _check_every_crash_point(journal: RecordingJournal, effects: list) -> None:
    """A supervisor killed between any two effects restarts from the last journal write before
    the kill. Whatever that write is, it never shows ``running`` without the failure records of
    the recovery that led there, nor a full recovery's end without its dense rollback."""
    writes = [i for kind, i in (e for e in effects if e[0] == "journal")]
    assert writes, effects
    for point in range(len(effects) + 1):
        seen = [i for kind, *rest in effects[:point] if kind == "journal" for i in rest]
        if not seen:
            continue
        doc, before = journal.docs[seen[-1]], [journal.docs[i] for i in seen[:-1]]
        state = doc["controller"]["state"]
        recovering = [d["controller"]["state"] for d in before if d["controller"]["state"]["state"] != "running"]
        if state["state"] != "running" or not recovering:
            continue
        done = recovering[-1]
        recorded = {(f["actor"], f["generation"]) for f in doc["ledger"]["failures"]}
        for cause in done["causes"]:
            assert (cause["actor"], cause["generation"]) in recorded, (point, effects, doc["ledger"])
        if done["state"] == "rolling_back" and done["why"] == "full recovery":
            assert doc["controller"]["rollback"] is not None, (point, effects)
            assert doc["controller"]["rollback"]["step"] == done["step"]


def test_a_partial_recovery_is_one_journal_write_and_its_effects_come_after_it():
    # Before, dropping the recovered shard's stale mirror saved the journal in the middle of the
    # transition: a supervisor killed right there restarted `running` with the failure gone.
    controller, journal, effects = _mirrored_controller()
    controller.on_shard_death(1, 0, "ActorDiedError", 999.5)
    decided = len(journal.docs)
    controller.loop.execute_once()
    assert isinstance(controller.state, Running)
    assert len(journal.docs) == decided + 1, "the recovery's end is one journal write"
    _check_every_crash_point(journal, effects)
    done = effects.index(("journal", len(journal.docs) - 1))
    assert ("watch", 1, 1) in effects[done:] and ("kill", "handle of m1") in effects[done:], effects


def test_a_full_recovery_commits_its_dense_rollback_in_the_same_write():
    controller, journal, effects = _mirrored_controller(RecoveryMode.FULL)
    controller.on_shard_death(0, 0, "ActorDiedError", 999.5)
    decided = len(journal.docs)
    controller.loop.execute_once()
    assert len(journal.docs) == decided + 1, "the rollback's end is one journal write"
    assert isinstance(controller.state, Running) and controller.rollback.step == 10
    _check_every_crash_point(journal, effects)


def test_a_shard_recovered_by_its_mirror_keeps_its_first_step_for_a_later_partial_recovery():
    # Before, a promoted mirror's first step was cleared and never set again: its shard killed
    # again before a new mirror existed was recovered from the checkpoint with 0 lost samples
    # (reproduced: 4,096 recounted by cpr verify). Its rows held its primary's steps since 40.
    from actors.supervisor.facts import Survey

    controller, journal, effects = _mirrored_controller(RecoveryMode.REPLICA)
    controller.served.first_steps[1] = 40
    in_sync = ShardFacts(shard_id=None, generation=0, pid=5, applied_steps=50, first_step=None, mirror_of=1,
                         held_steps=51, in_sync=True)
    controller._p = dataclasses.replace(controller._p, survey=lambda skip: Survey({}, {1: in_sync}, {}))
    controller._deaths._p = controller.loop._p = controller._p
    controller.on_shard_death(1, 0, "ActorDiedError", 999.5)
    assert controller.state.mirrors == (1,), controller.state
    controller.loop.execute_once()
    assert controller.served.first_steps[1] == 40, "the promoted mirror's rows hold steps since 40"
    controller._p.mirrors._ready = {}  # its new mirror does not exist yet
    controller.on_shard_death(1, 1, "ActorDiedError", 1000.5)
    assert controller.state.mirrors == () and controller.state.causes[0].first_step == 40


def test_a_shard_restored_to_its_initial_rows_says_why():
    class Initial(FakeExecutor):
        def run(self, state, committed):
            out = super().run(state, committed)
            out.loaded = {k: LoadResult(0, 0, (), initial_rows_reason="no checkpoint exists yet: the initial rows")
                          for k in out.loaded}
            return out

    journal = MemoryJournal()
    controller, _, events = _controller(journal, None)
    controller._p = dataclasses.replace(controller._p, executor=Initial(journal))
    controller.loop._p = controller._deaths._p = controller._p
    controller.on_shard_death(1, 0, "ActorDiedError", 999.5)
    controller.loop.execute_once()
    [said] = events.recent("shard_initial_rows")
    assert said["shard"] == 1 and said["reason"].startswith("no checkpoint exists yet")
