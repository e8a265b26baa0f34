"""The supervisor's books without Ray: what a restarted supervisor reads back (every commit
and failed step, not only the last ones), a trainer whose node is gone, the failure ledger's
closing and counting rules, and retention keeping what a restore in flight needs."""

from __future__ import annotations

import dataclasses
import threading

import numpy as np
import pytest

from actors.faults import FaultInjector
from actors.supervisor.events import EventLog
from actors.supervisor.facts import Survey
from actors.supervisor.guard import start_guarded
from actors.supervisor.hooks import HookList, RunHooks
from actors.supervisor.ledger import FailureLedger
from actors.supervisor.trainers import TrainerBook
from actors.supervisor.step_records import read_commits
from core.books import CommitTally, FailureRecord, KillRecord
from core.config_failures import FaultPoint, FaultsConfig
from core.checkpoint import FULL, CheckpointStore, ShardRows, write_blob, write_shard_file
from core.journal import AppendLog
from core.records import CommitRecord, StepFailure, TrainerFacts, TrainerStart
from policies import BudgetLimits, FailurePolicy

pytestmark = pytest.mark.timeout(30)


class Detections(RunHooks):
    def __init__(self):
        self.seen: list[float] = []

    def on_trainer_detected(self, detection_s: float) -> None:
        self.seen.append(detection_s)


def _book(tmp_path, kills=(), hooks=None, fails=None, limits=BudgetLimits(), lock=None):
    lock = lock or threading.RLock()
    hooks = hooks or HookList()
    events = EventLog(lock, hooks, lambda: None)
    book = TrainerBook(
        lock, events, lambda: None, hooks, FailurePolicy(limits), fail=(fails if fails is not None else []).append,
        kills=lambda: list(kills), on_commit=lambda step, generation: None,
        book=AppendLog(tmp_path / "trainer_book.jsonl"), num_trainers=2, samples_per_step=1024,
    )
    return book


def _commit(step, rank, participants=2, time=0.0, microbatches=(0, 1)):
    return CommitRecord(step, rank, tuple(m + 4 * step for m in microbatches), 4, participants, time, 0)


def test_a_restarted_supervisor_reads_back_every_commit_and_failed_step(tmp_path):
    # Before, commits and failed steps lived only in memory: a restarted supervisor reported
    # 0 steps with fewer trainers and closed open failures at step 0.
    book = _book(tmp_path)
    book.register(TrainerStart(0, 11, "n"))
    for step in range(5):
        book.commit(_commit(step, 0, participants=1 if step >= 3 else 2, time=float(step)))
    book.step_failed(StepFailure(5, 0, 5.5, "shard 1: ActorDiedError", broken_quorum=7))
    book.prune(4)  # a rollback to step 4
    restarted = _book(tmp_path)
    restarted.load(book.doc(), AppendLog.read(tmp_path / "trainer_book.jsonl"))
    assert restarted.tally() == book.tally() == CommitTally(4, (4,), 1)
    commits = read_commits(AppendLog.read(tmp_path / "trainer_book.jsonl"), book.doc()["prunes"])
    assert [c.participants for c in commits.values()] == [2, 2, 2, 1]
    assert restarted.group_broken(7, 5) and restarted.last_step_committed() == 3


def test_a_torn_last_record_is_read_past_and_a_torn_middle_one_is_an_error(tmp_path):
    path = tmp_path / "book.jsonl"
    path.write_text('{"kind": "pruned", "step": 3}\n{"kind": "comm')
    assert AppendLog.read(path) == [{"kind": "pruned", "step": 3}]
    path.write_text('{"kind": "comm\n{"kind": "pruned", "step": 3}\n')
    with pytest.raises(ValueError, match="book.jsonl:1"):
        AppendLog.read(path)


def test_the_redo_budget_stops_the_run_with_one_message_format(tmp_path):
    fails: list[str] = []
    book = _book(tmp_path, fails=fails, limits=BudgetLimits(max_step_redos=2))
    for _ in range(3):
        book.step_failed(StepFailure(9, 1, 1.0, "a peer trainer's step failed"))
    assert len(fails) == 1 and fails[0].startswith("budgets.max_step_redos: 3 (max 2): step 9 failed 3 times")


def test_a_trainer_failure_is_exported_when_detected_not_when_healed(tmp_path):
    # Once per failure, also across a supervisor restart (the journal keeps what was exported).
    kills = [KillRecord("trainer:1", 10.0, 22, "at step 0")]
    hooks = Detections()
    book = _book(tmp_path, kills=kills, hooks=hooks)
    book.commit(_commit(0, 0, time=9.0))
    book.commit(_commit(1, 0, time=10.2))  # the full quorum had formed before the kill
    assert hooks.seen == []
    book.commit(_commit(2, 0, participants=1, time=10.5))
    book.commit(_commit(3, 0, participants=1, time=10.7))
    assert hooks.seen == [0.5]
    again = Detections()
    restarted = _book(tmp_path, kills=kills, hooks=again)
    restarted.load(book.doc(), AppendLog.read(tmp_path / "trainer_book.jsonl"))
    restarted.commit(_commit(4, 0, participants=1, time=11.0))
    assert again.seen == []


def test_a_rollback_abandons_the_commits_after_its_step_and_a_restart_agrees(tmp_path):
    # The prune is journaled with the rollback (where in the book it applies), so a restarted
    # supervisor replays the commits made after the rollback on top of it.
    book = _book(tmp_path)
    for rank, pid in ((0, 10), (1, 11)):
        book.register(TrainerStart(rank, pid, "n"))
    for step in (98, 99, 100, 130):
        book.commit(_commit(step, 0, time=1e12))
    book.commit(_commit(90, 1, time=1e12))
    book.prune(100)
    book.commit(_commit(100, 0, time=2e12))  # redone on the new timeline
    assert sorted(read_commits(AppendLog.read(tmp_path / "trainer_book.jsonl"), book.doc()["prunes"])) == [90, 98, 99, 100]
    assert book.last_step_committed() == 100 and book.tally().steps == 101
    restarted = _book(tmp_path)
    restarted.load(book.doc(), AppendLog.read(tmp_path / "trainer_book.jsonl"))
    assert restarted.last_step_committed() == 100 and restarted.tally() == book.tally()


def _failure(recovery, failed_at_step, restored_step, generation_after=1, shard=0):
    return FailureRecord(
        actor=f"shard:{shard}", shard=shard, generation=0, cause="x", detected_at=0.0, killed_at=None,
        detection_s=None, first_step=0, recovery=recovery, decision=None, generation_after=generation_after,
        spare=None, adoption_s=0.0, reschedule_s=0.0, load_s=0.0, recovery_s=0.0, serving_s=None,
        restored_step=restored_step, chain=(restored_step,), rows_reloaded=0, bytes_reloaded=0,
        failed_at_step=failed_at_step, lost_samples=None if recovery == "partial" else 0.0,
    )


def _ledger(counted, count_lost=None, start_thread=None, hooks=None):
    lock = threading.RLock()
    hooks = HookList() if hooks is None else hooks
    events = EventLog(lock, hooks, lambda: None)
    return FailureLedger(lock, events, lambda: None, count_lost or (lambda f: counted.append(f.actor) or 5.0),
                         start_thread or (lambda name, fn, *args: fn(*args)), hooks)


def test_a_rollback_closes_earlier_partial_recoveries_at_its_step():
    counted: list[str] = []
    ledger = _ledger(counted)
    ledger.add([
        _failure("partial", None, 30, shard=0),  # open: its redo step never came
        _failure("partial", 45, 30, shard=1),  # redone past the rollback
        _failure("partial", 12, 10, shard=2),  # redone before it: unchanged
        _failure("full", None, 40, shard=3),  # this rollback's own
    ])
    ledger.count_later(ledger.reopen_after_rollback(40, 3))
    assert [f.failed_at_step for f in ledger.records()] == [40, 40, 12, None]
    assert counted == ["shard:0", "shard:1"]
    assert [f.lost_samples for f in ledger.records()[:2]] == [5.0, 5.0]


def test_a_commit_settles_recoveries_no_trainer_asked_about():
    # Seen in the soak: shards recovered while the trainers were being restarted; the new
    # trainers learned the fleet from trainer_setup, never called await_shards, and the
    # failures stayed open until a rollback 100 steps later closed them there.
    counted: list[str] = []
    ledger = _ledger(counted)
    ledger.add([_failure("partial", None, 30, generation_after=3, shard=0),
                _failure("partial", None, 30, generation_after=5, shard=1)])  # newer than the commit's fleet
    shards, todo = ledger.close_settled(-1, 56, upto_generation=4)
    assert shards == [0]
    ledger.count_later(todo)
    assert [f.failed_at_step for f in ledger.records()] == [56, None] and counted == ["shard:0"]


def test_the_lost_samples_thread_crashing_is_reported_not_swallowed():
    # Counting runs on a guarded thread: an error it expects (a file unreadable) is recorded
    # with the failure; anything else, or the planted fault at its point, reaches the
    # supervisor's crash handler, which ends the run as Failed naming the thread.
    crashes: list[tuple[str, BaseException]] = []

    def start(name, fn, *args):
        thread = start_guarded(name, fn, lambda n, err: crashes.append((n, err)), *args)
        thread.join(5)
        return thread

    def count_lost(f):
        raise OSError("cache unreadable") if f.actor == "shard:0" else RuntimeError("a bug")

    hooks = HookList()
    ledger = _ledger([], count_lost=count_lost, start_thread=start, hooks=hooks)
    ledger.add([_failure("partial", 31, 30, shard=0), _failure("partial", 31, 30, shard=1)])
    ledger.count_later([0])
    assert crashes == [] and ledger.records()[0].lost_samples == 0.0
    assert "cache unreadable" in ledger.records()[0].lost_samples_error
    ledger.count_later([1])
    assert [(n, type(e).__name__, str(e)) for n, e in crashes] == [("lost-samples", "RuntimeError", "a bug")]

    faults = FaultsConfig(max_failures=0, at_points=[FaultPoint(at="thread.lost-samples", error="planted")])
    hooks.add(FaultInjector(faults, threading.RLock(), lambda: None, kill=lambda *a: None, start_thread=start,
                            num_shards=2, num_trainers=1))
    crashes.clear()
    ledger.count_later([0])
    assert [(n, type(e).__name__) for n, e in crashes] == [("lost-samples", "InjectedFault")]
    assert "planted" in str(crashes[0][1])


def _commit_full(store, uri, step):
    rows = ShardRows(np.zeros(1, np.int32), np.zeros(1, np.int64), np.zeros((1, 4), np.float32), np.zeros(1, np.float32))
    store.commit(step, [write_shard_file(uri, step, 0, rows), write_blob(uri, step, "dense.pt", b"d")], kind=FULL)


def test_retention_keeps_the_checkpoint_a_replacement_trainer_starts_from(tmp_path):
    # keep_last: 1, and a save commits while every trainer is being replaced: before, retention
    # deleted the step the replacements had loaded, and the fallback found no chain ending there.
    uri = str(tmp_path / "ckpt")
    pinned: set[int] = set()
    store = CheckpointStore(uri, keep_last=1, keep=lambda: pinned)
    _commit_full(store, uri, 10)
    pinned.add(10)  # trainer_setup handed step 10 to a replacement
    _commit_full(store, uri, 20)
    assert store.list_committed() == [10, 20]
    assert store.verified_chain(10) == [10]
    pinned.clear()  # it healed, joined or fell back
    _commit_full(store, uri, 30)
    assert store.list_committed() == [30]


def test_a_checkpoint_is_verified_outside_the_books_lock(tmp_path):
    # Before, trainer_setup verified the newest checkpoint in full under the supervisor's lock:
    # seconds in which no death and no commit could be recorded on a large model.
    from actors.supervisor.desk import TrainerDesk
    from actors.supervisor.machine import Running
    from core.deadlines import Deadlines
    from core.records import TrainerSetup

    verifying, release = threading.Event(), threading.Event()

    class Controller:
        def wait_started(self, timeout_s):
            return True, None

        def state_now(self):
            return Running()

        def fleet(self):
            return 0, ()

    class Checkpoints:
        store = None

        def consistent_chain(self):
            verifying.set()
            release.wait(10)  # reading and hashing every file of the checkpoint
            return (40,)

        def full_checkpoint_of(self, step):
            return True

        def read_dense(self, step):
            return b"dense"

        def next_due(self):
            return 50

    lock = threading.RLock()  # the books' lock, shared by every part
    book = _book(tmp_path, lock=lock)
    book.start_training(0, 2, 0.0)
    desk = TrainerDesk(lock, Controller(), Checkpoints(), book, EventLog(lock, HookList(), lambda: None),
                       FailurePolicy(BudgetLimits()), Deadlines(30.0), TrainerSetup(finished=False), lambda s: None,
                       True, "r")
    setups = []
    waiter = threading.Thread(target=lambda: setups.append(desk.trainer_setup(1)))
    waiter.start()
    assert verifying.wait(5)
    committed = threading.Thread(target=book.commit, args=(_commit(41, 0),))
    committed.start()
    committed.join(2)
    assert not committed.is_alive(), "a commit went through while the checkpoint was being verified"
    release.set()
    waiter.join(5)
    assert setups[0].resume.step == 40 and 40 in book.pinned()


def test_a_late_replacement_takes_the_final_checkpoint_once_its_peers_finished():
    # Before, a replacement that started after its live peer had committed the last step waited
    # to heal from it (TrainerConflict) at every try until budgets.max_step_redos failed the run:
    # the peer, training over, formed no more quorums.
    from actors.supervisor.desk import TrainerDesk
    from actors.supervisor.machine import Running
    from core.deadlines import Deadlines
    from core.errors import TrainerConflict
    from core.records import TrainerSetup
    from core.schedule import StepSchedule

    class Controller:
        def fleet(self):
            return 3, ("shard0", "shard1")

        def state_now(self):
            return Running()

    class Trainers:
        last = 140

        def survey(self):  # trainer 1 is alive and ahead of the replacement's step (it says so)
            return Survey({}, {}, {1: TrainerFacts(1, 77, self.last + 1, True)})

        def last_step_committed(self):
            return self.last

        def unpin(self, rank):
            pass

    class Checkpoints:
        store = None

        final = False

        def full_checkpoint_of(self, step):
            return self.final and step == 150

        def read_dense(self, step):
            return b"dense of %d" % step

    lock, trainers, checkpoints = threading.RLock(), Trainers(), Checkpoints()
    setup = TrainerSetup(finished=False, schedule=StepSchedule(600, 4, 150, 0))
    desk = TrainerDesk(lock, Controller(), checkpoints, trainers, EventLog(lock, HookList(), lambda: None),
                       FailurePolicy(BudgetLimits()), Deadlines(30.0), setup, lambda s: None, True, "r",
                       survey=trainers.survey)
    with pytest.raises(TrainerConflict):  # the peer is still training: heal from it
        desk.fallback_to_checkpoint(124, 0)
    trainers.last = 149
    with pytest.raises(TrainerConflict):  # every step committed, the final checkpoint not yet
        desk.fallback_to_checkpoint(124, 0)
    checkpoints.final = True
    view = desk.fallback_to_checkpoint(124, 0)
    assert (view.generation, view.rollback.step, view.rollback.dense) == (3, 150, b"dense of 150")


@pytest.mark.parametrize("reported, last_committed, redo", [(86, 85, 86), (46, 85, 86), (10, None, 10)])
def test_a_lagging_trainer_does_not_close_a_shard_failure_before_the_step_the_others_redo(
        reported, last_committed, redo):
    # Before, a trainer stalled at step 46 that came back after shard 0 died at step 86 closed
    # that failure at step 46: its lost samples were counted as 0 (cpr verify recounted 6,998).
    from actors.supervisor.desk import TrainerDesk
    from actors.supervisor.machine import Running
    from core.deadlines import Deadlines
    from core.records import TrainerSetup

    settled = []

    class Controller:
        def wait_settled(self, timeout_s):
            return True

        def state_now(self):
            return Running()

        def fleet(self):
            return 2, ("shard0", "shard1")

        def rollback_after(self, known_generation):
            return None

        def settle(self, known_generation, redo_step):
            settled.append((known_generation, redo_step))

    class Trainers:
        def last_step_committed(self):
            return last_committed

        def timeline_steps(self):
            return None if last_committed is None else last_committed + 1

    class Checkpoints:
        store = None

        def next_due(self):
            return None

    lock = threading.RLock()
    desk = TrainerDesk(lock, Controller(), Checkpoints(), Trainers(), EventLog(lock, HookList(), lambda: None),
                       FailurePolicy(BudgetLimits()), Deadlines(30.0), TrainerSetup(finished=False), lambda s: None,
                       True, "r")
    view = desk.await_shards(1, reported)
    assert view.generation == 2 and settled == [(1, redo)]
    # It also says how many steps the run holds committed: a trainer holding others rejoins
    # (tests/unit/test_lagging_trainer.py).
    assert view.committed_steps == (None if last_committed is None else last_committed + 1)


def test_a_withdrawn_kill_leaves_the_books_and_only_that_one():
    ledger = _ledger([])
    first, second = KillRecord("shard:0", 10.0, 7, "schedule"), KillRecord("shard:0", 12.0, 7, "schedule")
    ledger.record_kill(first)
    ledger.record_kill(second)
    assert ledger.withdraw_kill(second) and not ledger.withdraw_kill(second)
    assert ledger.kills() == (first,)
    assert ledger.kill_of("shard:0", pid=7) == first and ledger.kill_of("shard:0", pid=8) is None



def test_a_rollback_reopens_a_counted_failure_for_a_new_count_that_a_restart_makes_too():
    # Before, the reopened failure kept its old count: a supervisor restarted before the new
    # count ran never counted it again (recount_open_counts looks for failures without one).
    ledger = _ledger([])
    ledger.add([dataclasses.replace(_failure("partial", 45, 30, shard=1), lost_samples=20.0)])
    todo = ledger.reopen_after_rollback(40, 1)
    [f] = ledger.records()
    assert todo == [0] and (f.failed_at_step, f.lost_samples) == (40, None)
