"""The run's event log in the supervisor: every checkpoint, failure, recovery and decision as
a JSON record with its time and the numbers behind it. It is journaled with the supervisor's
books, appended to ``events.jsonl`` and fed to the metrics through the run's hooks."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from actors.supervisor.hooks import RunHooks

__all__ = ["EventLog"]

logger = logging.getLogger(__name__)


class EventLog:
    """``record`` appends an event and persists the books; ``append`` only appends, for a
    caller that persists once for several changes (a transition)."""

    def __init__(self, lock: threading.RLock, hooks: RunHooks, persist: Callable[[], None],
                 clock: Callable[[], float] = time.time):
        self._lock = lock
        self._hooks = hooks
        self._persist = persist
        self._clock = clock
        self._events: list[dict] = []

    def append(self, kind: str, event_time: float | None = None, **fields: object) -> dict:
        event = {"time": round(self._clock() if event_time is None else event_time, 3), "kind": kind, **fields}
        with self._lock:
            self._events.append(event)
        self._hooks.on_event(event)
        logger.info("event %s", event)
        return event

    def record(self, kind: str, event_time: float | None = None, **fields: object) -> dict:
        with self._lock:
            event = self.append(kind, event_time, **fields)
            self._persist()
        return event

    def since(self, index: int) -> list[dict]:
        with self._lock:
            return self._events[index:]

    def of(self, kind: str, since_time: float | None = None) -> list[dict]:
        with self._lock:
            return [e for e in self._events if e["kind"] == kind and (since_time is None or e["time"] >= since_time)]

    def last(self, kind: str) -> dict | None:
        with self._lock:
            return next((e for e in reversed(self._events) if e["kind"] == kind), None)

    def count(self) -> int:
        with self._lock:
            return len(self._events)

    def all(self) -> tuple[dict, ...]:
        with self._lock:
            return tuple(self._events)

    def doc(self) -> list[dict]:
        return list(self._events)

    def load(self, events: list[dict]) -> None:
        self._events = list(events)
