"""MFU/SSU access tracking beside the step, not in it: a shard hands a step's ids to a thread
of its own once, when it applies the step (not at each lookup: a redone step is looked up
again), and the thread updates the policy's counts in the order the steps came, between the
shard's requests.

Tracking in the lookup cost about 4 % of every step (``np.unique`` over the step's ids): more
than the full saves it was meant to make cheaper. The thread counts while holding the shard's
lock, so it runs while the shard is idle (the trainers compute their dense part) and never
competes with a request for the interpreter. Whoever reads or changes the policy (a save's
selection, a confirmation, a load) holds that lock and first ``drain``s the queue on its own
thread: the policy then sees exactly the accesses it would have seen inline, in the same
order, and selects the same rows. A step applied in a lookup served over the shard's link
wakes the thread only once its reply is sent: woken during the request, it took the CPU from
the thread serving it on a busy node (the emulation's MFU and SSU runs lost 1.4 % of their
steps that way).
"""

from __future__ import annotations

import inspect
import logging
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable

__all__ = ["AccessTracker", "MAX_QUEUED"]

MAX_QUEUED = 32  # steps' ids waiting for the thread before the next step's apply counts them itself

logger = logging.getLogger(__name__)


class AccessTracker:
    """Runs ``track(*args)`` for every ``put(*args)``, in order, on one thread while it holds
    ``lock`` (the owner's; an own one without), or in ``drain``'s caller."""

    def __init__(self, track: Callable[..., None], name: str, lock: threading.RLock | None = None):
        # A bound method is held weakly: the thread must not keep its owner (and the shard's
        # tables) alive once nothing else does.
        self._track = weakref.WeakMethod(track) if inspect.ismethod(track) else (lambda: track)
        self._lock = lock or threading.RLock()
        self._queue: deque = deque()
        self._cv = threading.Condition()
        self._error: BaseException | None = None
        self.busy_s = 0.0  # time spent counting (CPU beside the step)
        self._thread = threading.Thread(target=self._run, name=f"cpr-tracking-{name}", daemon=True)
        self._thread.start()

    def put(self, *args, wake: bool = True) -> None:
        """Queues an access; ``wake`` False leaves the thread asleep until ``wake()`` (after the
        reply: woken during a request, it took the CPU from the thread serving it)."""
        with self._cv:
            self._raise_if_failed()
            self._queue.append(args)
            if wake:
                self._cv.notify_all()
            backlog = len(self._queue) > MAX_QUEUED
        if backlog:  # the thread got no CPU for a while: count here rather than hold the ids
            with self._lock:
                self._count_all()

    def wake(self) -> None:
        with self._cv:
            if self._queue:
                self._cv.notify_all()

    def drain(self) -> None:
        """Counts every access put so far, here; raises if tracking failed."""
        with self._lock:
            self._count_all()
        with self._cv:
            self._raise_if_failed()

    def reset(self) -> None:
        """Forgets the accesses not counted yet and a failure (the counts start again: a load)."""
        with self._lock, self._cv:
            self._queue.clear()
            self._error = None

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"access tracking failed: {self._error!r}") from self._error

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._queue:
                    self._cv.wait()
            with self._lock:  # between the owner's requests, never during one
                self._count_all()

    def _count_all(self) -> None:
        """Counts the queued accesses (the caller holds ``_lock``)."""
        while True:
            with self._cv:
                if not self._queue or self._error is not None:
                    return
                args = self._queue.popleft()
            t0 = time.perf_counter()
            track = self._track()
            try:
                if track is not None:
                    track(*args)
            except BaseException as err:  # noqa: BLE001 - kept, and raised by the next put or drain
                logger.exception("access tracking failed; the shard's next lookup or save raises it")
                with self._cv:
                    self._error = err
            finally:
                track = args = None  # no reference to the owner while waiting
                self.busy_s += time.perf_counter() - t0
