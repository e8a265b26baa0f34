"""The supervisor's books as one journal document: a section per part, taken whole under the
books' lock so that every section is from the same moment (a transition changes several
parts at once: the state, the fleet, a spare taken from the pool, failures recorded). The
journal (``core.journal``) writes only what changed since its last write, and no section
holds per-step history: a write costs the change, not the run's length."""

from __future__ import annotations

import threading
from typing import Protocol

from core.journal import JOURNAL_FORMAT, Journal

__all__ = ["Books", "Part", "JOURNAL_FORMAT"]


class Part(Protocol):
    def doc(self) -> object: ...


class Books:
    def __init__(self, journal: Journal, lock: threading.RLock, header: dict):
        self.journal = journal
        self.lock = lock
        self.header = dict(header)  # run id, attempt, supervisor restarts...
        self._parts: dict[str, Part] = {}
        self._frozen = False

    def add(self, name: str, part: Part) -> None:
        self._parts[name] = part

    def freeze(self) -> None:
        """Stops writing: the journal on disk is kept as it is (a rebuild from it failed, and
        books half loaded from it must not replace it)."""
        self._frozen = True

    def persist(self) -> None:
        with self.lock:
            if self._frozen:
                return
            self.journal.write({"format": JOURNAL_FORMAT, **self.header,
                                **{name: part.doc() for name, part in self._parts.items()}})
