"""The steps an embedding shard has looked up but not applied yet, as chunks (a trainer's
microbatches each), and the arrays fbgemm's table-batched kernel takes: CSR offsets, a batch
merged from chunks."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["Chunk", "PendingSteps", "merge_chunks", "offsets", "writable"]


@dataclass
class Chunk:
    """A trainer's microbatches of one step as the shard saw them at lookup time."""

    microbatches: tuple[int, ...]
    lengths: np.ndarray  # int64 [S, B]
    indices: np.ndarray  # int64 [nnz]
    grad: np.ndarray | None = None  # float32 [B, S*D]


class PendingSteps:
    """The chunks of every step looked up and not applied yet; a step is complete when the
    gradients of its chunks cover ``microbatches_per_step`` microbatches."""

    def __init__(self, microbatches_per_step: int):
        self.microbatches_per_step = microbatches_per_step
        self._steps: dict[int, dict[tuple[int, ...], Chunk]] = {}

    def add(self, step: int, microbatches: tuple[int, ...], lengths: np.ndarray, indices: np.ndarray) -> None:
        chunks = self._steps.setdefault(step, {})
        # A redo may split the step differently (fewer trainers): the new chunk replaces
        # every older one it overlaps, so no microbatch is ever counted twice.
        for key in [k for k in chunks if set(k) & set(microbatches)]:
            del chunks[key]
        chunks[tuple(microbatches)] = Chunk(tuple(microbatches), lengths, indices)

    def chunk(self, step: int, microbatches: tuple[int, ...]) -> Chunk | None:
        """The pending chunk of exactly these microbatches of ``step``, if any."""
        return self._steps.get(step, {}).get(tuple(microbatches))

    def completes(self, step: int, chunk: Chunk) -> bool:
        """Whether ``chunk``'s gradient, with those of the step's other chunks already here,
        makes the whole step."""
        others = self._steps[step].values()
        have = len(chunk.microbatches) + sum(len(c.microbatches) for c in others if c.grad is not None and c is not chunk)
        return have >= self.microbatches_per_step

    def ordered(self, step: int) -> list[Chunk]:
        """The chunks of ``step`` by microbatch id: the same batch however it was split."""
        chunks = self._steps[step]
        return [chunks[k] for k in sorted(chunks)]

    def drop_through(self, step: int) -> int:
        """Forgets ``step`` (applied) and every older step; returns how many older ones were
        still pending (never completed here: their update to this shard is lost)."""
        old = [s for s in self._steps if s <= step]
        for s in old:
            del self._steps[s]
        return sum(s < step for s in old)

    def clear(self) -> None:
        self._steps.clear()


def writable(a: np.ndarray) -> np.ndarray:
    """``a``, or a copy of it where it is read-only. Ray hands arrays to an actor as
    read-only views of the message that carried them; torch tensors are always writable,
    so one made over such a view could write into Ray's buffer. An id array of a step is
    a few hundred KB: the copy costs tens of microseconds."""
    return a if a.flags.writeable else a.copy()


def offsets(lengths: np.ndarray) -> np.ndarray:
    """int64 [S*B+1]: where each bag of ``lengths`` [S, B] starts in the slice-major ids."""
    out = np.zeros(lengths.size + 1, dtype=np.int64)
    np.cumsum(lengths.ravel(), out=out[1:])
    return out


def merge_chunks(chunks: list[Chunk]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Concatenates chunks along the batch, keeping fbgemm's slice-major id layout."""
    if len(chunks) == 1:
        c = chunks[0]
        return c.lengths, c.indices, c.grad
    lengths = np.concatenate([c.lengths for c in chunks], axis=1)
    per_slice_bounds = [np.concatenate([[0], np.cumsum(c.lengths.sum(axis=1))]) for c in chunks]
    pieces = []
    for s in range(lengths.shape[0]):
        for c, b in zip(chunks, per_slice_bounds):
            pieces.append(c.indices[b[s] : b[s + 1]])
    indices = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)
    grad = np.concatenate([c.grad for c in chunks], axis=0)
    return lengths, indices, grad
