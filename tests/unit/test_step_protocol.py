"""The step ledger (``core.step_protocol``): one decision per try, whoever votes first, and what
each trainer does next; journaled in the trainer book so that a restarted supervisor answers a
late vote as the one before it did."""

from __future__ import annotations

import pytest

from core.journal import AppendLog
from core.step_protocol import StepId, StepLedger, Vote
from tests.unit.test_supervisor_books import _book

G = 3


def _try(step, attempt=0, generation=G):
    return StepId(generation, step, attempt)


# (votes in the order they reach the ledger: (rank, ok)), the try's decision, the next try
@pytest.mark.parametrize("votes, commit", [
    ([(0, True), (1, True)], True),
    # A trainer that walked away from a broken group after its peer's all-reduce completed:
    # before, the peer committed and this one redid the step (a split commit).
    ([(0, True), (1, False)], True),
    ([(1, False), (0, True)], False),
    ([(0, False), (1, False)], False),
])
def test_the_first_vote_of_a_try_decides_it_for_every_trainer(votes, commit):
    ledger = StepLedger(committed_steps=10)
    decisions = [ledger.vote(Vote(_try(10), rank, ok))[0] for rank, ok in votes]
    assert {d.commit for d in decisions} == {commit}
    assert {d.next for d in decisions} == {_try(11) if commit else _try(10, 1)}
    assert all(not d.rejoin for d in decisions)
    assert ledger.committed_steps() == (11 if commit else 10)
    assert ledger.committed == (_try(10) if commit else None)


def test_an_aborted_try_is_followed_by_the_next_attempt_and_a_late_vote_changes_nothing():
    ledger = StepLedger(committed_steps=10)
    assert ledger.vote(Vote(_try(10, 0), 0, False))[0].next == _try(10, 1)
    assert ledger.start(G, 10) .step == _try(10, 1)  # a trainer that did not vote starts there too
    decision, new = ledger.vote(Vote(_try(10, 1), 0, True))
    assert decision.commit and new and decision.committed == _try(10, 1)
    late, new = ledger.vote(Vote(_try(10, 0), 1, True))  # a vote of the aborted try, delivered late
    assert not late.commit and not new and late.rejoin  # its step is committed: that trainer is behind


@pytest.mark.parametrize("step, why", [(7, "a stalled trainer redoing committed steps"),
                                       (14, "a dense model healed past the run's committed steps")])
def test_a_try_off_the_committed_steps_never_commits_and_its_trainer_rejoins(step, why):
    ledger = StepLedger(committed_steps=10)
    decision, _ = ledger.vote(Vote(_try(step), 0, True))
    assert not decision.commit and decision.rejoin, why
    assert ledger.committed_steps() == 10


def test_a_heal_past_a_rollback_is_refused():
    """Trainer A redoes step 30 on the old fleet while B rolls back to 20; torchft heals B
    forward from A (the highest step in the quorum). Before, nothing noticed: the dense model
    ended at 30 with the shards at 20."""
    ledger = StepLedger(committed_steps=30)
    ledger.rolled_back(20)
    assert not ledger.start(G + 1, 30, healed=True).heal_allowed
    assert ledger.start(G + 1, 20, healed=True).heal_allowed
    assert ledger.start(G + 1, 30).heal_allowed  # no heal: nothing to refuse (its vote is refused instead)
    assert ledger.committed is None and ledger.committed_steps() == 20


def test_a_new_attempt_of_the_run_learns_its_committed_steps_from_its_first_commit():
    ledger = StepLedger()
    assert ledger.start(0, 500, healed=True).heal_allowed
    assert ledger.vote(Vote(_try(500, generation=0), 0, True))[0].commit
    assert ledger.committed_steps() == 501


def test_a_restarted_supervisor_answers_a_late_vote_as_the_one_before_it(tmp_path):
    book = _book(tmp_path)
    assert book.decide(Vote(_try(0), 0, True)).commit
    assert not book.decide(Vote(_try(1), 1, False, broken_quorum=9)).commit
    assert book.group_broken(9, 1)  # the peers still waiting in that all-reduce walk away
    book.prune(1)  # a rollback to step 1: nothing of the abandoned timeline is decided
    assert not book.decide(Vote(_try(1, 1, G + 1), 0, False)).commit
    restarted = _book(tmp_path)
    restarted.load(book.doc(), AppendLog.read(tmp_path / "trainer_book.jsonl"))
    assert restarted.decide(Vote(_try(1, 1, G + 1), 1, True)).commit is False
    assert restarted.decide(Vote(_try(1, 2, G + 1), 1, True)).commit
    assert restarted.group_broken(9, 1) and restarted.timeline_steps() == 2


def test_a_heal_is_recorded_whether_a_replacement_or_a_live_trainer_healed(tmp_path):
    book = _book(tmp_path)
    book.decide(Vote(_try(0), 0, True))
    assert book.start_step(1, G, 1, healed_from=0).heal_allowed
    assert not book.start_step(1, G, 5, healed_from=0).heal_allowed
    assert [(e["from_step"], e["step"], e["allowed"]) for e in book._events.recent("dense_healed")] == [
        (0, 1, True), (0, 5, False)]


def test_a_rollback_keeps_the_abandoned_tries_aborted_and_never_reuses_their_identity():
    """Every trainer restarted at the checkpoint where the shards stand (no new generation): a
    late vote of the abandoned timeline's try is aborted, and the new try of that step gets
    another attempt number, so no shard or vote mistakes one for the other."""
    ledger = StepLedger(committed_steps=20)
    assert ledger.vote(Vote(_try(20), 0, True))[0].commit
    ledger.rolled_back(20)
    late, new = ledger.vote(Vote(_try(20), 1, True))
    assert not late.commit and not new and not late.rejoin
    assert ledger.start(G, 20).step == _try(20, 1)
    assert ledger.committed_steps() == 20


def test_the_new_timeline_commits_step_after_step_after_a_rollback():
    """The rollback's step gets a fresh attempt; the steps after it start at attempt 0 as usual.
    (CI at 62247e1: step 41's first try after a rollback to 40 was taken for a pre-rollback one
    and aborted; with the vote not waited for, every trainer rejoined, over and over.)"""
    ledger = StepLedger(committed_steps=46)
    ledger.rolled_back(40, G + 1)
    start = ledger.start(G + 1, 40)
    assert start.step == _try(40, 1, G + 1)
    assert ledger.vote(Vote(start.step, 0, True))[0].commit
    assert ledger.vote(Vote(_try(41, 0, G + 1), 0, True))[0].commit
    assert not ledger.vote(Vote(_try(42, 0, G), 1, True))[0].commit  # the old generation's, late
