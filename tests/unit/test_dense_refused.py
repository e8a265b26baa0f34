"""A dense file damaged after its checkpoint was verified: replacement trainers start from the
checkpoint before it, a rollback refuses it like a shard's corrupt file, and a finished
rollback whose dense state cannot be read goes further back, the dense model with it (before,
every replacement raised CheckpointCorrupt until the trainer budget ended the run). No Ray."""

from __future__ import annotations

import threading

import pytest

from actors.supervisor.desk import TrainerDesk
from actors.supervisor.events import EventLog
from actors.supervisor.executor import RecoveryExecutor
from actors.supervisor.hooks import HookList
from actors.supervisor.machine import FULL_RECOVERY, DenseRefused, Running, RollingBack, transition
from actors.supervisor.outcome import ChainMismatch
from actors.supervisor.restore_targets import RestoreTargets
from core.deadlines import Deadlines
from core.errors import CheckpointCorrupt
from core.records import LoadResult, TrainerSetup
from policies import BudgetLimits, FailurePolicy
from tests.unit.test_supervisor_books import _book


class Checkpoints:
    """Checkpoints 30 and 40; the dense file of 40 was damaged after it verified."""

    store = None

    def __init__(self):
        self.refused: list[int] = []
        self.targets = RestoreTargets(lambda: None)

    def consistent_chain(self):
        return (30,) if 40 in self.refused else (40,)

    def full_upto(self, step):
        return (30,) if step >= 30 else ()

    def full_checkpoint_of(self, step):
        return True

    def read_dense(self, step):
        if step == 40:
            raise CheckpointCorrupt("checkpoint step 40: file dense.pt has checksum x, expected y")
        return b"dense of %d" % step

    def refuse(self, fallbacks):
        self.refused += [fb.step for fb in fallbacks]

    def next_due(self):
        return 50


class Controller:
    def __init__(self):
        self.transitions = []

    def wait_started(self, timeout_s):
        return True, None

    def wait_settled(self, timeout_s):
        return True

    def state_now(self):
        return Running()

    def fleet(self):
        return 0, ()

    def transition(self, event):
        self.transitions.append(event)


def _desk(tmp_path):
    lock = threading.RLock()
    book = _book(tmp_path, lock=lock)
    book.start_training(0, 2, 0.0)
    events = EventLog(lock, HookList(), lambda: None)
    checkpoints, controller = Checkpoints(), Controller()
    desk = TrainerDesk(lock, controller, checkpoints, book, events, FailurePolicy(BudgetLimits()), Deadlines(30.0),
                       TrainerSetup(finished=False), lambda s: None, True, "r")
    return desk, checkpoints, controller, events


def test_a_replacement_starts_from_the_checkpoint_before_a_damaged_dense_file(tmp_path):
    desk, checkpoints, _, events = _desk(tmp_path)
    setup = desk.trainer_setup(1)
    assert (setup.resume.step, setup.resume.dense) == (30, b"dense of 30")
    assert checkpoints.refused == [40]
    [fallback] = events.recent("checkpoint_fallback")
    assert fallback["step"] == 40 and fallback["file"] == "dense"


def test_a_finished_rollback_whose_dense_state_cannot_be_read_goes_further_back(tmp_path):
    desk, checkpoints, controller, _ = _desk(tmp_path)
    assert desk._dense(40, roll_back=True) is not None
    [event] = controller.transitions
    assert event == DenseRefused(40, 30, (30,), event.reason)
    t = transition(Running(), event)
    assert t.state == RollingBack(30, FULL_RECOVERY, (30,), refused_from=40)  # the dense model follows


def test_a_rollback_refuses_a_dense_file_it_cannot_read_before_it_commits():
    class Method:
        def remote(self, *args):
            return "ref"

    class Actor:
        load_checkpoint = Method()

    class Fleet:
        def adopt_or_spawn(self, *a, **k):
            return {}, []

        def kill(self, handle):
            pass

    fenced = []
    executor = RecoveryExecutor(Fleet(), lambda step, chain: fenced.append(step) or [], "uri", 1.0, HookList(),
                                wait=lambda *a, **k: None, get=lambda ref, timeout: LoadResult(1, 8, (40,)),
                                read_dense=Checkpoints().read_dense)
    with pytest.raises(ChainMismatch) as refused:
        executor.run(RollingBack(40, FULL_RECOVERY, (40,)), [Actor(), Actor()])
    assert [fb.step for fb in refused.value.fallbacks] == [40] and fenced == []
