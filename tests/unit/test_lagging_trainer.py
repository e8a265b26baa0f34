"""A trainer that stalled while the others committed steps without it, and found none of them
left to heal it (soak seed 7: trainer 1 stalled at step 54 while trainer 0 committed to 175;
shard 0 and 1 died, then trainer 0; trainer 1 formed a quorum alone and committed steps 54..176
again on its stale dense model, with no rollback: cpr verify found "dense step 54 committed
again", and the lost samples counted as if the trainers redid from step 176)."""

from __future__ import annotations

import copy
import threading
from types import SimpleNamespace

import pytest
import torch

from actors.supervisor.events import EventLog
from actors.supervisor.hooks import HookList
from actors.trainer.step import Trainer
from core.records import FleetView, ResumePoint, TrainerSetup
from core.step_protocol import StepId, StepStart
from policies import BudgetLimits, FailurePolicy


class Manager:
    """torchft's Manager as one trainer sees it, alone in every quorum (nobody to heal it)."""

    def __init__(self, step: int):
        self.step, self._quorum_id = step, 8

    def start_quorum(self):
        pass

    def wait_quorum(self):
        pass

    def current_step(self):
        return self.step

    def load_state_dict(self, sd):
        self.step = sd["step"]

    def participating_rank(self):
        return 0

    def num_participants(self):
        return 1

    def is_participating(self):
        return True

    def errored(self):
        return None

    def should_commit(self):
        return False  # the step that stalled fails (its shard died)


class Supervisor:
    def __init__(self, committed_steps: int | None):
        self.committed_steps, self.calls = committed_steps, []

    def record_step_failed(self, failure):
        self.calls.append(("step_failed", failure.step))

    def await_shards(self, generation, step):
        self.calls.append(("await_shards", step))
        return FleetView(generation + 1, ("s0", "s1"), committed_steps=self.committed_steps)

    def trainer_setup(self, rank):
        self.calls.append(("trainer_setup", rank))
        return TrainerSetup(finished=False, shards=("s0", "s1"), generation=3, resume=ResumePoint(142, None),
                            training_started=True)

    def fallback_to_checkpoint(self, step, rank):
        self.calls.append(("fallback_to_checkpoint", step))
        return FleetView(4, ("s0", "s1"))

    def record_trainer_healed(self, rank, step, heal_s, at):
        self.calls.append(("healed", step))

    def start_step(self, rank, generation, step, healed_from):
        return StepStart(StepId(generation, step, 0), None)

    def record_training_started(self, step, participants, at):
        pass


def _trainer(supervisor: Supervisor, step: int) -> Trainer:
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    initial = {"model": copy.deepcopy(model.state_dict()), "optim": copy.deepcopy(optimizer.state_dict())}
    return Trainer(rank=1, cfg=None, supervisor=supervisor, shards=SimpleNamespace(shards=("s0", "s1")),
                   schedule=SimpleNamespace(microbatches_per_step=4, total_steps=2400), model=model,
                   optimizer=optimizer, manager=Manager(step), pg=None, prefetch=None, generation=2,
                   next_checkpoint=None, resume=None, replacement=False, initial_state=initial)


def _fail_step(t: Trainer) -> None:
    attempt = t.quorum()
    attempt.error = RuntimeError("shard 0: link: sending push_grads: BrokenPipeError")
    assert t.commit(attempt, torch.zeros(4))


def test_a_trainer_behind_the_commits_rejoins_at_a_checkpoint_instead_of_redoing_them_alone():
    supervisor = Supervisor(committed_steps=176)
    t = _trainer(supervisor, 54)
    _fail_step(t)
    attempt = t.quorum()  # alone: nobody ahead heals it
    # Not step 54 on the stale dense model: the newest checkpoint, and since nobody ahead healed
    # it there, every trainer that held the committed steps died: everything falls back there.
    assert attempt.step == 142 and t.manager.current_step() == 142
    assert ("trainer_setup", 1) in supervisor.calls and ("fallback_to_checkpoint", 142) in supervisor.calls


@pytest.mark.parametrize("committed", [54, None])
def test_a_trainer_at_the_commits_redoes_its_failed_step(committed):
    supervisor = Supervisor(committed_steps=committed)
    t = _trainer(supervisor, 54)
    _fail_step(t)
    attempt = t.quorum()
    assert attempt.step == 54 and not t.replacement
    assert [c[0] for c in supervisor.calls] == ["step_failed", "await_shards"]


def _desk(tmp_path, monkeypatch, applied: int, trainers: dict, total: int | None = None, final: int | None = None):
    """A trainer desk over fakes: the shards applied ``applied + 1`` steps, the survey's live
    trainers are ``trainers``, the schedule has ``total`` steps and ``final`` is the newest full
    checkpoint (None: only 142)."""
    import actors.supervisor.desk as desk_module
    from actors.supervisor.desk import TrainerDesk
    from actors.supervisor.facts import Survey
    from actors.supervisor.machine import Running
    from actors.supervisor.restore_targets import RestoreTargets
    from core.deadlines import Deadlines
    from tests.unit.test_supervisor_books import _book

    class Shard:
        state = SimpleNamespace(remote=lambda: "ref")

    class Controller:
        def __init__(self):
            self.transitions = []

        def wait_settled(self, timeout_s):
            return True

        def state_now(self):
            return Running()

        def fleet(self):
            return 2, (Shard(), Shard())

        def transition(self, event):
            self.transitions.append(event)

        def rollback_after(self, generation):
            return None

    class Checkpoints:
        store = None
        targets = RestoreTargets(lambda: None)

        def chain_upto(self, step):
            return (step,)

        def full_checkpoint_of(self, step):
            return step == final

        def read_dense(self, step):
            return f"dense of {step}"

        def next_due(self):
            return None

    monkeypatch.setattr(desk_module.ray, "get", lambda refs, timeout=None: [
        SimpleNamespace(applied_step=applied) for _ in refs])
    lock, controller = threading.RLock(), Controller()
    book = _book(tmp_path, lock=lock)
    book.start_training(0, 2, 0.0)
    events = EventLog(lock, HookList(), lambda: None)
    schedule = SimpleNamespace(total_steps=total) if total is not None else None
    desk = TrainerDesk(lock, controller, Checkpoints(), book, events, FailurePolicy(BudgetLimits()), Deadlines(30.0),
                       TrainerSetup(finished=False, schedule=schedule), lambda s: None, True, "r",
                       survey=lambda: Survey({}, {}, dict(trainers)))
    return desk, controller, book, events


@pytest.mark.parametrize("applied, action", [(141, "join"), (175, "roll back")])
def test_a_replacement_joins_a_live_trainer_at_its_checkpoint_only_if_the_shards_are_there_too(
        tmp_path, monkeypatch, applied, action):
    """Trainer 1 stalled between two steps while trainer 0 trained on to 176, then trainer 0
    died; its replacement started at checkpoint 142 and trainer 1, resumed, healed from it to
    142 (torchft heals to the highest step in the quorum). Asked, trainer 1 says "142 steps,
    established": the replacement joined, nothing rolled back, and the shards, at 176, skipped
    the redone steps as applied. The shards are asked too: ahead of the checkpoint, nobody alive
    holds those steps' dense state, and everything goes back to 142."""
    from actors.supervisor.machine import TrainersAllDied
    from core.records import TrainerFacts

    desk, controller, _, events = _desk(tmp_path, monkeypatch, applied,
                                        {1: TrainerFacts(rank=1, pid=7, steps=142, established=True)})
    desk.fallback_to_checkpoint(142, 0)
    if action == "join":
        assert controller.transitions == [] and events.recent("replacement_joined")
    else:
        [event] = controller.transitions
        assert isinstance(event, TrainersAllDied) and event.step == 142
        assert events.recent("replacement_decided")[-1]["action"] == "roll back"


@pytest.mark.parametrize("live", [False, True])
def test_a_replacement_that_comes_after_the_last_step_takes_the_final_checkpoint_and_rolls_nothing_back(
        tmp_path, monkeypatch, live):
    """CI at 72b722a (tests/integration/test_fault_kinds.py, the rollback run): trainer 1 trained
    the run's last steps alone while trainer 0's replacement was starting; it committed step 69 of
    70, saved the final checkpoint and ended (rank 1 does not evaluate). The replacement, from
    checkpoint 60, found no live trainer and rolled the shards back to 60: an "every trainer
    died" for trainers that had finished. With the last step committed and its final checkpoint
    there, the replacement takes that checkpoint's state, whether the survivor is still alive or
    not."""
    from core.records import TrainerFacts
    from tests.unit.test_supervisor_books import _commit

    trainers = {1: TrainerFacts(rank=1, pid=7, steps=70, established=True)} if live else {}
    desk, controller, book, events = _desk(tmp_path, monkeypatch, 69, trainers, total=70, final=70)
    for step in range(70):
        book.commit(_commit(step, 1, participants=1))
    view = desk.fallback_to_checkpoint(60, 0)
    assert controller.transitions == [] and not events.recent("all_trainers_failed")
    assert view.rollback is not None and view.rollback.step == 70 and view.rollback.dense == "dense of 70"


@pytest.mark.parametrize("committed, rejoins", [(130, True), (100, False)])
def test_a_trainer_that_stalled_across_a_rollback_rejoins_if_the_others_redid_steps_without_it(committed, rejoins):
    """Trainer 1 stalled across a full recovery to step 100; trainer 0 redid steps 100..129
    and died. Trainer 1's failed step brings it the rollback, to 100, while the shards hold 130:
    it is left behind as much as one that missed no rollback."""
    from core.records import Rollback

    class RollingBackSupervisor(Supervisor):
        def await_shards(self, generation, step):
            self.calls.append(("await_shards", step))
            return FleetView(generation + 1, ("s0", "s1"), Rollback(generation + 1, 100, None),
                             committed_steps=self.committed_steps)

    supervisor = RollingBackSupervisor(committed_steps=committed)
    t = _trainer(supervisor, 54)
    _fail_step(t)
    assert (("trainer_setup", 1) in supervisor.calls) is rejoins
    assert t.manager.current_step() == (142 if rejoins else 100)


def test_a_push_of_a_step_a_shard_applied_already_fails_the_step():
    """The stale trainer whose step does not fail otherwise (stopped between two steps, resumed
    alone after the others died): its push of step 54 finds a shard at 176, which answers
    ``duplicate``. Before, the answer was ignored and the step committed again on the stale
    dense model; now the step fails, and its failure rejoins it."""
    from actors.trainer.shards import StaleStep, check_pushed
    from core.records import PushResult

    fresh = [PushResult(applied=False), PushResult(applied=True)]
    assert check_pushed(54, (0, 1), fresh) == fresh
    with pytest.raises(StaleStep, match="applied it already"):
        check_pushed(54, (0, 1), [PushResult(applied=False), PushResult(applied=True, duplicate=True)])
    with pytest.raises(StaleStep, match="newer attempt"):
        check_pushed(54, (0, 1), [PushResult(applied=False, stale=True)])


@pytest.mark.parametrize("error", ["fenced", "crafted"])
def test_whether_the_final_checkpoint_exists_is_no_when_its_manifest_goes_or_cannot_be_read(error):
    """``full_checkpoint_of`` lists the committed manifests, then reads one: a rollback that
    fences it in between, or a manifest that does not parse, is "no full checkpoint there" (every
    replacement's fallback asks it first), not an error out of the supervisor's call."""
    from actors.supervisor.checkpoints import CheckpointCoordinator
    from core.errors import CheckpointCorrupt, CheckpointNotFound

    class Store:
        def list_committed(self):
            return [60, 70]

        def info(self, step):
            raise (CheckpointNotFound if error == "fenced" else CheckpointCorrupt)(f"checkpoint step {step}: {error}")

    assert CheckpointCoordinator.full_checkpoint_of(SimpleNamespace(store=Store()), 70) is False
