"""The supervisor's state stays bounded over a long run (issue 39, defect 10): the trainer book
keeps a window of steps and running tallies, the event log the last events and the kinds it
reads back, a journal write costs what changed, and a shard keeps a window of applied steps.
A restarted supervisor reads the same books back from the journal and the files. No Ray."""

from __future__ import annotations

import gc
import json
import os
import statistics
import sys
import threading
import types

import numpy as np
import pytest

from actors.supervisor.books import Books
from actors.supervisor.events import TAIL_EVENTS, EventLog
from actors.supervisor.hooks import HookList, RunLogHook
from actors.supervisor.ledger import FailureLedger
from actors.supervisor.step_records import read_commits
from actors.supervisor.trainers import TrainerBook
from core.accounting import trainer_failures
from core.books import KillRecord
from core.codec import decode
from core.errors import ConfigError
from core.journal import BOOK_FILE, EVENTS_FILE, STATE_FILE, AppendLog, Journal, RunLog, refuse_old_journal
from core.records import CommitRecord, Heal, Progress, StepFailure, TrainerStart
from policies import BudgetLimits, FailurePolicy

pytestmark = pytest.mark.timeout(120)

STEPS = 10_000
T0 = 1_000.0
# Trainer 1 dies at step 3,000 (back at 3,050), trainer 0 at 7,000 (back at 7,040); a rollback
# at step 5,000 goes back to step 4,990.
KILLS = [KillRecord("trainer:1", T0 + 300.0 - 0.05, 101, "chaos"),
         KillRecord("trainer:0", T0 + 700.0 - 0.05, 100, "chaos")]
OUTAGES = {1: (3000, 3050), 0: (7000, 7040)}


class _Parts:
    """The books a supervisor journals, over real files in ``run_dir`` (``files``: the event
    log and the progress log write theirs, as in a run)."""

    def __init__(self, run_dir, files: bool = True, fresh: bool = True):
        self.run_dir, self.lock, hooks = run_dir, threading.RLock(), HookList()
        self.journal = Journal(run_dir)
        self.books = Books(self.journal, self.lock, {"run_id": "r1", "attempt": 1, "supervisor_restarts": 0})
        kwargs = {"file": AppendLog(run_dir / EVENTS_FILE, fresh=fresh)} if files else {}
        self.events = EventLog(self.lock, hooks, self.books.persist, **kwargs)
        if files:
            self.run_log = RunLog(run_dir, fresh=fresh)
            hooks.add(RunLogHook(self.run_log))
        self.ledger = FailureLedger(self.lock, self.events, self.books.persist, lambda f: 0.0,
                                    lambda name, fn, *args: fn(*args), hooks)
        self.trainers = TrainerBook(
            self.lock, self.events, self.books.persist, hooks, FailurePolicy(BudgetLimits()), fail=lambda r: None,
            kills=lambda: [k for k in KILLS if k in self.ledger.kills()], on_commit=lambda step, generation: None,
            book=AppendLog(run_dir / BOOK_FILE, fresh=fresh), num_trainers=2, samples_per_step=1024,
        )
        for name, part in (("events", self.events), ("ledger", self.ledger), ("trainers", self.trainers)):
            self.books.add(name, part)

    def load(self) -> None:
        """As ``actors.supervisor.restart`` reads them back."""
        doc = self.journal.load()
        self.events.load(doc["events"])
        self.ledger.load(doc["ledger"])
        self.trainers.load(doc["trainers"], AppendLog.iter(self.run_dir / BOOK_FILE))


def _drive(p: _Parts, steps: range, on_step=lambda step: None, save_every: int = 1, seq=None) -> None:
    """Two trainers commit every step (four microbatches), rank 0 reports progress, a save is
    recorded every ``save_every`` steps; the kills, outages and the rollback of the module's
    schedule happen on their steps."""
    seq = seq if seq is not None else {0: 0, 1: 0}
    for step in steps:
        t = T0 + step / 10
        if step == 5000 and not p.trainers.committed_since(5000) and p.trainers.last_step_committed() == 4999:
            p.trainers.prune(4990)  # a rollback: steps 4,990.. are redone
            _drive(p, range(4990, 5000), on_step, save_every, seq)
        for dead, (down, back) in OUTAGES.items():
            survivor = 1 - dead
            if step == down:
                p.ledger.record_kill(next(k for k in KILLS if k.target == f"trainer:{dead}"))
                seq[survivor] += 1
                p.trainers.step_failed(StepFailure(step, survivor, t - 0.02, "peer died", 7, 100 + survivor, seq[survivor]))
            if step == back:
                p.trainers.healed(dead, step, 1.0, t - 0.01)
        live = [r for r in (0, 1) if not any(down <= step < back and r == dead for dead, (down, back) in OUTAGES.items())]
        for rank in live:
            seq[rank] += 1
            mbs = tuple(4 * step + m for m in ((0, 1, 2, 3) if len(live) == 1 else (2 * rank, 2 * rank + 1)))
            p.trainers.commit(CommitRecord(step, rank, mbs, 4, len(live), t + 0.01 * rank, 0, 100 + rank, seq[rank]))
        p.trainers.progress(Progress(step, STEPS, 0.5, 1e4, len(live), time=t + 0.05))
        if step % save_every == 0:
            p.events.record("checkpoint_saved", step=step, checkpoint_kind="incremental", duration_s=0.01)
        on_step(step)


def _held_bytes(*roots) -> int:
    """Bytes of every object the roots reach (not classes, modules or functions: code)."""
    seen, todo, total = set(), list(roots), 0
    while todo:
        obj = todo.pop()
        if id(obj) in seen or isinstance(obj, (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType)):
            continue
        seen.add(id(obj))
        total += sys.getsizeof(obj)
        todo.extend(gc.get_referents(obj))
    return total


def test_the_trainer_book_and_the_event_log_hold_the_same_memory_at_step_6000_and_at_step_10000(tmp_path):
    # Before, the book kept every commit (with its microbatch ids) and every progress report,
    # and the event log every event: 2.0 MB more at step 10,000 than at 6,000 here (now: none).
    p = _Parts(tmp_path, files=False)
    p.trainers.register(TrainerStart(0, 100, "n"))
    p.trainers.register(TrainerStart(1, 101, "n"))
    held = {}

    def measure(step):
        if step in (6000, STEPS - 1):
            held[step] = _held_bytes(p.trainers, p.events, p.ledger, p.books)

    _drive(p, range(STEPS), measure, save_every=10)
    assert held[STEPS - 1] - held[6000] < 50_000, held


def test_the_bounded_book_counts_what_the_whole_book_file_counts(tmp_path):
    # The window and its tallies against every record: the report's tally and each trainer
    # failure (detection, steps with fewer trainers, heal) as core.accounting counts them from
    # all of the run's commits.
    p = _Parts(tmp_path)
    _drive(p, range(STEPS), save_every=50)
    commits = read_commits(AppendLog.iter(tmp_path / BOOK_FILE), p.trainers.doc()["prunes"])
    assert sorted(commits) == list(range(STEPS)) and {len(c.microbatches) for c in commits.values()} == {4}
    assert sum(1 for c in commits.values() if c.participants < 2) == 90
    tally = p.trainers.tally()
    assert (tally.steps, tally.microbatches_per_step, tally.steps_with_fewer_trainers) == (STEPS, (4,), 90)
    failed = [decode(StepFailure, {k: v for k, v in r.items() if k != "kind"})
              for r in AppendLog.iter(tmp_path / BOOK_FILE) if r["kind"] == "failed"]
    heals = [Heal(rank, back, 1.0, T0 + back / 10 - 0.01) for rank, (_, back) in OUTAGES.items()]
    expected = trainer_failures(KILLS, failed, commits, heals, 2)
    assert p.trainers.failures() == expected
    assert [(f.steps_with_fewer_trainers, f.detection_s) for f in expected] == [(50, 0.03), (40, 0.03)]
    sizes = p.trainers.sizes()
    assert sizes["window"] <= 1024 and sizes["progress"] <= 64 and sizes["seen"] <= 4 * 1024, sizes


def _bytes_per_write(journal_path, run) -> list[int]:
    """What each journal write put on disk, however the journal writes: the file's growth when
    it appends to it, the whole file when it replaces it."""
    sizes, last = [], (None, 0)
    original = Books.persist

    def persist(books):
        nonlocal last
        original(books)
        st = os.stat(journal_path)
        same = last[0] == st.st_ino and st.st_size >= last[1]
        sizes.append(st.st_size - last[1] if same else st.st_size)
        last = (st.st_ino, st.st_size)

    Books.persist = persist
    try:
        run()
    finally:
        Books.persist = original
    return sizes


def test_a_journal_write_costs_the_same_at_step_10000_as_at_step_1000(tmp_path):
    # Before, every write rewrote every event of the run (and the last 200 progress reports):
    # 61 KB a write at step 1,000, 166 KB at step 10,000 here (a save every 10 steps).
    sizes = _bytes_per_write(tmp_path / STATE_FILE,
                             lambda: _drive(_Parts(tmp_path, files=False), range(STEPS), save_every=10))
    first, last = statistics.median(sizes[50:150]), statistics.median(sizes[-100:])
    assert last <= first + 64, (first, last)
    assert max(sizes[50:]) < 8_000, "a snapshot now and then: the state, not the run's history"
    assert (tmp_path / STATE_FILE).stat().st_size < 600_000


def test_a_restarted_supervisor_reads_back_the_books_it_had(tmp_path):
    p = _Parts(tmp_path)
    p.trainers.register(TrainerStart(0, 100, "n"))
    p.events.record("spare_lost", spare="spare-3", node_id="n2")  # a kind the supervisor reads back
    _drive(p, range(6000), save_every=7)
    p.events.append("state_changed", previous="running", state="recovering", reason="shard 0 died")  # not journaled
    before = {"tally": p.trainers.tally(), "failures": p.trainers.failures(), "last": p.trainers.last_step_committed(),
              "progress": p.trainers.recent_progress()[-5:], "count": p.events.count() - 1,
              "spares_lost": p.events.of("spare_lost"), "events": p.events.all()[:-1],
              "recent": p.events.recent()[-50:-1]}
    restarted = _Parts(tmp_path, fresh=False)
    restarted.load()
    after = {"tally": restarted.trainers.tally(), "failures": restarted.trainers.failures(),
             "last": restarted.trainers.last_step_committed(), "progress": restarted.trainers.recent_progress(),
             "count": restarted.events.count(), "spares_lost": restarted.events.of("spare_lost"),
             "events": restarted.events.all(), "recent": restarted.events.recent()[-49:]}
    assert after == before
    assert [e["kind"] for e in AppendLog.read(tmp_path / EVENTS_FILE)][-1] == "checkpoint_saved", \
        "the event whose change never reached the journal is cut from the file, as the change was"
    assert len(restarted.events.recent()) == TAIL_EVENTS
    assert restarted.events.since(before["count"] - 3) == list(before["events"][-3:])
    assert restarted.events.since(5) == list(before["events"][5:]), "a reader far behind reads the file"
    _drive(restarted, range(6000, 6100), seq={0: 10**6, 1: 10**6})  # and it goes on from there
    assert restarted.trainers.tally().steps == 6100


def test_a_journal_reads_back_its_last_complete_write(tmp_path, monkeypatch):
    journal = Journal(tmp_path)
    journal.write({"format": 3, "a": {"x": 1, "y": [1, 2]}, "b": 5})
    journal.write({"format": 3, "a": {"x": 2, "y": [1, 2]}, "b": 5})
    assert journal.last_write_bytes < 40, "only the key that changed"
    journal.write({"format": 3, "a": {"y": [1, 2, 3]}, "b": 6})
    assert journal.load() == {"format": 3, "a": {"y": [1, 2, 3]}, "b": 6}
    with open(tmp_path / STATE_FILE, "a") as f:
        f.write('{"put": {"b": 7')  # a write killed in the middle: it did not happen
    assert Journal(tmp_path).load()["b"] == 6
    real_write = os.write
    monkeypatch.setattr(os, "write", lambda fd, data: real_write(fd, data[:5]))  # the disk fills mid-line
    with pytest.raises(OSError):
        journal.write({"format": 3, "a": {"y": []}, "b": 8})
    monkeypatch.setattr(os, "write", real_write)
    assert Journal(tmp_path).load()["b"] == 6
    journal.write({"format": 3, "a": {"y": []}, "b": 9})  # the disk has room again: a new snapshot
    assert Journal(tmp_path).load() == {"format": 3, "a": {"y": []}, "b": 9}


def test_resume_refuses_a_journal_of_the_format_before(tmp_path):
    refuse_old_journal(tmp_path)  # no journal: nothing to refuse
    (tmp_path / STATE_FILE).write_text(json.dumps({"format": 2, "run_id": "ab12cd34", "events": []}))
    with pytest.raises(ConfigError, match="has format 2, written by another version of cpr"):
        refuse_old_journal(tmp_path)


def test_a_shard_keeps_the_microbatch_ids_of_a_window_of_steps():
    # Before, every applied step's microbatch ids, for the whole run.
    from actors.shard import APPLIED_WINDOW, EmbeddingShard
    from core.plan import make_plan

    plan = make_plan("table_wise", [50] * 26, 1)
    shard = EmbeddingShard(0, list(plan.shards[0]), 4, learning_rate=0.1, eps=1e-8, seed=3, microbatches_per_step=1)
    rows = np.random.default_rng(0).integers(0, 50, size=(2, 26))
    routed = plan.route(rows, 0)
    grad = np.ones((2, 26 * 4), dtype=np.float32)
    steps = APPLIED_WINDOW + 100
    for step in range(steps):
        shard.lookup(step, (step,), routed.lengths, routed.indices)
        shard.push_grads(step, (step,), grad)
    log = shard.applied_log()
    assert len(log) == APPLIED_WINDOW and log[-1] == (steps - 1, (steps - 1,)) and log[0][0] == steps - APPLIED_WINDOW


def test_cpr_report_of_a_crashed_run_counts_its_commits_from_the_trainer_book(tmp_path):
    # Before, a rebuilt report said the steps with fewer trainers, the microbatches per step and
    # each trainer failure's detection were unknown ("commits are not journalled"): the book
    # file had them all along.
    import yaml

    from app.rebuild import rebuild_report
    from core.config import config_from_dict

    cfg = config_from_dict({"run_dir": str(tmp_path), "data": {"train": ["x"], "eval": ["y"]},
                            "training": {"num_trainers": 2}})
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump()))
    p = _Parts(tmp_path)
    _drive(p, range(8000), save_every=100)
    report = rebuild_report(tmp_path)
    assert report["steps_with_fewer_trainers"] == 90 and report["microbatches_per_committed_step"] == [4]
    assert [(t["actor"], t["detection_s"], t["steps_with_fewer_trainers"]) for t in report["trainer_failures"]] == [
        ("trainer:1", 0.03, 50), ("trainer:0", 0.03, 40)]
