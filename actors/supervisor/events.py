"""The run's event log in the supervisor: every checkpoint, failure, recovery and decision as
a JSON record with its time and the numbers behind it, appended to ``events.jsonl`` and fed
to the metrics through the run's hooks. In memory it keeps the last events (the console
follows them) and every event of the few kinds the supervisor reads back; the journal keeps
those and how far the file reached, so a journal write does not grow with the run."""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable

from actors.supervisor.hooks import RunHooks
from core.journal import AppendLog

__all__ = ["EventLog", "KEPT_KINDS", "TAIL_EVENTS"]

logger = logging.getLogger(__name__)

# The kinds the supervisor's decisions read back, each one a failure (a host, a spare, every
# trainer), so they are bounded by the run's budgets: kept whole, in memory and in the journal.
KEPT_KINDS = ("host_lost", "spare_lost", "all_trainers_failed")
TAIL_EVENTS = 256  # the last events in memory: what the console has not shown yet


class EventLog:
    """``record`` appends an event and persists the books; ``append`` only appends, for a
    caller that persists once for several changes (a transition).

    An event is in ``events.jsonl`` as soon as it is appended, before its journal write; the
    journal records the file's length at each write, and a restarted supervisor cuts the file
    back to it (``load``): an event whose transition never reached the journal goes with it,
    as the transition did. Without a file (unit tests) only the memory holds events."""

    def __init__(self, lock: threading.RLock, hooks: RunHooks, persist: Callable[[], None],
                 clock: Callable[[], float] = time.time, file: AppendLog | None = None):
        self._lock = lock
        self._hooks = hooks
        self._persist = persist
        self._clock = clock
        self._file = file
        self._tail: deque[dict] = deque(maxlen=TAIL_EVENTS)
        self._kept: dict[str, list[dict]] = {k: [] for k in KEPT_KINDS}
        self._count = 0  # events of the run so far: the index the next one gets

    def append(self, kind: str, event_time: float | None = None, **fields: object) -> dict:
        event = {"time": round(self._clock() if event_time is None else event_time, 3), "kind": kind, **fields}
        with self._lock:  # the file's length and the count move together: the journal records both
            self._tail.append(event)
            self._count += 1
            if kind in self._kept:
                self._kept[kind].append(event)
            if self._file is not None:
                self._write(event)
        self._hooks.on_event(event)
        logger.info("event %s", event)
        return event

    def _write(self, event: dict) -> None:
        """A failed write (a full disk) loses the event from the file, not from the run: it is
        in memory, on the console and in the metrics, and the journal counts the file's bytes."""
        try:
            self._file.append(event)
        except OSError as err:
            logger.error("could not append event %s to %s: %s", event["kind"], self._file.path, err)

    def record(self, kind: str, event_time: float | None = None, **fields: object) -> dict:
        with self._lock:
            event = self.append(kind, event_time, **fields)
            self._persist()
        return event

    def since(self, index: int) -> list[dict]:
        """The events from the run's ``index``-th on: from memory, or from the file for a
        reader that fell more than ``TAIL_EVENTS`` behind."""
        with self._lock:
            first = self._count - len(self._tail)
            if index >= first or self._file is None:
                return list(self._tail)[max(index - first, 0):]
            path, end = self._file.path, self._file.size
        return list(itertools.islice(AppendLog.iter(path, end), index, None))

    def of(self, kind: str, since_time: float | None = None) -> list[dict]:
        """Every event of a kept kind (``KEPT_KINDS``), from ``since_time`` on."""
        with self._lock:
            return [e for e in self._kept_of(kind) if since_time is None or e["time"] >= since_time]

    def last(self, kind: str) -> dict | None:
        with self._lock:
            kept = self._kept_of(kind)
            return kept[-1] if kept else None

    def _kept_of(self, kind: str) -> list[dict]:
        if kind not in self._kept:
            raise ValueError(f"events of kind {kind!r} are not kept in memory (kept: {', '.join(KEPT_KINDS)}); "
                             "read recent() or the events file")
        return self._kept[kind]

    def recent(self, kind: str | None = None) -> list[dict]:
        """The events still in memory (the last ``TAIL_EVENTS``), of ``kind`` if given."""
        with self._lock:
            return [e for e in self._tail if kind is None or e["kind"] == kind]

    def count(self) -> int:
        with self._lock:
            return self._count

    def all(self) -> tuple[dict, ...]:
        """Every event of the run, read from the file (the memory without one)."""
        with self._lock:
            if self._file is None:
                return tuple(self._tail)
            path, end = self._file.path, self._file.size
        return tuple(AppendLog.iter(path, end))

    def doc(self) -> dict:
        return {"count": self._count, "bytes": self._file.size if self._file is not None else None,
                "kept": {k: list(v) for k, v in self._kept.items()}}

    def load(self, doc: dict) -> None:
        """The journaled log: the kept events, the count, and the file cut back to where it
        was at that journal write. The last events come back from the file for the console."""
        self._count = doc["count"]
        self._kept = {k: list(doc["kept"].get(k, [])) for k in KEPT_KINDS}
        self._tail.clear()
        if self._file is None or doc.get("bytes") is None:
            return
        end = doc["bytes"]
        if not self._file.cut(end):
            logger.warning("%s holds %d bytes, the journal says %d: its events are left as they are",
                           self._file.path, self._file.size, end)
            end = self._file.size
        self._tail.extend(AppendLog.tail(self._file.path, end, TAIL_EVENTS))
