"""Whose history a supervisor takes, and what each attempt of a run counts: another run's
journal is never adopted, a resumed run keeps every attempt's records apart, and a report that
Ray delivers twice (a call retried across a supervisor restart) counts once. No Ray."""

from __future__ import annotations

import json

import pytest

from actors.supervisor.actor import history_to_use
from actors.supervisor.step_records import read_commits
from core.books import KillRecord
from core.errors import ConfigError
from core.journal import STATE_FILE, AppendLog, refuse_another_run
from core.records import CommitRecord, StepFailure, TrainerStart
from policies import BudgetLimits
from tests.unit.test_supervisor_books import _book, _failure, _ledger


@pytest.mark.parametrize("journal_run, resume, reconstructed, use", [
    ("r2", False, True, "rebuild"),  # Ray restarted this run's supervisor: its own journal
    ("r1", False, True, None),  # another run's journal in the same directory: never adopted
    ("r1", False, False, None),
    ("r1", True, False, "continue"),  # --resume: the attempt before this one
    ("r1", True, True, "continue"),  # a resumed attempt's supervisor restarted before its first write
    ("r2", True, True, "rebuild"),  # ... and after it
    (None, False, True, None),
])
def test_a_supervisor_takes_only_its_own_runs_history(journal_run, resume, reconstructed, use):
    assert history_to_use(journal_run, "r2", resume, reconstructed) == use


def test_a_new_run_refuses_a_directory_that_holds_another_runs_journal(tmp_path):
    refuse_another_run(tmp_path, None)  # nothing there
    (tmp_path / STATE_FILE).write_text(json.dumps({"format": 2, "run_id": "ab12cd34"}))
    with pytest.raises(ConfigError, match="journal of run ab12cd34.*--resume"):
        refuse_another_run(tmp_path, None)


def _commits(tmp_path, book):
    """The final timeline's commits as the book file holds them."""
    return read_commits(AppendLog.read(tmp_path / "trainer_book.jsonl"), book.doc()["prunes"])


def _commit(step, rank, pid, seq, time):
    return CommitRecord(step, rank, (4 * step + rank,), 2, 2, time, 0, pid, seq)


def test_a_report_delivered_twice_counts_once_also_across_a_restart(tmp_path):
    # Ray retries a call whose supervisor died before answering: the same commit or failed step
    # arrived twice, doubling a step's microbatches and spending the redo budget twice.
    fails: list[str] = []
    book = _book(tmp_path, fails=fails, limits=BudgetLimits(max_step_redos=1))
    book.register(TrainerStart(0, 11, "n"))
    for _ in range(2):
        book.commit(_commit(5, 0, 11, 1, 1.0))
        book.step_failed(StepFailure(6, 0, 2.0, "shard 1: ActorDiedError", None, 11, 2))
    assert _commits(tmp_path, book)[5].microbatches == (20,) and fails == []
    restarted = _book(tmp_path)
    restarted.load(book.doc(), AppendLog.read(tmp_path / "trainer_book.jsonl"))
    restarted.commit(_commit(5, 0, 11, 1, 1.0))  # retried once more, after the restart
    assert _commits(tmp_path, restarted)[5].microbatches == (20,)


def test_each_attempt_matches_its_trainer_kills_with_its_own_commits_and_heals(tmp_path):
    # Before, a kill of attempt 1 was matched with attempt 2's heal of the same rank (its
    # "replacement" came back 20 minutes later), and attempt 2's commits of a step were added to
    # attempt 1's (its microbatches twice).
    kills = [KillRecord("trainer:1", 10.0, 12, "at step 3")]
    book = _book(tmp_path, kills=kills)
    book.commit(_commit(3, 0, 11, 1, 9.0))
    book.commit(_commit(4, 0, 11, 2, 10.5))
    book._steps.begin_attempt(100.0)  # attempt 1 ends at 100 s, trainer 1 never healed in it
    book.commit(_commit(3, 0, 21, 1, 101.0))
    book.healed(1, 4, 1.0, 102.0)
    [failure] = book.failures()
    assert failure.rejoined_s is None and failure.replacement_joined_at_step is None
    assert _commits(tmp_path, book)[3].microbatches == (12,) and book.last_step_committed() == 3


def test_failures_left_open_by_an_earlier_attempt_close_where_it_stopped():
    # Before, they closed at the resumed attempt's last step: a full recovery of attempt 1 was
    # said to have recomputed every step of attempt 2.
    counted: list[str] = []
    ledger = _ledger(counted)
    ledger.add([_failure("full", None, 40, shard=0), _failure("partial", None, 30, shard=1)])
    ledger.begin_attempt(52)
    assert [f.failed_at_step for f in ledger.records()] == [52, 52]
    assert ledger.records()[0].lost_steps_recomputed == 12  # steps 40..51, lost to the rollback
    assert counted == ["shard:1"]
    ledger.close_all(900)  # attempt 2's end: nothing of attempt 1 moves
    assert [f.failed_at_step for f in ledger.records()] == [52, 52]


def test_a_replacement_with_its_predecessors_pid_on_another_host_is_a_new_process(tmp_path):
    # Pids repeat across hosts (containers): a replacement numbering its reports from 1 again
    # had every report dropped as a retry of its predecessor's until it passed its count.
    book = _book(tmp_path)
    for seq in range(1, 6):
        book.commit(CommitRecord(seq, 1, (4 * seq + 1,), 2, 2, float(seq), 0, 11, seq, "first"))
    book.commit(CommitRecord(6, 1, (25,), 2, 2, 6.0, 0, 11, 1, "second"))  # the same pid, elsewhere
    assert book.last_step_committed() == 6
