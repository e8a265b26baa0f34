"""Storage faults without Ray: a failed save is tried again after a growing backoff (not at
every step) while training goes on, within ``budgets.max_failed_saves`` in a row (a commit
starts the count again), and a journal that cannot be written in the save's failure handler
fails the run with the journal's reason instead of crashing the save thread."""

from __future__ import annotations

import errno
import os
import sys
import threading
import time

import numpy as np
import pytest
import ray

from actors.supervisor.books import Books, JournalUnwritable
from actors.supervisor.checkpoints import CheckpointCoordinator
from actors.supervisor.costs import SharedCosts
from actors.supervisor.events import EventLog
from actors.supervisor.guard import start_guarded
from actors.supervisor.hooks import HookList, RunHooks
from actors.supervisor.save_failures import FailedSaves
from core.books import SaveFailures
from core.checkpoint import CheckpointStore, DataPosition, ShardRows, write_shard_file
from core.config import config_from_dict
from core.deadlines import Deadlines
from core.journal import Journal, flat_view
from core.records import SaveRequest, Snapshot, WrittenPart
from policies import BudgetLimits, FailurePolicy, OnlineCostModel

pytestmark = pytest.mark.timeout(60)

EVERY = 16
ENOSPC = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
POSITION = DataPosition(next_step=0, microbatches_per_step=4, microbatch_rows=8, num_microbatches=100, seed=0,
                        samples_trained=0)
ROWS = ShardRows(np.zeros(1, np.int32), np.zeros(1, np.int64), np.zeros((1, 4), np.float32), np.zeros(1, np.float32))


class Storage(RunHooks):
    """The checkpoint storage: while ``full``, writing a save fails with ENOSPC (the shards'
    files are being written when the hook point comes), or, with ``phase="snapshot"``, the
    shards fail to snapshot (a Ray error)."""

    def __init__(self, phase: str = "write"):
        self.full, self.phase = False, phase

    def at_point(self, point: str) -> None:
        if self.full and self.phase == "write" and point == "save.snapshotted":
            raise ENOSPC


class _Call:
    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args):
        return self.fn(*args)

    def options(self, **_):
        return self


class FakeShard:
    """A shard's save methods, answered at once (the ray.get of ``no_ray`` passes values on)."""

    def __init__(self, k: int, uri: str, storage: Storage):
        def snapshot(*_):
            if storage.full and storage.phase == "snapshot":
                return ray.exceptions.RayError("shard busy")
            return Snapshot(1, 8, True, "full", 0, 0.0)

        self.save_checkpoint = _Call(snapshot)
        self.save_written = _Call(lambda step: WrittenPart(write_shard_file(uri, step, k, ROWS), 0.0))
        self.confirm_save = _Call(lambda step: None)


@pytest.fixture
def no_ray(monkeypatch):
    """The coordinator's Ray calls on fake shards: the values are the answers (an error raises)."""

    def get(refs, timeout=None):
        for r in refs:
            if isinstance(r, Exception):
                raise r
        return list(refs)

    monkeypatch.setattr(ray, "get", get)
    monkeypatch.setattr(ray, "wait", lambda refs, num_returns=1, timeout=None: (list(refs), []))


class Run:
    """The controller's ``fail``: the first reason ends the run; later ones change nothing."""

    def __init__(self):
        self.reasons: list[str] = []

    def fail(self, reason: str) -> None:
        self.reasons.append(reason)

    def crashed(self, thread: str, err: BaseException) -> None:  # the supervisor actor's on_crash
        self.fail(f"thread {thread} crashed: {type(err).__name__}: {err}")


class FullJournal(Journal):
    """The journal on the disk that filled up: every write fails while ``full``."""

    full = False

    def write(self, doc: dict) -> None:
        if self.full:
            raise ENOSPC
        super().write(doc)


def _coordinator(tmp_path, storage: Storage, run: Run, record_event, max_failed_saves: int = 20):
    cfg = config_from_dict({
        "run_dir": str(tmp_path), "data": {"train": ["x"], "eval": ["y"]},
        "checkpoint": {"keep_last": 100, "every_steps": EVERY}, "budgets": {"max_failed_saves": max_failed_saves},
    })
    costs = SharedCosts(OnlineCostModel(mtbf_s=100.0, save_cost_s=1.0, load_cost_s=1.0, reschedule_cost_s=1.0,
                                        start_s=0.0))
    c = CheckpointCoordinator(
        cfg, _plan(cfg), costs, record_event, lambda: 0.1, storage,
        lambda name, fn, *args: start_guarded(name, fn, run.crashed, *args),
        policy=FailurePolicy(cfg.budgets.limits()), fail=run.fail,
    )
    c.start(0)
    return c, [FakeShard(k, cfg.checkpoint_uri, storage) for k in range(2)]


def _train(c: CheckpointCoordinator, shards, steps: range, storage: Storage, full) -> None:
    """The trainers: after each step, a save where one is due (the storage ``full(step)``)."""
    for step in steps:
        storage.full = full(step)
        due = c.next_due()
        if due is not None and step >= due:
            c.save(SaveRequest(step, b"dense"), shards, "r", POSITION)
            c.drain()  # the background write ends before the next step (joined, not slept on)


def _tried(events: list[dict]) -> list[int]:
    return [e["step"] for e in events if e["kind"] in ("checkpoint_failed", "checkpoint_saved")]


@pytest.mark.parametrize("phase", ["write", "snapshot"])
def test_failed_saves_are_retried_after_a_growing_backoff_not_at_every_step(tmp_path, no_ray, phase):
    # Defect 9: a save that kept failing was tried again at every step, with no end.
    storage, run, events = Storage(phase), Run(), []
    c, shards = _coordinator(tmp_path, storage, run, lambda kind, **f: events.append({"kind": kind, **f}))
    _train(c, shards, range(1, 71), storage, full=lambda step: True)
    # 1, 2, 4, 8 steps apart, then the regular interval (16), never more.
    assert _tried(events) == [16, 17, 19, 23, 31, 47, 63]
    assert [e["failed_in_a_row"] for e in events if e["kind"] == "checkpoint_failed"] == [1, 2, 3, 4, 5, 6, 7]
    assert events[-1]["retry_step"] == 79 == c.next_due()
    _train(c, shards, range(71, 100), storage, full=lambda step: False)
    # The storage came back: the next try commits, and the schedule is the regular one again.
    assert _tried(events)[7:] == [79, 95]
    assert CheckpointStore(c.cfg.checkpoint_uri).list_committed() == [79, 95]
    assert c.failures.view() == SaveFailures(failed=7, longest_in_a_row=7)
    assert flat_view({"format": 2, "checkpoints": c.doc()})["schedule"] == {
        "interval_steps_in_use": EVERY, "failed_saves": 7, "longest_failed_in_a_row": 7}  # what cpr report reads
    assert run.reasons == []  # training went on: 7 in a row is within the budget (20)


def test_too_many_failed_saves_in_a_row_stop_the_run_with_the_budget_message(tmp_path, no_ray):
    storage, run, events = Storage(), Run(), []
    c, shards = _coordinator(tmp_path, storage, run, lambda kind, **f: events.append({"kind": kind, **f}),
                             max_failed_saves=3)
    _train(c, shards, range(1, 24), storage, full=lambda step: True)
    assert _tried(events) == [16, 17, 19, 23]
    assert run.reasons == ["budgets.max_failed_saves: 4 (max 3): 4 checkpoint saves failed in a row, the last of "
                           "step 23: [Errno 28] No space left on device"]


def test_a_commit_starts_the_count_of_failed_saves_again(tmp_path, no_ray):
    storage, run, events = Storage(), Run(), []
    c, shards = _coordinator(tmp_path, storage, run, lambda kind, **f: events.append({"kind": kind, **f}),
                             max_failed_saves=3)
    _train(c, shards, range(1, 46), storage, full=lambda step: not 20 <= step < 30)
    assert _tried(events) == [16, 17, 19, 23, 39, 40, 42]  # three failed, one committed, three failed
    assert run.reasons == []  # never more than three in a row
    assert c.failures.view() == SaveFailures(failed=6, longest_in_a_row=3)
    # --resume: the report keeps the earlier attempt's failed saves; the budget starts again.
    resumed = FailedSaves(FailurePolicy(BudgetLimits()), run.fail)
    resumed.carry(c.doc())
    assert resumed.view() == SaveFailures(failed=6, longest_in_a_row=3) and resumed.failed_in_a_row == 0


def test_a_full_disk_that_stops_the_journal_fails_the_run_with_that_reason(tmp_path, no_ray):
    # Defect 9: the save thread's failure handler recorded the failure, the journal beside the
    # checkpoints could not be written, and the handler itself crashed the thread.
    storage, run = Storage(), Run()
    lock = threading.RLock()
    journal = FullJournal(tmp_path)
    books = Books(journal, lock, {"run_id": "r"}, on_unwritable=run.fail)
    events = EventLog(lock, HookList(), books.persist)
    books.add("events", events)
    c, shards = _coordinator(tmp_path, storage, run, events.record)
    books.add("checkpoints", c)
    storage.full = journal.full = True
    c.save(SaveRequest(EVERY, b"dense"), shards, "r", POSITION)
    c.drain()
    assert run.reasons[0] == (f"the supervisor's journal could not be written ({journal.path}): "
                              "[Errno 28] No space left on device"), run.reasons
    assert c.next_due() == EVERY + 1 and c.failures.failed_in_a_row == 1  # the failed save was handled first


def test_books_fail_the_run_once_when_the_journal_cannot_be_written(tmp_path):
    journal, reasons = FullJournal(tmp_path), []
    journal.full = True

    def fail(reason: str) -> None:  # as the controller's: failing persists once more, and that fails too
        reasons.append(reason)
        with pytest.raises(JournalUnwritable):
            books.persist()

    books = Books(journal, threading.RLock(), {"run_id": "r"}, on_unwritable=fail)
    for _ in range(2):
        with pytest.raises(JournalUnwritable) as raised:
            books.persist()
        assert isinstance(raised.value.__cause__, OSError)
    assert reasons == [f"the supervisor's journal could not be written ({journal.path}): "
                       "[Errno 28] No space left on device"]
    journal.full = False
    books.persist()  # room again: the books are written
    assert journal.load()["run_id"] == "r"


class StuckStorage(Storage):
    """Every shard's file of a save hangs in its write until ``release`` is set."""

    def __init__(self):
        super().__init__()
        self.release = threading.Event()

    def at_point(self, point: str) -> None:
        if point == "save.snapshotted":
            self.release.wait(30)


def test_a_save_that_hangs_is_abandoned_once_and_training_is_not_held_by_it(tmp_path, no_ray, monkeypatch):
    # Before, every step's save call waited the whole drain (2T) for a save whose storage hung,
    # and counted nothing: one step per 2T, with no budget; and once the drain ran out, a second
    # save could start beside the first.
    real = config_from_dict
    monkeypatch.setattr(sys.modules[__name__], "config_from_dict",
                        lambda d: real({**d, "embeddings": {"call_timeout_s": 0.25}}))  # drain 2T = 0.5 s
    storage, run, events = StuckStorage(), Run(), []
    c, shards = _coordinator(tmp_path, storage, run, lambda kind, **f: events.append({"kind": kind, **f}))
    assert c.save(SaveRequest(EVERY, b"dense"), shards, "r", POSITION).saved
    first, waits = c._in_flight, []
    for step in range(2 * EVERY, 2 * EVERY + 40):  # the saving trainer, at each step a save is due
        due = c.next_due()
        if due is not None and step >= due:
            t0 = time.monotonic()
            assert not c.save(SaveRequest(step, b"dense"), shards, "r", POSITION).saved
            waits.append(time.monotonic() - t0)
    assert c._in_flight is first, "no second save beside the one still writing"
    assert waits[0] >= 0.3 and max(waits[1:]) < 0.1, waits  # its deadline once, then no wait at all
    failed = [e for e in events if e["kind"] == "checkpoint_failed"]
    assert failed[0]["step"] == EVERY and "still writes" in failed[0]["error"], failed
    # Each save due while it hangs fails without waiting, after a backoff that grows.
    assert [e["failed_in_a_row"] for e in failed] == list(range(1, len(failed) + 1)) and len(failed) == len(waits)
    gaps = [b["step"] - a["step"] for a, b in zip(failed[1:], failed[2:])]
    assert gaps == sorted(gaps) and gaps[-1] > gaps[0], failed
    storage.release.set()
    first.thread.join(10)
    assert not [e for e in events if e["kind"] == "checkpoint_saved"], "an abandoned save never commits"
    assert c.save(SaveRequest(c.next_due(), b"dense"), shards, "r", POSITION).saved  # the storage answers again


def test_a_save_answers_within_its_deadline_while_the_timeline_is_held(tmp_path, no_ray, monkeypatch):
    # Before, the save waited for the timeline lock with no deadline: a count of lost samples
    # reading a chain's files (or a rollback's fencing) held it, the saving trainer's call ran
    # past what it waits (5 T), and its peers waited in the next quorum as long.
    real = config_from_dict
    monkeypatch.setattr(sys.modules[__name__], "config_from_dict",
                        lambda d: real({**d, "embeddings": {"call_timeout_s": 0.25}}))
    storage, run, events = Storage(), Run(), []
    c, shards = _coordinator(tmp_path, storage, run, lambda kind, **f: events.append({"kind": kind, **f}))
    held, release = threading.Event(), threading.Event()

    def hold():
        with c.timeline():
            held.set()
            release.wait(30)

    threading.Thread(target=hold, daemon=True).start()
    assert held.wait(5)
    t0 = time.monotonic()
    out = c.save(SaveRequest(EVERY, b"dense"), shards, "r", POSITION)
    assert time.monotonic() - t0 < Deadlines(0.25).inner_s("save_checkpoint")
    assert not out.saved and out.next_step == EVERY == c.next_due(), "still due: asked again at the next step"
    assert events == [], "not a failed save"
    release.set()
    assert c.save(SaveRequest(EVERY + 1, b"dense"), shards, "r", POSITION).saved
    c.drain()


def test_a_trainer_book_that_cannot_be_written_fails_the_run_with_its_reason(tmp_path):
    # Before, a commit report whose record could not be appended (a full disk) raised into the
    # report's call, which the trainer does not wait for: the commit was missing from the books
    # and the run went on.
    from actors.supervisor.trainers import TrainerBook
    from core.journal import AppendLog
    from core.records import CommitRecord

    class FullBook(AppendLog):
        def append(self, record: dict) -> None:
            raise ENOSPC

    run = Run()
    lock = threading.RLock()
    books = Books(Journal(tmp_path), lock, {"run_id": "r1"}, on_unwritable=run.fail)
    book = TrainerBook(lock, EventLog(lock, HookList(), lambda: None), lambda: None, HookList(),
                       FailurePolicy(BudgetLimits()), fail=run.fail, kills=list, on_commit=lambda s, g: None,
                       book=FullBook(tmp_path / "trainer_book.jsonl"), num_trainers=1, samples_per_step=8,
                       unwritable=books.unwritable)
    with pytest.raises(JournalUnwritable):
        book.commit(CommitRecord(0, 0, (0,), 1, 1, 0.0, 0, 7, 1))
    [reason] = run.reasons
    assert reason.startswith("the supervisor's trainer book could not be written (") and "No space left" in reason


class FullAfterWriting(Storage):
    """The shards' files are written; then the storage is full (the manifest cannot follow)."""

    def at_point(self, point: str) -> None:
        if self.full and point == "save.files_written":
            raise ENOSPC


def test_a_failed_save_removes_what_it_wrote(tmp_path, no_ray):
    # Before, the files of failed saves stayed until a commit's gc, and on a full disk no commit
    # came: the disk stayed full of them after the fault had passed.
    storage, run, events = FullAfterWriting(), Run(), []
    c, shards = _coordinator(tmp_path, storage, run, lambda kind, **f: events.append({"kind": kind, **f}))
    storage.full = True
    c.save(SaveRequest(EVERY, b"dense"), shards, "r", POSITION)
    c.drain()
    assert [e["kind"] for e in events] == ["checkpoint_failed"]
    assert c.store.list_committed() == [] and not list(c.store._scan()[1]), "an uncommitted save's files are left"


def _plan(cfg):
    """The plan of a run of ``cfg`` on two shards (the manifests record it)."""
    from core.plan import make_plan

    return make_plan(cfg.embeddings.sharding, cfg.model.rows_per_table, 2)
