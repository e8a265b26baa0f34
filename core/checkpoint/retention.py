"""What checkpoint retention may delete: all but the newest ``keep_last`` full checkpoints
and what builds on them, never the newest valid state nor a step someone still restores
from (and what it builds on). Pure over the manifests; the store deletes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from core.checkpoint.files import FULL, CheckpointInfo
from core.errors import CheckpointCorrupt

__all__ = ["expired_steps", "protected_steps", "with_bases"]


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


def with_bases(infos: dict[int, CheckpointInfo | None], steps: Iterable[int]) -> set[int]:
    """``steps`` and everything each one's restore builds on: an incremental's base full and
    the incrementals on that base before it (a chain restores them all, in order), and any
    unreadable manifest in between, which might be one of them."""
    kept = set(steps)
    for step in list(kept):
        info = infos.get(step)
        if info is None or info.base_step is None:
            continue
        base = info.base_step
        kept.add(base)
        kept.update(
            other for other, o in infos.items() if base < other < step and (o is None or o.base_step == base)
        )
    return kept


def protected_steps(
    infos: dict[int, CheckpointInfo | None], chain: list[int], verify: Callable[[int], CheckpointInfo]
) -> set[int]:
    """The newest valid state's ``chain``, plus the newest valid checkpoint and what it builds on.

    ``verify`` raises CheckpointCorrupt for a step that is not valid.
    """
    for step in sorted(infos, reverse=True):
        try:
            verify(step)
        except CheckpointCorrupt:
            continue
        return with_bases(infos, [*chain, step])
    return set(chain)
