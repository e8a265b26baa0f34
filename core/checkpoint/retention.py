"""What checkpoint retention may delete: all but the newest ``keep_last`` full checkpoints
and what builds on them, never the newest valid state. Pure over the manifests; the store
deletes.
"""

from __future__ import annotations

from collections.abc import Callable

from core.checkpoint.files import FULL, CheckpointInfo
from core.errors import CheckpointCorrupt

__all__ = ["expired_steps", "protected_steps"]


def expired_steps(infos: dict[int, CheckpointInfo | None], keep_last: int) -> list[int]:
    """Committed steps older than the oldest of the newest ``keep_last`` fulls, and
    incrementals built on an older full, ascending. ``infos`` maps every committed step to
    its manifest (None if unreadable); a corrupt full still counts as kept."""
    fulls = [s for s in sorted(infos) if (i := infos[s]) is not None and i.kind == FULL]
    if len(fulls) <= keep_last:
        return []
    oldest_kept = fulls[-keep_last]

    def expired(step: int) -> bool:
        info = infos[step]
        if step < oldest_kept:
            return True
        return info is not None and info.base_step is not None and info.base_step < oldest_kept

    return [s for s in sorted(infos) if expired(s)]


def protected_steps(
    infos: dict[int, CheckpointInfo | None], chain: list[int], verify: Callable[[int], CheckpointInfo]
) -> set[int]:
    """The newest valid state's ``chain``, plus the newest valid checkpoint and what it builds on.

    ``verify`` raises CheckpointCorrupt for a step that is not valid.
    """
    protected = set(chain)
    for step in sorted(infos, reverse=True):
        try:
            newest = verify(step)
        except CheckpointCorrupt:
            continue
        protected.add(step)
        if newest.base_step is not None:
            # Unreadable manifests in between might be part of its chain: keep them too.
            protected.update(
                other
                for other, info in infos.items()
                if newest.base_step <= other < step and (info is None or info.base_step == newest.base_step)
            )
            protected.add(newest.base_step)
        break
    return protected
