"""The failure ledger: every recovered shard death (open until trainers redo a step on its
replacement, then closed and, for a partial recovery, its lost samples counted) and every
injected kill. Counting reads the data cache and the checkpoint files, so it runs on a
guarded thread, off the recovery path and outside the supervisor's lock."""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable

from actors.supervisor.events import EventLog
from actors.supervisor.hooks import RunHooks
from core.codec import decode, encode
from core.errors import CprError
from core.books import FailureRecord, KillRecord

__all__ = ["FailureLedger"]

logger = logging.getLogger(__name__)

# What may go wrong counting (the cache or a checkpoint file unreadable): recorded in the
# failure and the event, never raised into training. Anything else is a bug: the thread crashes.
_COUNT_ERRORS = (OSError, CprError, ValueError, KeyError, IndexError)


class FailureLedger:
    def __init__(
        self,
        lock: threading.RLock,
        events: EventLog,
        persist: Callable[[], None],
        count_lost: Callable[[FailureRecord], float],
        start_thread: Callable[..., threading.Thread],
        hooks: RunHooks,
        protect: Callable[[str, tuple], None] = lambda owner, steps: None,
        release: Callable[[str], None] = lambda owner: None,
    ):
        # A partial recovery's chain is read again to count its lost samples: kept from
        # retention from its record until that count is done.
        self._protect, self._release = protect, release
        self._lock = lock
        self._events = events
        self._persist = persist
        self._count_lost = count_lost
        self._start_thread = start_thread
        self._hooks = hooks
        self._failures: list[FailureRecord] = []
        self._kills: list[KillRecord] = []
        # Where this attempt of the run began (--resume starts a new one): its budgets count
        # from there, and a death is matched with kills of this attempt only.
        self._first_failure = 0
        self._first_kill = 0

    # ------------------------------------------------------------------ kills

    def record_kill(self, kill: KillRecord) -> None:
        with self._lock:
            self._kills.append(kill)

    def withdraw_kill(self, kill: KillRecord) -> bool:
        """A recorded kill whose signal found no process (it died on its own meanwhile): not a
        fault that was injected. True if it was recorded."""
        with self._lock:
            for i in range(len(self._kills) - 1, -1, -1):
                if self._kills[i] == kill:
                    del self._kills[i]
                    return True
            return False

    def kill_of(self, target: str, pid: int | None) -> KillRecord | None:
        """The latest kill of ``target``'s process ``pid`` in this attempt: when its failure
        began. Matched by the process, not by comparing the killer's clock with this one's."""
        with self._lock:
            return next((k for k in reversed(self._kills[self._first_kill:]) if k.target == target and k.pid == pid),
                        None)

    def begin_attempt(self, last_steps: int | None) -> None:
        """A new attempt of the run (--resume): what came before is history. Its failures that
        never closed close at the steps the earlier attempt reached (``last_steps``: committed
        steps): their count ends there, not at this attempt's last step."""
        with self._lock:
            end = last_steps or 0
            todo = [i for i, f in enumerate(self._failures)
                    if f.failed_at_step is None and self._close(i, max(end, f.restored_step))]
            self._first_failure, self._first_kill = len(self._failures), len(self._kills)
        self.count_later(todo)

    def kills(self) -> tuple[KillRecord, ...]:
        with self._lock:
            return tuple(self._kills)

    # ------------------------------------------------------------------ failures

    def records(self) -> tuple[FailureRecord, ...]:
        with self._lock:
            return tuple(self._failures)

    def count(self) -> int:
        """Failures recorded, every attempt."""
        with self._lock:
            return len(self._failures)

    def count_this_attempt(self) -> int:
        """Failures of this attempt: what ``budgets.max_shard_recoveries`` counts."""
        with self._lock:
            return len(self._failures) - self._first_failure

    def add(self, records: list[FailureRecord]) -> None:
        """Part of a transition (the caller persists)."""
        with self._lock:
            first = len(self._failures)
            self._failures.extend(records)
        for i, f in enumerate(records, start=first):
            if f.recovery == "partial" and f.lost_samples is None:
                self._protect(_owner(i), f.chain)

    def _keep_chains(self, indices: list[int]) -> None:
        with self._lock:
            chains = [(i, self._failures[i].chain) for i in indices]
        for i, chain in chains:
            self._protect(_owner(i), chain)

    def _close(self, i: int, redo_step: int) -> bool:
        """Closes open failure ``i`` at ``redo_step``: a full recovery's recomputed steps are
        known now; returns True for a partial one, whose lost samples are still to count."""
        f = self._failures[i]
        if f.failed_at_step is not None:
            return False
        kept = f.recovery in ("partial", "replica")  # the survivors kept their state: nothing recomputed
        recomputed = f.lost_steps_recomputed if kept else max(redo_step - f.restored_step, 0)
        self._failures[i] = dataclasses.replace(f, failed_at_step=redo_step, lost_steps_recomputed=recomputed)
        return f.recovery == "partial"

    def close_settled(self, known_generation: int, redo_step: int,
                      upto_generation: float = float("inf")) -> tuple[list[int], list[int]]:
        """Trainers redo ``redo_step`` on a fleet newer than ``known_generation`` (up to
        ``upto_generation``): the failures recovered since are complete now. Returns the
        shards of every failure closed here (whatever its recovery) and the failures whose
        lost samples are to count (``count_later``). The caller journals the change (a
        supervisor restarted later must not close them again at a later step: seen in the
        soak, 80 steps on)."""
        with self._lock:
            closing = [i for i, f in enumerate(self._failures)
                       if known_generation < f.generation_after <= upto_generation and f.failed_at_step is None]
            todo = [i for i in closing if self._close(i, redo_step)]
            return [self._failures[i].shard for i in closing], todo

    def reopen_after_rollback(self, step: int, before: int) -> list[int]:
        """Everything went back to ``step`` and trainers redo every step from there: a partial
        recovery among the first ``before`` failures loses only updates before ``step``, so
        it closes (or closes again) there. Part of a transition: returns the failures to count
        again once it is journaled (``count_later``)."""
        todo = []
        with self._lock:
            for i, f in enumerate(self._failures[:before]):
                if f.recovery == "partial" and (f.failed_at_step is None or f.failed_at_step > step):
                    # Its count is to come again (a supervisor restarted before it comes counts it).
                    self._failures[i] = dataclasses.replace(f, failed_at_step=None, lost_samples=None,
                                                            lost_samples_error=None)
                    if self._close(i, step):
                        todo.append(i)
        return todo

    def close_from(self, first: int, step: int) -> None:
        """Closes every failure from index ``first`` on at ``step`` (the new trainers of a
        fallback or a resume start there). Part of a transition."""
        with self._lock:
            for i in range(first, len(self._failures)):
                self._close(i, step)

    def close_all(self, final_step: int) -> None:
        """The run is over: this attempt's failures whose redo step never came close at its last
        step, and their lost samples are counted now (before the summary reads them)."""
        with self._lock:
            todo = [i for i in range(self._first_failure, len(self._failures)) if self._close(i, final_step)]
        self._count(todo, errors=(Exception,))  # for the report: an error is recorded with the failure

    def recount_open_counts(self) -> None:
        """After a supervisor restart: counts that were in flight when the previous one died."""
        with self._lock:
            todo = [i for i, f in enumerate(self._failures)
                    if f.recovery == "partial" and f.failed_at_step is not None and f.lost_samples is None]
        self.count_later(todo)

    def count_later(self, indices: list[int]) -> None:
        if indices:
            self._keep_chains(indices)
            self._start_thread("lost-samples", self._count_in_thread, indices)

    def _count_in_thread(self, indices: list[int]) -> None:
        self._hooks.at_point("thread.lost-samples")
        self._count(indices)

    def _count(self, indices: list[int], errors: tuple[type[BaseException], ...] = _COUNT_ERRORS) -> None:
        for i in indices:
            with self._lock:
                f = self._failures[i]
            error = None
            try:
                lost = self._count_lost(f)
            except errors as err:
                logger.exception("counting lost samples of %s failed", f.actor)
                lost, error = 0.0, repr(err)
            with self._lock:
                now = self._failures[i]
                if now.failed_at_step != f.failed_at_step:
                    continue  # a rollback moved the redo step meanwhile and counts it again
                self._failures[i] = dataclasses.replace(now, lost_samples=lost, lost_samples_error=error)
            self._release(_owner(i))
            self._events.record("lost_samples_counted", actor=f.actor, lost_samples=lost,
                                first_step=f.first_step, failed_at_step=f.failed_at_step)

    # ------------------------------------------------------------------ journal

    def doc(self) -> dict:
        return {"failures": encode(self._failures), "kills": encode(self._kills),
                "first_failure": self._first_failure, "first_kill": self._first_kill}

    def load(self, doc: dict) -> None:
        """The journaled books; the chains of counts still to come are kept from retention again."""
        self._failures = [decode(FailureRecord, f) for f in doc["failures"]]
        self._keep_chains([i for i, f in enumerate(self._failures) if f.recovery == "partial" and f.lost_samples is None])
        self._kills = [decode(KillRecord, k) for k in doc["kills"]]
        self._first_failure, self._first_kill = doc.get("first_failure", 0), doc.get("first_kill", 0)


def _owner(index: int) -> str:
    return f"lost samples of failure {index}"
