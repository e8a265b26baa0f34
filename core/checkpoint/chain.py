"""The rule that picks the newest restorable state: a valid full checkpoint, then the valid
incrementals built on it in step order, stopping before the first that is not. Pure over
the manifests and a verification callback, so each reader chooses what to verify.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from core.checkpoint.files import FULL, INCREMENTAL, CheckpointInfo
from core.errors import CheckpointCorrupt, CheckpointNotFound

__all__ = ["REMOVED", "FoundChain", "find_chain"]

# Not corrupt: its manifest went between the listing and the read.
REMOVED = "removed while it was being loaded (retention or a fence)"


@dataclass(frozen=True)
class FoundChain:
    """The chain ``find_chain`` found, and the checkpoints that shaped it."""

    steps: list[int]  # a full, then its incrementals; [] when no full verifies
    skipped_fulls: list[tuple[int, str]]  # (step, reason), newest first, passed over for an older full
    stopped_before: tuple[int, str] | None  # the corrupt or removed incremental the chain ends before
    removed: tuple[int, ...] = ()  # steps among those whose manifest was gone when read


def find_chain(
    committed: Sequence[int],
    info: Callable[[int], CheckpointInfo],
    verify: Callable[[CheckpointInfo], object],
) -> FoundChain:
    """The newest full of ``committed`` (ascending) that verifies, then its incrementals.

    ``verify`` raises CheckpointCorrupt for a checkpoint not to use. A step whose manifest
    has gone since the listing (CheckpointNotFound: fenced by a rollback, or retention) is
    passed over as a full and ends the chain as an incremental, since everything after it
    went with it; either way it is named (``REMOVED``), never passed over in silence.
    """
    skipped: list[tuple[int, str]] = []
    removed: list[int] = []
    full: CheckpointInfo | None = None
    for step in reversed(committed):
        try:
            candidate = info(step)
            if candidate.kind != FULL:
                continue
            verify(candidate)
        except CheckpointCorrupt as exc:
            skipped.append((step, str(exc)))
            continue
        except CheckpointNotFound:
            skipped.append((step, REMOVED))
            removed.append(step)
            continue
        full = candidate
        break
    if full is None:
        return FoundChain([], skipped, None, tuple(removed))

    steps = [full.step]
    for step in committed:
        if step <= full.step:
            continue
        if step in removed:
            # Seen gone as a candidate full: it may have been one of these incrementals.
            skipped.remove((step, REMOVED))
            return FoundChain(steps, skipped, (step, f"{REMOVED} (restore chain stops before it)"), tuple(removed))
        try:
            incremental = info(step)
            if incremental.kind != INCREMENTAL or incremental.base_step != full.step:
                continue
            verify(incremental)
        except CheckpointNotFound:
            removed.append(step)
            return FoundChain(steps, skipped, (step, f"{REMOVED} (restore chain stops before it)"), tuple(removed))
        except CheckpointCorrupt as exc:
            # Later incrementals hold only the rows changed since this one: without it they
            # would restore a state that never was.
            return FoundChain(steps, skipped, (step, f"{exc} (restore chain stops before it)"), tuple(removed))
        steps.append(step)
    return FoundChain(steps, skipped, None, tuple(removed))
