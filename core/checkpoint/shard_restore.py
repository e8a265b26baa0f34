"""Which chain of its own files one shard restores: for a partial recovery the newest valid
one at load time, for a rollback the one chosen or older; what it passed over and why; and
the initial rows only where no checkpoint exists (or a rollback goes to step 0), saying so.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from core.checkpoint.reader import CheckpointReader
from core.checkpoint.rows import ShardRows
from core.errors import NoValidChain

__all__ = ["NO_CHECKPOINT_YET", "RECOVERY", "ROLLBACK_TO_START", "ShardRestore", "restore_shard"]

logger = logging.getLogger(__name__)

RECOVERY = "recovery"
NO_CHECKPOINT_YET = "no checkpoint exists yet: the initial rows"
ROLLBACK_TO_START = "a rollback to step 0: the initial rows"
_GONE = "removed after it was chosen, before the load (retention or a fence)"


@dataclass(frozen=True)
class ShardRestore:
    """The chain a shard restores and its rows, or the initial rows and why."""

    steps: list[int]  # [] for the initial rows
    parts: list[ShardRows]  # the shard's rows of each step of ``steps``
    fallbacks: list[tuple[int, str, bool]]  # (step, reason, removed: gone rather than corrupt)
    initial_rows_reason: str | None  # set exactly when ``steps`` is []


def restore_shard(
    reader: CheckpointReader, shard_id: int, given: Sequence[int], why: str, slices: Sequence | None = None
) -> ShardRestore:
    """The chain of ``shard_id``'s own files to restore (``CheckpointReader.shard_chain``);
    with ``slices`` (its rows under the plan now), a checkpoint of another plan gives them
    from the files that hold them.

    A partial recovery (``why`` "recovery") takes the newest valid chain at load time, even a
    newer one than ``given``: a save that committed after the death was snapshotted before it,
    on the same timeline, so it loses less. Anything else (a rollback) stays at or before
    ``given[-1]`` (step 0, the initial rows, for an empty ``given``); its caller checks that
    the chain is ``given``. Steps of ``given`` no longer committed are fallbacks too.

    Raises:
        NoValidChain: checkpoints are (or were: ``given``) committed but no chain of this
            shard's files is valid: the initial rows would lose every step since the start.
    """
    committed = reader.list_committed()
    gone = [(s, f"{_GONE}; the chain given was {list(given)}", True) for s in given if s not in committed]
    for step, reason, _ in gone:
        logger.warning("shard %d: checkpoint step %d was %s", shard_id, step, reason)
    if why != RECOVERY and not given:
        return ShardRestore([], [], gone, ROLLBACK_TO_START)
    upto = None if why == RECOVERY else given[-1]
    steps, parts = reader.shard_chain(shard_id, upto, slices)
    fallbacks = gone + [(s, r, s in reader.removed_steps) for s, r in reader.fallbacks]
    if steps:
        return ShardRestore(steps, parts, fallbacks, None)
    if not committed and not given:
        return ShardRestore([], [], fallbacks, NO_CHECKPOINT_YET)
    raise NoValidChain(shard_id, upto, tuple((s, r) for s, r, _ in fallbacks))
