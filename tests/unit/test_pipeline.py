"""The trainer's data pipeline: a step's read has a deadline shorter than its peers' wait for
it (``Deadlines.data_read_s``), and one reader of the file at a time."""

from __future__ import annotations

import threading
import time

import pytest

from actors.trainer.pipeline import DataReadTimeout, Prefetcher

pytestmark = pytest.mark.timeout(60)

DEADLINE_S = 0.2  # Deadlines.data_read_s, short here


class Store:
    """A loader whose reads hang while ``stuck`` is clear, and that counts readers at once."""

    def __init__(self):
        self.stuck = threading.Event()
        self.stuck.set()
        self.reading = self.most = 0
        self._lock = threading.Lock()

    def load(self, step: int, mine: list[int]):
        with self._lock:
            self.reading += 1
            self.most = max(self.most, self.reading)
        try:
            self.stuck.wait(30)
            return step, tuple(mine)
        finally:
            with self._lock:
                self.reading -= 1


@pytest.fixture
def store():
    store = Store()
    yield store
    store.stuck.set()  # the pool thread ends


@pytest.mark.parametrize("ahead", [(3, [0, 1]), (4, [0]), None], ids=["read-ahead", "wrong-guess", "on-the-spot"])
def test_a_read_that_hangs_fails_the_step_within_its_deadline(store, ahead):
    """Item 6: ``get`` waited for a read with no deadline: a store that hangs hung the trainer,
    and its peers timed out in the all-reduce. Now it raises ``DataReadTimeout`` (the step
    fails on this trainer, no shard is at fault), however the read came: loaded ahead, behind
    a wrong guess still loading, or on the spot."""
    prefetch = Prefetcher(store.load, DEADLINE_S)
    store.stuck.clear()
    if ahead is not None:
        prefetch.ahead(*ahead)
    t0 = time.monotonic()
    with pytest.raises(DataReadTimeout, match=r"step 3: microbatches \[0, 1\] not read within 0.2s"):
        prefetch.get(3, [0, 1])
    assert DEADLINE_S <= time.monotonic() - t0 < DEADLINE_S + 0.5
    store.stuck.set()  # the store answers again: the redone step reads
    assert prefetch.get(3, [0, 1]) == (3, (0, 1))
    assert store.most == 1, "one reader of the file at a time"
    prefetch.close()


def test_a_wrong_guess_still_loading_is_read_past_within_the_deadline(store):
    prefetch = Prefetcher(store.load, 5.0)
    prefetch.ahead(4, [0])  # the guess: the next step, same microbatches
    assert prefetch.get(4, [1]) == (4, (1,))  # a new quorum: other microbatches
    assert store.most == 1
    prefetch.close()


def test_a_read_that_fails_raises_its_own_error(store):
    def load(step, mine):
        raise TimeoutError("the store's own timeout")

    prefetch = Prefetcher(load, DEADLINE_S)
    with pytest.raises(TimeoutError, match="the store's own timeout") as raised:
        prefetch.get(1, [0])
    assert not isinstance(raised.value, DataReadTimeout)  # not a hang: the loader's error, as before
    prefetch.close()
