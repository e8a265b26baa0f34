"""The checkpoints a restore in flight may still load, kept from retention until it is done:
the chain a recovery or rollback chose (from its decision until its outcome is committed)
and a partial recovery's chain until its lost samples are counted. Whoever chose a restore
protects it under a name of its own and releases it; in memory (a restarted supervisor
protects its journaled restores again)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterable

__all__ = ["RestoreTargets"]


class RestoreTargets:
    """``store()``: the CheckpointStore (None: saves are off), whose gc asks ``protected()``."""

    def __init__(self, store: Callable[[], object]):
        self._store = store
        self._protected: dict[str, frozenset[int]] = {}  # owner -> steps a restore of its may load
        self._lock = threading.Lock()

    def protect(self, owner: str, steps: Iterable[int]) -> None:
        """Retention keeps ``steps`` (and what each builds on) until ``release(owner)``: a
        restore chosen by ``owner`` (a recovery, a rollback) is loaded after its chain was
        chosen, and a save committing meanwhile runs gc. ``owner`` protects exactly ``steps``
        from now on (a second call replaces the first). Once this returns no gc deletes them;
        one that finished before may have already: a shard's load then falls back, saying so."""
        steps = frozenset(int(s) for s in steps)
        store = self._store()
        with store.keep_changing() if store is not None else contextlib.nullcontext():
            with self._lock:
                self._protected[owner] = steps

    def release(self, owner: str) -> None:
        """``owner``'s restore is done: its steps are retention's again (idempotent)."""
        with self._lock:
            self._protected.pop(owner, None)

    def protected(self) -> set[int]:
        """Every step some owner protects (without what they build on, which gc adds)."""
        with self._lock:
            return set().union(*self._protected.values())
