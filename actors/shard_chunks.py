"""The steps an embedding shard has looked up but not applied yet, as chunks (a trainer's
microbatches each), the arrays fbgemm's table-batched kernel takes (CSR offsets, a batch
merged from chunks), and the initial rows."""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from dataclasses import dataclass

import numpy as np

logger = logging.getLogger(__name__)

__all__ = ["Chunk", "PendingSteps", "at_idle_priority", "init_weights", "load_kernel", "merge_chunks", "offsets", "table_bytes",
           "tables_wanted", "this_thread_idle", "writable"]


@dataclass
class Chunk:
    """A trainer's microbatches of one step as the shard saw them at lookup time."""

    microbatches: tuple[int, ...]
    lengths: np.ndarray  # int64 [S, B]
    indices: np.ndarray  # int64 [nnz]
    grad: np.ndarray | None = None  # float32 [B, S*D]
    graph: object = None  # the lookup's output with its autograd record, when the chunk is the whole step in order


class PendingSteps:
    """The chunks of every step looked up and not applied yet; a step is complete when the
    gradients of its chunks cover ``microbatches_per_step`` microbatches."""

    def __init__(self, microbatches_per_step: int):
        self.microbatches_per_step = microbatches_per_step
        self._steps: dict[int, dict[tuple[int, ...], Chunk]] = {}
        self._tries: dict[int, tuple[int, int]] = {}  # step -> (generation, attempt) of its chunks

    def newer_try(self, step: int, try_: tuple[int, int] | None) -> bool | None:
        """Whether ``try_`` of ``step`` is newer than the try its chunks here belong to (True),
        the same or unknown (None), or older (False: a late request of an abandoned try)."""
        held = self._tries.get(step)
        if try_ is None or held is None or held == try_:
            return None
        return try_ > held

    def try_of(self, step: int) -> tuple[int, int] | None:
        return self._tries.get(step)

    def add(self, step: int, microbatches: tuple[int, ...], lengths: np.ndarray, indices: np.ndarray,
            graph: object = None, try_: tuple[int, int] | None = None) -> None:
        """A chunk of ``step``; a newer ``try_`` than the step's chunks here replaces them all
        (their gradients belong to an abandoned try)."""
        if self.newer_try(step, try_):
            self._steps.pop(step, None)
        if try_ is not None:
            self._tries[step] = try_
        chunks = self._steps.setdefault(step, {})
        # A redo may split the step differently (fewer trainers): the new chunk replaces
        # every older one it overlaps, so no microbatch is ever counted twice.
        for key in [k for k in chunks if set(k) & set(microbatches)]:
            del chunks[key]
        if not _in_order(microbatches):
            graph = None  # its rows are not in the order merge_chunks gives the gradient
        chunks[tuple(microbatches)] = Chunk(tuple(microbatches), lengths, indices, graph=graph)

    def steps(self) -> list[int]:
        """The steps with chunks here, oldest first."""
        return sorted(self._steps)

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
        """The chunks of ``step`` by their first microbatch id; ``merge_chunks`` makes of them
        the same batch however the step was split."""
        chunks = self._steps[step]
        return [chunks[k] for k in sorted(chunks)]

    def drop_through(self, step: int) -> int:
        """Forgets ``step`` (applied) and every older step; returns how many older ones were
        still pending (never completed here: their update to this shard is lost)."""
        old = [s for s in self._steps if s <= step]
        for s in [s for s in self._tries if s <= step]:
            del self._tries[s]
        for s in old:
            del self._steps[s]
        return sum(s < step for s in old)

    def clear(self) -> None:
        self._steps.clear()
        self._tries.clear()


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
    """The step's batch (lengths, ids, gradient) from its chunks, in fbgemm's slice-major id
    layout, with its rows in microbatch-id order however the trainers split the step: the
    kernel sums a row's gradients in batch order, so only the same order gives the same bits
    (two trainers send microbatches (0, 2) and (1, 3)). A chunk's rows are its microbatches',
    in its order, equally many each: a training store holds only whole microbatches of
    ``training.microbatch_rows``. A chunk whose rows do not divide evenly stays whole."""
    if len(chunks) == 1 and _in_order(chunks[0].microbatches):
        c = chunks[0]
        return c.lengths, c.indices, c.grad
    # (microbatch id, its chunk k, its columns a:b in that chunk), in microbatch-id order
    blocks = []
    for k, c in enumerate(chunks):
        width, n = c.lengths.shape[1], len(c.microbatches)
        if n and width % n == 0:
            w = width // n
            blocks += [(m, k, j * w, (j + 1) * w) for j, m in enumerate(c.microbatches)]
        else:
            blocks.append((min(c.microbatches, default=-1), k, 0, width))
    blocks.sort()
    lengths = np.concatenate([chunks[k].lengths[:, a:b] for _, k, a, b in blocks], axis=1)
    grad = np.concatenate([chunks[k].grad[a:b] for _, k, a, b in blocks], axis=0)
    bounds = [offsets(c.lengths) for c in chunks]  # a slice's bags are contiguous in a chunk's ids
    pieces = []
    for s in range(lengths.shape[0]):
        for _, k, a, b in blocks:
            o, row = bounds[k], s * chunks[k].lengths.shape[1]
            pieces.append(chunks[k].indices[o[row + a] : o[row + b]])
    indices = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)
    return lengths, indices, grad


def _in_order(microbatches) -> bool:
    return all(a < b for a, b in zip(microbatches, microbatches[1:]))


def init_weights(torch, tbe, slices, seed: int) -> None:
    """DLRM's init, uniform(+-sqrt(1/rows)), seeded per (table, row_start) so that a slice
    gets the same rows whichever shard holds it."""
    with torch.no_grad():
        for s, w in zip(slices, tbe.split_embedding_weights()):
            table_rows = max(s.row_end, 1)
            gen = torch.Generator().manual_seed(seed * 1_000_003 + s.table * 7919 + s.row_start)
            bound = float(np.sqrt(1.0 / table_rows))
            init = torch.empty(w.shape).uniform_(-bound, bound, generator=gen)
            w.copy_(init.to(w.device))


def load_kernel(threads: int):
    """torch and fbgemm's table-batched embedding kernel, for the GPU when there is one:
    (torch, the kernel class, its optimizer, device, embedding location, compute device).
    The supervisor imports the shard's module to create shard actors and must not load
    these: they load here, in the shard's own process."""
    import torch  # import cost: 1.4 s (measured, 2-core, cold)
    from fbgemm_gpu.split_embedding_configs import EmbOptimType  # import cost: fbgemm_gpu 1.9 s (2-core, cold)
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation  # import cost: as above
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (  # import cost: as above
        ComputeDevice,
        SplitTableBatchedEmbeddingBagsCodegen,
    )

    torch.set_num_threads(threads)
    on_gpu = torch.cuda.is_available()
    return (
        torch, SplitTableBatchedEmbeddingBagsCodegen, EmbOptimType.EXACT_ROWWISE_ADAGRAD,
        torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu"),
        EmbeddingLocation.DEVICE if on_gpu else EmbeddingLocation.HOST,
        ComputeDevice.CUDA if on_gpu else ComputeDevice.CPU,
    )


def at_idle_priority(fn, *args):
    """``fn(*args)`` on a thread under Linux's SCHED_IDLE (it runs only on CPU time no other
    thread wants), waited for here; its result, or its exception raised here. The calling
    thread keeps its policy: a process cannot always go back from SCHED_IDLE (an unprivileged
    one at nice 15, as Ray's workers run, may not). Elsewhere ``fn`` runs at normal priority."""
    out: dict = {}

    def run() -> None:
        try:
            this_thread_idle()
            out["value"] = fn(*args)
        except BaseException as err:  # noqa: BLE001 - re-raised in the caller's thread
            out["error"] = err

    thread = threading.Thread(target=run, name="cpr-idle", daemon=True)
    thread.start()
    thread.join()
    if "error" in out:
        raise out["error"]
    return out["value"]


def table_bytes(rows, dim: int) -> int:
    """Bytes of tables of ``rows`` rows per slice: float32 weights and a row-wise Adagrad state."""
    n = int(sum(rows))
    return n * dim * 4 + n * 4


def tables_wanted(mode: str, rows, dim: int, device=None) -> bool:
    """Whether a warm spare allocates its tables ahead (``embeddings.spare_tables``): always
    ("ready"), never ("lazy"), or ("auto") when the memory they would take (the GPU's for a
    CUDA ``device``, else the node's) has at least twice their size available. Spares decide
    each for itself: several on one node each count what is free when they start."""
    if mode != "auto":
        return mode == "ready"
    try:
        if device is not None and getattr(device, "type", "cpu") == "cuda":
            import torch  # import cost: none, the shard imported it already

            available = torch.cuda.mem_get_info(device)[0]
        else:
            with open("/proc/meminfo") as f:
                available = next(int(line.split()[1]) << 10 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, RuntimeError):
        return False
    return available >= 2 * table_bytes(rows, dim)


def this_thread_idle() -> None:
    """Puts the calling thread (only it: Linux schedules threads) under SCHED_IDLE, for good;
    best effort."""
    if hasattr(os, "sched_setscheduler") and hasattr(os, "SCHED_IDLE"):
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        except OSError as err:
            logger.warning("could not run at idle priority: %r", err)


def rows_digest(tbe, slices, lengths: np.ndarray, indices: np.ndarray) -> str:
    """What an audited apply records of the rows it updated, for ``cpr verify --replay`` to
    compare step by step: blake2b (8 bytes, hex) over, slice by slice in table order, the
    updated rows in row order, each as its D float32 weights then its float32 momentum."""
    import torch  # import cost: none here, the shard loaded it (load_kernel); the supervisor imports this module

    counts = np.asarray(lengths).reshape(len(slices), -1).sum(axis=1)
    starts = np.concatenate([[0], np.cumsum(counts)])
    weights, states = tbe.split_embedding_weights(), tbe.split_optimizer_states()
    h = hashlib.blake2b(digest_size=8)
    for i in sorted(range(len(slices)), key=lambda i: slices[i].table):
        ids = torch.from_numpy(np.unique(indices[starts[i]: starts[i + 1]]).astype(np.int64))
        w = weights[i][ids].detach().cpu().numpy()
        m = states[i][0][ids].detach().cpu().numpy()
        h.update(np.ascontiguousarray(np.concatenate([w, m[:, None]], axis=1), dtype="<f4").tobytes())
    return h.hexdigest()
