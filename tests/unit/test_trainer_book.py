"""The trainer book's order and places: progress kept in the order trainers sent it, and a
rank's place (actors.lease) given to each new process and taken when its host is lost."""

from __future__ import annotations

from core.records import Progress, TrainerStart
from tests.unit.test_supervisor_books import _book


def test_progress_reports_recorded_out_of_order_keep_the_order_they_were_sent_in(tmp_path):
    # The supervisor runs calls on several threads: step 5's report may be recorded before
    # step 4's. The last progress is still step 5 (the emulation's clock counts steps from it).
    book = _book(tmp_path)
    for step, sent in ((3, 10.0), (5, 10.3), (4, 10.15)):
        book.progress(Progress(step=step, total_steps=9, loss=0.5, samples_per_s=1.0, trainers=2, time=sent))
    assert book.last_progress().step == 5
    assert [p.step for p in book.recent_progress()] == [3, 4, 5]


def test_a_trainers_place_goes_to_each_new_process_and_is_taken_when_its_host_is_lost(tmp_path):
    placed = []
    book = _book(tmp_path)
    book._place = lambda rank, pid, node: placed.append((rank, pid, node))
    book.register(TrainerStart(0, 11, "a"))
    book.register(TrainerStart(0, 11, "a"))  # the call repeats until every trainer is in
    book.register(TrainerStart(1, 12, "b"))
    book.lose_node("a")
    book.register(TrainerStart(0, 11, "c"))  # the same pid on another host (PID namespaces): a new process
    assert placed == [(0, 11, "a"), (1, 12, "b"), (0, None, "a"), (0, 11, "c")]
