"""A trainer's side of the step protocol with fakes of torchft and the supervisor: a trainer
whose heal failed neither computes nor pushes and breaks the group at once; a try decided
committed that this trainer could not follow (it walked away from the sum) is not redone; a
heal past the run's committed steps is refused."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

from actors.trainer.step import HealRefused, Trainer
from core.records import FleetView, ResumePoint, TrainerSetup
from core.step_protocol import StepId, StepLedger, Vote

pytestmark = pytest.mark.timeout(30)


class Manager:
    """torchft's Manager in a quorum of two; ``heal_to``: the step its quorum heals it to;
    ``error``: what its quorum or heal failed with."""

    def __init__(self, step: int, heal_to: int | None = None, error: Exception | None = None):
        self.step, self.heal_to, self.error, self._quorum_id = step, heal_to, None, 5
        self._error_at_quorum = error
        self.reported: list = []

    def start_quorum(self):
        self.error = None

    def wait_quorum(self):
        if self.heal_to is not None:
            self.step, self.heal_to = self.heal_to, None
        self.error = self._error_at_quorum

    def current_step(self):
        return self.step

    def load_state_dict(self, sd):
        self.step = sd["step"]

    def participating_rank(self):
        return 1

    def num_participants(self):
        return 2

    def is_participating(self):
        return True

    def errored(self):
        return self.error

    def report_error(self, err):
        self.reported.append(err)
        self.error = self.error or err

    def should_commit(self):
        ok = self.error is None
        if ok:
            self.step += 1
        return ok


class Supervisor:
    """The step ledger, for real, behind the calls the trainer makes."""

    def __init__(self, committed_steps: int):
        self.ledger, self.calls, self.votes = StepLedger(committed_steps), [], []

    def start_step(self, rank, generation, step, healed_from):
        self.calls.append(("start_step", step, healed_from))
        return self.ledger.start(generation, step, healed_from is not None)

    def decide_step(self, vote: Vote):
        self.votes.append(vote)
        return self.ledger.vote(vote)[0]

    def commit_voted(self, vote: Vote, commit):
        self.votes.append(vote)
        decision = self.ledger.vote(vote)[0]  # the answer, as the ledger gives it when the vote arrives
        if decision.commit:
            self.record_commit(commit)
        return decision

    def wait(self, method, ref):
        return ref

    def group_broken(self, quorum, step):
        return False

    def record_commit(self, commit):
        self.calls.append(("commit", commit.step))

    def record_step_failed(self, failure):
        self.calls.append(("step_failed", failure.step, failure.broken_quorum))

    def await_shards(self, generation, step):
        return FleetView(generation, ("s0", "s1"), committed_steps=self.ledger.committed_steps())

    def trainer_setup(self, rank):
        self.calls.append(("trainer_setup", rank))
        return TrainerSetup(finished=False, shards=("s0", "s1"), generation=2, resume=ResumePoint(40, None),
                            training_started=True)

    def record_training_started(self, *args):
        pass

    def record_trainer_healed(self, *args):
        pass


class Shards:
    shards = ("s0", "s1")

    def __init__(self):
        self.calls = []

    def lookup(self, *args, **kwargs):
        self.calls.append("lookup")
        raise AssertionError("a trainer whose heal failed looked up")

    def push_grads(self, *args, **kwargs):
        self.calls.append("push")
        raise AssertionError("a trainer whose heal failed pushed")


class Group:
    """The all-reduce: done (the sum of both trainers' ``flat``: here twice this one's), or
    failed here (``error``)."""

    def __init__(self, error: Exception | None = None):
        self.error = error

    def allreduce(self, tensors, opts):
        flat, error = tensors[0], self.error

        class Future:
            def add_done_callback(self, fn):
                fn(self)

            def value(self):
                if error is not None:
                    raise error
                flat.mul_(2)

        return SimpleNamespace(get_future=lambda: Future())


def _trainer(supervisor, manager, pg=None, shards=None) -> Trainer:
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    initial = {"model": copy.deepcopy(model.state_dict()), "optim": copy.deepcopy(optimizer.state_dict())}
    return Trainer(rank=1, cfg=None, supervisor=supervisor, shards=shards or Shards(),
                   schedule=SimpleNamespace(microbatches_per_step=4, total_steps=2400,
                                            assignment=lambda step, participant, n: [participant]),
                   model=model, optimizer=optimizer, manager=manager, pg=pg or Group(), prefetch=None, generation=2,
                   next_checkpoint=None, resume=None, replacement=False, initial_state=initial)


def test_a_trainer_whose_heal_failed_neither_computes_nor_pushes_and_breaks_the_group_at_once():
    """Before, it skipped the all-reduce but computed and pushed on its un-healed model, and its
    failure named no broken group: its peer waited out the collective timeout (60 s)."""
    supervisor = Supervisor(committed_steps=40)
    t = _trainer(supervisor, Manager(40, error=RuntimeError("heal failed: peer gone")))
    attempt = t.quorum()
    t.compute(attempt)
    assert t.shards.calls == [] and attempt.error is not None
    flat = t.vote(attempt)
    [vote] = supervisor.votes
    assert vote == Vote(StepId(2, 40, 0), 1, False, broken_quorum=5)
    assert t.commit(attempt, flat)
    assert ("step_failed", 40, 5) in supervisor.calls and t.manager.current_step() == 40


def test_a_try_its_peer_committed_is_not_redone_by_the_trainer_that_walked_away_from_the_sum():
    """The peer's all-reduce completed and it voted first (commit); this trainer's wait broke.
    Before, it redid step 40 alone over shards that may have applied it."""
    supervisor = Supervisor(committed_steps=40)
    supervisor.ledger.vote(Vote(StepId(2, 40, 0), 0, True))  # the peer's vote
    t = _trainer(supervisor, Manager(40), pg=Group(error=RuntimeError("gloo: connection reset")))
    t.next_try, t.try_quorum = StepId(2, 40, 0), 5  # the decision of step 39 named it, in this quorum
    attempt = t.quorum()
    attempt.mine = [1]  # computed and pushed (not replayed here)
    flat = t.vote(attempt)
    assert attempt.decision.commit and not attempt.summed
    assert t.commit(attempt, flat)
    # It holds 40 steps, the run 41: it rejoins at the newest checkpoint instead of redoing 40.
    assert ("trainer_setup", 1) in supervisor.calls and t.replacement and t.manager.current_step() == 40
    assert ("commit", 40) not in supervisor.calls


def test_a_heal_past_the_runs_committed_steps_is_refused_and_the_trainer_rejoins():
    """Trainer A redid step 52 on the old fleet while this one rolled back to 40; torchft
    healed this one forward from A. Before, its dense model went on at 52 over shards at 40."""
    supervisor = Supervisor(committed_steps=52)
    supervisor.ledger.rolled_back(40)
    t = _trainer(supervisor, Manager(40, heal_to=52), shards=SimpleNamespace(shards=("s0", "s1")))
    attempt = t.quorum()
    assert isinstance(attempt.error, HealRefused) and ("start_step", 52, 40) in supervisor.calls
    flat = t.vote(attempt)
    assert not attempt.decision.commit and attempt.decision.rejoin
    assert t.commit(attempt, flat)
    assert ("trainer_setup", 1) in supervisor.calls and t.manager.current_step() == 40


def test_a_live_trainers_heal_within_the_committed_steps_is_recorded_and_trains():
    supervisor = Supervisor(committed_steps=52)
    t = _trainer(supervisor, Manager(50, heal_to=52), shards=SimpleNamespace(shards=("s0", "s1")))
    attempt = t.quorum()
    assert attempt.error is None and attempt.id == StepId(2, 52, 0)
    assert ("start_step", 52, 50) in supervisor.calls


def test_a_commit_whose_vote_was_overruled_is_not_named_to_the_shards_and_the_trainer_rejoins():
    """This trainer's sum completed with no failure: it votes without waiting and steps its
    optimizer. A peer whose sum broke had voted first (abort). Before its next lookup names the
    try committed, the answer comes: it rejoins instead."""
    supervisor = Supervisor(committed_steps=40)
    supervisor.ledger.vote(Vote(StepId(2, 40, 0), 0, False, broken_quorum=5))  # the peer's vote, first
    t = _trainer(supervisor, Manager(40))
    t.next_try, t.try_quorum = StepId(2, 40, 0), 5
    attempt = t.quorum()
    attempt.mine = [1]
    flat = t.vote(attempt)
    assert attempt.summed and attempt.decision is None and attempt.vote is not None
    assert t.commit(attempt, flat) and t.manager.current_step() == 41 and t.committed_try == StepId(2, 40, 0)
    assert t.settle_vote()  # rejoined: the run goes on
    assert ("commit", 40) not in supervisor.calls  # the book never counted its commit report
    assert ("trainer_setup", 1) in supervisor.calls and t.manager.current_step() == 40 and t.replacement


def test_a_commit_whose_vote_stands_names_its_try_to_the_shards():
    supervisor = Supervisor(committed_steps=40)
    t = _trainer(supervisor, Manager(40))
    t.next_try, t.try_quorum = StepId(2, 40, 0), 5
    attempt = t.quorum()
    attempt.mine = [1]
    assert t.commit(attempt, t.vote(attempt)) and t.settle_vote()
    assert t.committed_try == StepId(2, 40, 0) and t.next_try == StepId(2, 41, 0)
    assert ("trainer_setup", 1) not in supervisor.calls and ("commit", 40) in supervisor.calls
