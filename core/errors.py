"""The exception tree of cpr.

Every error a user can cause or a failure can raise is one of these, with the numbers
that explain it in the message. They pickle (``__reduce__``) so they cross Ray actors intact.
"""

from __future__ import annotations

__all__ = [
    "CprError",
    "ConfigError",
    "DataFormatError",
    "InsufficientData",
    "CheckpointCorrupt",
    "CheckpointNotFound",
    "NoValidChain",
    "ShardUnavailable",
    "TrainerConflict",
    "RunFailed",
    "StaleLease",
]


class CprError(Exception):
    """Base class of every error raised by cpr."""

    def __reduce__(self):
        return (type(self), self.args)


class ConfigError(CprError, ValueError):
    """A config value is out of its allowed range; the message names field and range."""


class DataFormatError(CprError, ValueError):
    """A malformed input record.

    Args:
        path: the file that holds it.
        line: 1-based line number (TSV) or row number (Parquet) of the record.
        reason: what is wrong, e.g. ``"expected 40 columns, got 39"``.
    """

    def __init__(self, path: str, line: int, reason: str):
        super().__init__(path, line, reason)
        self.path = path
        self.line = line
        self.reason = reason

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.reason}"


class InsufficientData(CprError, ValueError):
    """Data files that hold too few usable rows to train or evaluate on (empty, or every line
    skipped as malformed); the message names each such file with its lines read and skipped."""


class CheckpointCorrupt(CprError):
    """A checkpoint file is missing or its size/checksum does not match its manifest."""


class CheckpointNotFound(CprError):
    """No valid checkpoint exists under the storage URI."""


class NoValidChain(CprError):
    """A shard found no restorable chain of its own files although the store holds committed
    checkpoints (each of its files corrupt, unlisted or removed): it kept away from its initial
    rows, and the supervisor decides what now (a rollback of everything further back).

    Args:
        shard_id: the shard that loaded.
        upto_step: the newest step it could use (None: any).
        tried: ``(step, reason)`` of every checkpoint passed over, newest first.
    """

    def __init__(self, shard_id: int, upto_step: int | None, tried: tuple[tuple[int, str], ...]):
        super().__init__(shard_id, upto_step, tuple(tried))
        self.shard_id = shard_id
        self.upto_step = upto_step
        self.tried = tuple(tried)

    def __str__(self) -> str:
        bound = "" if self.upto_step is None else f" at or before step {self.upto_step}"
        tried = "; ".join(f"step {s}: {r}" for s, r in self.tried) or "no checkpoint was readable"
        return f"shard {self.shard_id} has no valid checkpoint chain{bound} ({tried})"


class ShardUnavailable(CprError):
    """An embedding shard did not answer within its timeout, or died."""


class TrainerConflict(CprError):
    """A replacement trainer's view of the run contradicts live trainers (split quorum)."""


class StaleLease(RuntimeError):
    """A shard could not confirm its place (``actors.lease``) in time to apply a committed step:
    it applied nothing and the caller's step is redone (a process replaced meanwhile is fenced)."""


class StaleRequest(RuntimeError):
    """A shard refused a request outside the step protocol's current try (``core.step_protocol``):
    one of an abandoned try, or one whose step follows a step the shard holds complete and the
    request names no commit of. Nothing changed there; the caller's step is redone."""


class RunFailed(CprError):
    """The run stopped before its end (a failure budget, an unrecoverable error); its report
    is written and ``cpr train --resume RUN_DIR`` continues it."""
