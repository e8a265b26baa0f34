"""A recovery decides from what the survivors confirm in one round (``actors.supervisor.facts``),
not from the supervisor's books: table tests of the pure decisions, no Ray."""

from __future__ import annotations

import pytest

from actors.supervisor.facts import BooksView, Survey, confirmed_steps, decide_replacement, decide_shard_loss
from core.records import ShardFacts, TrainerFacts


def shard(k, gen=0, applied=50, first=0, complete=None):
    return ShardFacts(shard_id=k, generation=gen, pid=100 + k, applied_steps=applied, first_step=first,
                      complete_step=complete, held_steps=applied)


def mirror(of, held=51, in_sync=True, applied=50):
    return ShardFacts(shard_id=None, generation=0, pid=200 + of, applied_steps=applied, first_step=None,
                      mirror_of=of, held_steps=held, in_sync=in_sync)


def trainer(rank, steps=51, established=True):
    return TrainerFacts(rank=rank, pid=300 + rank, steps=steps, established=established)


BOOKS = BooksView(generations=(0, 0, 0), first_steps=(0, 0, 0), committed_steps=51, mirrors={1: "m1"})


@pytest.mark.parametrize("survey, books, promote, why", [
    # The mirror confirms it is in sync and holds every committed step: it takes the place.
    (Survey({0: shard(0), 2: shard(2)}, {1: mirror(1)}, {0: trainer(0), 1: trainer(1)}), BOOKS, True, "confirms"),
    # The books say the mirror is ready; its process says it broke (missed a step).
    (Survey({0: shard(0)}, {1: mirror(1, in_sync=False)}, {0: trainer(0)}), BOOKS, False, "not in sync"),
    # It holds 51 steps, but a trainer confirms 52 committed (its commit report had not arrived).
    (Survey({0: shard(0)}, {1: mirror(1, held=51)}, {0: trainer(0, steps=52)}), BOOKS, False, "missed a step"),
    # A survivor applied 53 steps: at least 53 are committed, whatever the reports say.
    (Survey({0: shard(0, applied=53)}, {1: mirror(1, held=52)}, {}), BOOKS, False, "missed a step"),
    # It did not answer in time, or Ray says it is gone: no promotion, saying which.
    (Survey({0: shard(0)}, {1: None}, {}), BOOKS, False, "did not answer"),
    (Survey({0: shard(0)}, {}, {}), BOOKS, False, "is gone"),
    # A mirror of another shard answering under this shard's mirror's name.
    (Survey({0: shard(0)}, {1: mirror(0)}, {}), BOOKS, False, "not in sync"),
    # No mirror in the books at all (none was ready).
    (Survey({0: shard(0)}, {}, {}), BooksView((0, 0, 0), (0, 0, 0), 51, {}), False, "none was ready"),
])
def test_a_mirror_takes_its_primarys_place_only_on_its_own_confirmation(survey, books, promote, why):
    d = decide_shard_loss(1, survey, books)
    assert d.promote_mirror is promote and why in d.mirror_reason, d.mirror_reason


def test_confirmed_steps_are_the_most_any_process_or_report_confirms():
    survey = Survey({0: shard(0, applied=40)}, {}, {0: trainer(0, steps=41), 1: None})
    assert confirmed_steps(survey, BooksView((0,), (0,), 39, {})) == 41
    assert confirmed_steps(Survey({}, {}, {}), BooksView((0,), (0,), 39, {})) == 39


def test_a_survivors_first_step_corrects_the_books_and_says_so():
    # The books lost the first step of shard 2's generation (a recovery cleared it and no
    # trainer settled it yet): its own answer fills it in, a lag. Shard 0 says another first
    # step than the books: a contradiction, corrected and reported.
    books = BooksView((0, 0, 3), (0, 0, None), 51, {})
    survey = Survey({0: shard(0, first=7), 2: shard(2, gen=3, first=44)}, {}, {0: trainer(0)})
    d = decide_shard_loss(1, survey, books)
    assert d.first_steps == (7, 0, 44)
    kinds = {(f.kind, f.subject) for f in d.findings}
    assert kinds == {("contradiction", "shard:0"), ("lag", "shard:2")}, d.findings


def test_a_promoted_mirror_answers_no_first_step_and_the_books_keep_its_primarys():
    # A promoted mirror's rows hold its primary's steps: its first step stays the primary's.
    books = BooksView((0, 2), (0, 12), 60, {})
    promoted = ShardFacts(shard_id=1, generation=2, pid=9, applied_steps=60, first_step=None)
    d = decide_shard_loss(0, Survey({1: promoted}, {}, {}), books)
    assert d.first_steps == (0, 12) and d.findings == ()


def test_a_process_that_is_not_the_generation_the_books_name_is_a_contradiction():
    d = decide_shard_loss(0, Survey({1: shard(1, gen=4, applied=10)}, {}, {}), BooksView((0, 3), (0, 0), 10, {}))
    assert [(f.kind, f.subject) for f in d.findings] == [("contradiction", "shard:1")]


def test_commit_reports_ahead_of_every_trainer_are_a_contradiction_and_behind_them_a_lag():
    behind = decide_shard_loss(0, Survey({}, {}, {0: trainer(0, steps=60)}), BooksView((0,), (0,), 55, {}))
    assert [(f.kind, f.subject) for f in behind.findings] == [("lag", "commits")] and behind.committed_steps == 60
    ahead = decide_shard_loss(0, Survey({}, {}, {0: trainer(0, steps=50)}), BooksView((0,), (0,), 55, {}))
    assert [(f.kind, f.subject) for f in ahead.findings] == [("contradiction", "commits")]


@pytest.mark.parametrize("answers, action", [
    # Every other trainer is gone (Ray says so): every trainer died, roll the shards back.
    ({}, "roll back"),
    # A survivor says it holds 131 steps: it is ahead of checkpoint 100; heal from it. No
    # clock is compared (before, its commit time on its host against its registration time on
    # the supervisor's decided whether it counted).
    ({1: trainer(1, steps=131)}, "heal"),
    # A survivor that did not answer in time may be ahead: wait for it rather than roll back.
    ({1: None}, "heal"),
    # A survivor at the checkpoint's own step (it rolled back there): nothing to roll back.
    ({1: trainer(1, steps=100)}, "join"),
    # Another replacement still at its checkpoint holds nothing newer: it does not count.
    ({1: trainer(1, steps=100, established=False)}, "roll back"),
    ({1: trainer(1, steps=100, established=False), 2: trainer(2, steps=140)}, "heal"),
])
def test_a_replacement_at_its_checkpoint_decides_from_what_its_peers_say(answers, action):
    assert decide_replacement(100, 0, answers).action == action


def test_the_replacement_itself_is_not_its_own_peer():
    assert decide_replacement(100, 0, {0: trainer(0, steps=140)}).action == "roll back"


def test_a_replacement_at_its_checkpoint_or_a_mirror_that_just_died_is_no_contradiction():
    # A replacement that has not healed holds its checkpoint's steps, fewer than the books'
    # commits: not evidence against them. A mirror that died (or broke) a moment before its
    # primary: the books had not heard yet, a lag.
    books = BooksView((0, 0), (0, 0), 60, {1: "m1"})
    d = decide_shard_loss(1, Survey({}, {}, {0: trainer(0, steps=40, established=False), 2: None}), books)
    assert [(f.kind, f.subject) for f in d.findings] == [("lag", "mirror:1")] and not d.promote_mirror
    d = decide_shard_loss(1, Survey({0: shard(0, applied=59)}, {1: mirror(1, in_sync=False)}, {}), books)
    assert [(f.kind, f.subject) for f in d.findings] == [("lag", "mirror:1")]


def test_a_shard_loaded_from_a_checkpoint_that_applied_nothing_since_is_no_contradiction():
    # Found by the soak (seed 5): shard 0 came back from checkpoint 196 while the trainers
    # had committed 203 steps, then every trainer died before one more step; when shard 1
    # died, shard 0 held 197 steps and no trainer was established. Its rows hold the
    # checkpoint's steps, not the run's: no evidence against the commit reports.
    books = BooksView((1, 0), (173, 0), 203, {})
    loaded = Survey({0: shard(0, gen=1, applied=196, first=None)}, {}, {0: trainer(0, 173, established=False)})
    assert decide_shard_loss(1, loaded, books).findings == ()
    # Once it applied a step since its load, it holds every committed step but the last.
    trained = Survey({0: shard(0, gen=1, applied=196, first=173)}, {}, {})
    assert [(f.kind, f.subject) for f in decide_shard_loss(1, trained, books).findings] == [("contradiction", "commits")]
