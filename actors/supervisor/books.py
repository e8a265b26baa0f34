"""The supervisor's books as one journal document: a section per part, taken whole under the
books' lock so that every section is from the same moment (a transition changes several
parts at once: the state, the fleet, a spare taken from the pool, failures recorded). The
journal (``core.journal``) writes only what changed since its last write, and no section
holds per-step history: a write costs the change, not the run's length. A journal that
cannot be written (a full disk) fails the run here."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Protocol

from core.journal import JOURNAL_FORMAT, Journal

__all__ = ["Books", "Part", "JournalUnwritable", "JOURNAL_FORMAT"]

logger = logging.getLogger(__name__)


class JournalUnwritable(Exception):
    """The supervisor's journal could not be written: the change that called ``persist`` is not
    durable and goes no further, and the run has failed with this reason. Not an OSError nor a
    CprError on purpose: the handlers that retry storage errors (a save, a recovery attempt)
    must not take it for one of theirs and persist again from their handler."""


class Part(Protocol):
    def doc(self) -> object: ...


class Books:
    def __init__(self, journal: Journal, lock: threading.RLock, header: dict,
                 on_unwritable: Callable[[str], None] | None = None):
        self.journal = journal
        self._on_unwritable = on_unwritable  # fails the run (the controller's fail)
        self._unwritable = False
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
        """Writes every part's section. If the journal cannot be written the run fails with that
        reason (once: failing persists again, and that write fails too, so the controller fails
        in memory), then ``JournalUnwritable`` stops the caller: a guarded thread ends there."""
        with self.lock:
            if self._frozen:
                return
            try:
                self.journal.write({"format": JOURNAL_FORMAT, **self.header,
                                    **{name: part.doc() for name, part in self._parts.items()}})
            except OSError as err:
                raise self.unwritable("journal", getattr(self.journal, "path", "the run directory"), err) from err

    def unwritable(self, what: str, path: object, err: OSError) -> JournalUnwritable:
        """One of the supervisor's files (``what``: its journal, its trainer book) could not be
        written: the run fails with that reason (once), and the caller raises what this returns."""
        unwritable = JournalUnwritable(f"the supervisor's {what} could not be written ({path}): {err}")
        first, self._unwritable = not self._unwritable, True
        if first and self._on_unwritable is not None:
            logger.error("%s; the run fails", unwritable)
            self._on_unwritable(str(unwritable))
        return unwritable
