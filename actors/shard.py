"""EmbeddingShard: one Ray actor holding its slices of the embedding tables in fbgemm's
table-batched embedding kernel with fused row-wise Adagrad.

It imports torch and fbgemm only (not torchrec): a respawned shard is back 1.5 s sooner,
and respawn time is most of a partial recovery.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from dataclasses import dataclass

import numpy as np

from core.checkpoint import CheckpointStore, ShardRows, warm_up, write_shard_file
from core.plan import TableSlice, shard_row_ids, slice_offsets
from actors.shm import ShmArray, ShmReader

__all__ = ["EmbeddingShard"]

logger = logging.getLogger(__name__)


@dataclass
class _Chunk:
    """A trainer's microbatches of one step as the shard saw them at lookup time."""

    microbatches: tuple[int, ...]
    lengths: np.ndarray  # int64 [S, B]
    indices: np.ndarray  # int64 [nnz]
    grad: np.ndarray | None = None  # float32 [B, S*D]


class _Write:
    """The background write of one save's snapshot."""

    def __init__(self, step: int):
        self.step = step
        self.done = threading.Event()
        self.entry = None
        self.error: str | None = None
        self.write_s = 0.0

    def run(self, uri: str, step: int, shard_id: int, data) -> None:
        t0 = time.perf_counter()
        try:
            self.entry = write_shard_file(uri, step, shard_id, data)
        except BaseException as err:  # reported to the coordinator by save_written
            self.error = repr(err)[:300]
        finally:
            self.write_s = time.perf_counter() - t0
            self.done.set()


def _writable(a: np.ndarray) -> np.ndarray:
    """``a``, or a copy of it where it is read-only. Ray hands arrays to an actor as
    read-only views of the message that carried them; torch tensors are always writable,
    so one made over such a view could write into Ray's buffer. An id array of a step is
    a few hundred KB: the copy costs tens of microseconds."""
    return a if a.flags.writeable else a.copy()


def _offsets(lengths: np.ndarray) -> np.ndarray:
    offsets = np.zeros(lengths.size + 1, dtype=np.int64)
    np.cumsum(lengths.ravel(), out=offsets[1:])
    return offsets


def _merge_chunks(chunks: list[_Chunk]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
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


class EmbeddingShard:
    """Holds ``slices`` (TableSlice) of the embedding tables, dimension ``dim``.

    A step's embedding update is applied once, when the gradients of all
    ``microbatches_per_step`` microbatches of that step have arrived: the update then does
    not depend on which trainer computed which microbatch, and a microbatch resent by a
    redo overwrites its earlier copy instead of being applied twice.
    """

    def __init__(
        self,
        shard_id: int | None,
        slices: list[TableSlice] | None,
        dim: int,
        learning_rate: float,
        eps: float,
        seed: int,
        microbatches_per_step: int,
        threads: int = 1,
        priority: dict | None = None,
        generation: int = 0,
        audit_dir: str | None = None,
        log_dir: str | None = None,
        spare: str | None = None,
    ):
        """``shard_id`` None: a warm spare (``spare`` names it). It imports torch and fbgemm
        and then waits, holding no table memory, until ``adopt`` makes it a shard."""
        import ray

        from core.logs import configure_process_logging

        role = spare.rsplit("-", 1)[-1] if spare else f"shard-{shard_id}"
        configure_process_logging(log_dir, role, ray.util.get_node_ip_address())
        import torch
        from fbgemm_gpu.split_embedding_configs import EmbOptimType
        from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
            ComputeDevice,
            SplitTableBatchedEmbeddingBagsCodegen,
        )

        torch.set_num_threads(threads)
        self._torch = torch
        self._tbe_cls, self._optim = SplitTableBatchedEmbeddingBagsCodegen, EmbOptimType.EXACT_ROWWISE_ADAGRAD
        on_gpu = torch.cuda.is_available()
        self.device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
        self._location = EmbeddingLocation.DEVICE if on_gpu else EmbeddingLocation.HOST
        self._compute = ComputeDevice.CUDA if on_gpu else ComputeDevice.CPU
        self.dim = dim
        self.learning_rate, self.eps = learning_rate, eps
        self.seed = seed
        self.microbatches_per_step = microbatches_per_step
        self._priority_args = {"policy": "full", "r": 1.0, "sample_rate": 1.0, "full_every": 1, **(priority or {})}
        self._audit_dir = audit_dir
        self.spare = spare
        self.shard_id: int | None = None
        self.generation = generation
        self._released = threading.Event()
        # Arrays of trainers on this node come through shared memory (actors.shm).
        self._shm = ShmReader()
        # The background write of the last save's snapshot (two-phase asynchronous saves).
        self._write: _Write | None = None
        if shard_id is not None:
            self._become(shard_id, list(slices or []), generation, init=True)
        else:
            # A spare does now what a recovery would otherwise wait for: every import of
            # adoption, load and save (its tables are not allocated until adopt).
            import policies  # noqa: F401

            warm_up()

    def _become(self, shard_id: int, slices: list[TableSlice], generation: int, init: bool) -> None:
        """Allocates the tables of ``slices`` and every per-shard structure. ``init`` False
        (a spare adopted for a recovery) leaves the rows zero: the load that follows writes
        every row from the checkpoint, or ``reset_to_init`` initializes them."""
        self.shard_id = shard_id
        self.slices = list(slices)
        self.generation = generation
        self.tbe = self._tbe_cls(
            embedding_specs=[(s.num_rows, self.dim, self._location, self._compute) for s in self.slices],
            optimizer=self._optim,
            learning_rate=self.learning_rate,
            eps=self.eps,
            device=self.device,
        )
        self._initialized = False
        if init:
            self._init_weights(self.seed)
        from policies import make_policy

        self._slice_offsets = slice_offsets(self.slices)
        p = self._priority_args
        self._new_policy = lambda: make_policy(
            p["policy"], int(self._slice_offsets[-1]), p["r"], p["sample_rate"], self.seed + shard_id, p["full_every"]
        )
        self.priority = self._new_policy()
        self._tracking = p["policy"] != "full"
        # The rows written for a save whose manifest is not known to be committed yet:
        # (step, rows). They count as saved only once it is (two-phase save).
        self._unconfirmed_save: tuple[int, np.ndarray] | None = None
        self._since_save: list[np.ndarray] = []  # shard rows looked up after that save's snapshot
        self._audit = None
        if self._audit_dir is not None:
            # Append-only record of every update applied and every load, for the soak's
            # exactly-once checks; written by this process, independent of the supervisor.
            os.makedirs(self._audit_dir, exist_ok=True)
            path = os.path.join(self._audit_dir, f"shard-{shard_id}-g{generation}.jsonl")
            self._audit = open(path, "a", buffering=1)
        self.tracking_s = 0.0
        self.steps_dropped = 0
        self.first_step_after_load: int | None = None
        self.applied_microbatches: list[tuple[int, tuple[int, ...]]] = []
        self._pending: dict[int, dict[tuple[int, ...], _Chunk]] = {}
        self.applied_step = -1
        self.rows_updated_total = 0
        self.compute_s = 0.0
        # The buffer a full snapshot is copied into, made by _prepare_snapshot_buffer.
        self._snapshot_buf: ShardRows | None = None
        self._buf_thread: threading.Thread | None = None
        if init:
            self._prepare_snapshot_buffer()

    def adopt(self, shard_id: int, slices: list[TableSlice], generation: int) -> dict:
        """A warm spare becomes shard ``shard_id`` of ``generation``: its tables are allocated
        now (a spare holds no table memory). Idempotent for the same shard and generation (a
        restarted supervisor adopts again); a spare already adopted as another refuses."""
        if self.shard_id is not None:
            if (self.shard_id, self.generation) != (shard_id, generation):
                raise RuntimeError(
                    f"{self.spare} is already shard {self.shard_id} generation {self.generation}; "
                    f"cannot become shard {shard_id} generation {generation}"
                )
            return self.ready()
        t0 = time.perf_counter()
        self._become(shard_id, list(slices), generation, init=False)
        logger.warning(
            "%s adopted as shard %d generation %d in %.3fs", self.spare, shard_id, generation, time.perf_counter() - t0
        )
        return {**self.ready(), "adopt_s": time.perf_counter() - t0}

    def _init_weights(self, seed: int) -> None:
        # DLRM's init, uniform(+-sqrt(1/rows)), seeded per (table, row_start) so a slice
        # gets the same rows whichever shard holds it.
        torch = self._torch
        with torch.no_grad():
            for s, w in zip(self.slices, self.tbe.split_embedding_weights()):
                table_rows = max(s.row_end, 1)
                gen = torch.Generator().manual_seed(seed * 1_000_003 + s.table * 7919 + s.row_start)
                bound = float(np.sqrt(1.0 / table_rows))
                init = torch.empty(w.shape).uniform_(-bound, bound, generator=gen)
                w.copy_(init.to(w.device))
        self._initialized = True

    def watch(self) -> None:
        """Never returns while the shard lives. The supervisor keeps one call of it pending
        (in its own concurrency group) so the shard's death fails that call at once: Ray's
        own signal, no polling."""
        self._released.wait()

    def reset_to_init(self, why: str = "recovery") -> None:
        """Back to the initial rows and empty Adagrad state: the state of step 0. ``why``
        (recovery or rollback) goes to the audit log."""
        import torch

        self._init_weights(self.seed)
        with torch.no_grad():
            for st in self.tbe.split_optimizer_states():
                st[0].zero_()
        self._pending.clear()
        self.applied_step = -1
        self.applied_microbatches.clear()
        self.first_step_after_load = None
        self.priority = self._new_policy()
        self.confirm_save(None)
        self._log({"event": "load", "chain": [], "why": why})
        self._prepare_snapshot_buffer()

    def ready(self) -> dict:
        """Identifies the process (used to kill it in chaos tests) and its size."""
        import ray

        return {
            "shard_id": self.shard_id,
            "spare": self.spare,
            "generation": self.generation,
            "pid": os.getpid(),
            "node_id": ray.get_runtime_context().get_node_id(),
            "node_ip": ray.util.get_node_ip_address(),
            "rows": sum(s.num_rows for s in self.slices) if self.shard_id is not None else 0,
            "device": str(self.device),
        }

    def _forward(self, lengths: np.ndarray, indices: np.ndarray, grad: bool):
        torch = self._torch
        idx = torch.from_numpy(_writable(indices)).to(self.device)
        off = torch.from_numpy(_offsets(lengths)).to(self.device)
        if grad:
            return self.tbe(idx, off)
        with torch.no_grad():
            return self.tbe(idx, off)

    def lookup(
        self,
        step: int,
        microbatches: tuple[int, ...],
        lengths: np.ndarray | ShmArray,
        indices: np.ndarray | ShmArray,
        out: ShmArray | None = None,
    ) -> np.ndarray | ShmArray:
        """Pooled embeddings float32 [B, S*D] of a trainer's microbatches of ``step``
        (written to ``out`` when given: a trainer on this node, see actors.shm).

        The ids are kept until the step's gradients arrive, so the trainer does not send
        them twice.
        """
        t0 = time.perf_counter()
        lengths, indices = self._shm.get(lengths), self._shm.get(indices)
        if step > self.applied_step:
            chunks = self._pending.setdefault(step, {})
            # A redo may split the step differently (fewer trainers): the new chunk replaces
            # every older one it overlaps, so no microbatch is ever counted twice.
            for key in [k for k in chunks if set(k) & set(microbatches)]:
                del chunks[key]
            chunks[tuple(microbatches)] = _Chunk(tuple(microbatches), lengths, indices)
            if self._tracking:
                t_track = time.perf_counter()
                ids = shard_row_ids(lengths, indices, self._slice_offsets)
                self.priority.observe(ids)
                if self._unconfirmed_save is not None:
                    self._since_save.append(ids)
                self.tracking_s += time.perf_counter() - t_track
        pooled = self._shm.put(out, self._forward(lengths, indices, grad=False).cpu().numpy())
        self.compute_s += time.perf_counter() - t0
        return pooled

    def lookup_eval(
        self, lengths: np.ndarray | ShmArray, indices: np.ndarray | ShmArray, out: ShmArray | None = None
    ) -> np.ndarray | ShmArray:
        """Pooled embeddings for evaluation; nothing is kept."""
        lengths, indices = self._shm.get(lengths), self._shm.get(indices)
        return self._shm.put(out, self._forward(lengths, indices, grad=False).cpu().numpy())

    def push_grads(self, step: int, microbatches: tuple[int, ...], grad: np.ndarray | ShmArray) -> dict:
        """Stores the pooled-embedding gradient of a chunk; applies the step when complete.

        Returns whether the step is applied, so the caller knows the update happened once.
        """
        if step <= self.applied_step:
            return {"applied": True, "duplicate": True}
        chunks = self._pending.get(step, {})
        chunk = chunks.get(tuple(microbatches))
        if chunk is None:
            # A newer attempt of this step split it differently and replaced this chunk (or a
            # load dropped it): this gradient belongs to an abandoned attempt. The caller's
            # step fails and is redone; nothing here changes.
            return {"applied": False, "duplicate": False, "stale": True}
        have = len(microbatches) + sum(len(c.microbatches) for c in chunks.values() if c.grad is not None and c is not chunk)
        if have < self.microbatches_per_step:
            chunk.grad = self._shm.get(grad)  # kept until the step's other chunks arrive: a copy
            return {"applied": False, "duplicate": False}
        # This chunk completes the step, which applies now: a gradient in shared memory is
        # read in place (the trainer does not touch its slab before this call returns).
        chunk.grad = self._shm.view(grad)
        self._apply(step, chunks)
        return {"applied": True, "duplicate": False}

    def _apply(self, step: int, chunks: dict[tuple[int, ...], _Chunk]) -> None:
        torch = self._torch
        t0 = time.perf_counter()
        ordered = [chunks[k] for k in sorted(chunks)]
        self.applied_microbatches.append((step, tuple(m for c in ordered for m in c.microbatches)))
        lengths, indices, grad = _merge_chunks(ordered)
        pooled = self._forward(lengths, indices, grad=True)
        pooled.backward(torch.from_numpy(_writable(grad)).to(self.device))
        self.rows_updated_total += int(indices.size)
        if self.first_step_after_load is None:
            self.first_step_after_load = step
        self.applied_step = step
        self._log({"event": "apply", "step": step, "microbatches": list(self.applied_microbatches[-1][1])})
        # An older step still pending never completed here (its other chunks went to a
        # shard that died, or were redone): its update to this shard is lost, not delayed.
        for s in [s for s in self._pending if s <= step]:
            self.steps_dropped += s < step
            del self._pending[s]
        self.compute_s += time.perf_counter() - t0

    def state(self) -> dict:
        """Counters for the report."""
        return {
            "shard_id": self.shard_id,
            "applied_step": self.applied_step,
            "compute_s": self.compute_s,
            "rows_updated_total": self.rows_updated_total,
            "steps_dropped": self.steps_dropped,
            "first_step_after_load": self.first_step_after_load,
            "tracking_s": self.tracking_s,
            "tracking_bytes": self.priority.tracking_bytes,
            "shm_reads": self._shm.reads,
        }

    def _log(self, record: dict) -> None:
        if self._audit is not None:
            self._audit.write(json.dumps({"t": round(time.time(), 6), "gen": self.generation, **record}) + "\n")

    def save_checkpoint(
        self, uri: str, step: int, save_index: int = 0, confirmed_step: int | None = None, full: bool = False
    ) -> dict:
        """Phase one of a save, at the step boundary: copies the rows to save as of ``step``
        committed steps (all of them with ``full``, else the rows the MFU/SSU policy selects
        for save ``save_index``) into memory, starts writing them in the background and
        returns. Only the copy holds the caller; ``save_written`` waits for the file.

        The rows are written by this actor straight to storage; only the file's entry
        (name, size, checksum) goes back to the supervisor, which commits the manifest once
        every part is durable. The rows count as saved (their MFU/SSU counts cleared) only
        when ``confirm_save`` names this step, i.e. its manifest committed.
        """
        self.confirm_save(confirmed_step)
        if self._write is not None:
            self._write.done.wait()  # the previous save's write (long done, normally)

        if self.applied_step != step - 1:
            raise RuntimeError(
                f"shard {self.shard_id}: asked to save step {step} but has applied "
                f"{self.applied_step + 1} steps; the checkpoint would be inconsistent"
            )
        t0 = time.perf_counter()
        if full:
            selection = self.priority.select_full(save_index, "the run's final checkpoint: every row")
        else:
            selection = self.priority.select(save_index)
        chosen = np.asarray(selection.rows, dtype=np.int64)
        data = self._snapshot_full() if selection.full else self._snapshot_rows(chosen)
        self._unconfirmed_save = (step, chosen)
        self._write = _Write(step)
        threading.Thread(
            target=self._write.run, args=(uri, step, self.shard_id, data), name=f"save-{step}", daemon=True
        ).start()
        return {
            "rows": len(data.rows),
            "bytes": int(data.weights.nbytes + data.momentum.nbytes + data.rows.nbytes + data.tables.nbytes),
            "full": selection.full,
            "reason": selection.reason,
            # Before the save clears the saved rows' counts (at its confirmation).
            "tracked_rows": self.priority.tracked_rows,
            "snapshot_s": time.perf_counter() - t0,
        }

    def _snapshot_full(self) -> ShardRows:
        """Every row, copied once into a buffer kept between saves (a fresh 100 MB allocation
        costs more in page faults than the copy; the previous write is done with it)."""
        self._prepare_snapshot_buffer()
        self._buf_thread.join()
        buf = self._snapshot_buf
        torch = self._torch
        weights_all, states_all = self.tbe.split_embedding_weights(), self.tbe.split_optimizer_states()
        for i in range(len(self.slices)):
            a, b = int(self._slice_offsets[i]), int(self._slice_offsets[i + 1])
            torch.from_numpy(buf.weights[a:b]).copy_(weights_all[i].detach())
            torch.from_numpy(buf.momentum[a:b]).copy_(states_all[i][0].detach())
        return buf

    def _prepare_snapshot_buffer(self) -> None:
        """Makes the full snapshot's buffer on a thread, once: at a shard's start, or after an
        adopted spare's load (not during it: zeroing 1 GB beside the load slowed it 2x)."""
        if self._buf_thread is None:
            self._buf_thread = threading.Thread(target=self._make_snapshot_buf, name="snapshot-buffer", daemon=True)
            self._buf_thread.start()

    def _make_snapshot_buf(self) -> ShardRows:
        """The full snapshot's buffer in this shard's layout, its pages touched (zeroed), so the
        first save does not pay for the page faults of a fresh allocation."""
        torch = self._torch
        n = int(self._slice_offsets[-1])
        tables = np.concatenate([np.full(s.num_rows, s.table, dtype=np.int32) for s in self.slices])
        rows = np.concatenate([np.arange(s.row_start, s.row_end, dtype=np.int64) for s in self.slices])
        buf = ShardRows(tables, rows, torch.zeros((n, self.dim)).numpy(), torch.zeros(n).numpy())
        self._snapshot_buf = buf
        return buf

    def _snapshot_rows(self, chosen: np.ndarray) -> ShardRows:
        """The ``chosen`` shard rows (an MFU/SSU selection), gathered into new arrays."""
        slice_of = np.searchsorted(self._slice_offsets, chosen, side="right") - 1
        weights_all, states_all = self.tbe.split_embedding_weights(), self.tbe.split_optimizer_states()
        tables, rows, weights, momentum = [], [], [], []
        for i, s in enumerate(self.slices):
            local = chosen[slice_of == i] - self._slice_offsets[i]
            idx = self._torch.from_numpy(local)
            weights.append(weights_all[i][idx].detach().cpu().numpy())  # indexing copies
            momentum.append(states_all[i][0][idx].detach().cpu().numpy())
            tables.append(np.full(len(local), s.table, dtype=np.int32))
            rows.append(local + s.row_start)
        return ShardRows(np.concatenate(tables), np.concatenate(rows), np.concatenate(weights), np.concatenate(momentum))

    def save_written(self, step: int) -> dict:
        """Phase one, part two (runs in its own concurrency group, beside training): waits
        until this shard's file of ``step`` is written and synced; returns its entry (name,
        size, checksum) and the background write time. Raises if that write failed or no
        save of ``step`` is in flight (this process did not take its snapshot)."""
        w = self._write
        if w is None or w.step != step:
            raise RuntimeError(f"shard {self.shard_id}: no save of step {step} in flight here")
        w.done.wait()
        if w.error is not None:
            raise RuntimeError(f"shard {self.shard_id}: writing checkpoint step {step} failed: {w.error}")
        return {"entry": w.entry, "write_s": w.write_s}

    def confirm_save(self, step: int | None) -> None:
        """Phase two of a save: the manifest of ``step`` committed, so the rows this shard wrote
        for it are saved. Their counts are cleared, and the accesses they got after the
        snapshot are counted again (those updates are not in the checkpoint). A save that is
        never confirmed (its manifest did not commit) leaves every count as it was."""
        if self._unconfirmed_save is not None and self._unconfirmed_save[0] == step:
            rows = self._unconfirmed_save[1]
            self.priority.mark_saved(rows)
            if self._since_save:
                after = np.concatenate(self._since_save)
                self.priority.observe(after[np.isin(after, rows)])
        self._unconfirmed_save = None
        self._since_save = []

    def load_checkpoint(self, uri: str, steps: list[int], why: str = "recovery") -> dict:
        """Restores this shard from the chain ``steps`` (a full checkpoint, then incrementals,
        each applied over the last) and forgets any step in flight.

        It reads and verifies only its own file of each step (``CheckpointStore.shard_chain``
        up to ``steps[-1]``), each once: a corrupt one is refused and the chain falls back
        (an older full, or a shorter run of incrementals); with no valid full the shard goes
        back to its initial rows. The shard is then exactly at ``chain[-1]`` committed steps.
        Returns the chain used and which shard rows each incremental held, for per-row
        lost-sample accounting.
        """
        import torch

        t0 = time.perf_counter()
        store = CheckpointStore(uri)
        used, parts = store.shard_chain(self.shard_id, steps[-1]) if steps else ([], [])
        fallbacks = [{"step": s, "reason": r} for s, r in store.fallbacks]
        if not used:
            self.reset_to_init(why)
            return {"rows": 0, "bytes": 0, "incremental_rows": [], "chain": [], "fallbacks": fallbacks,
                    "duration_s": time.perf_counter() - t0}
        weights = self.tbe.split_embedding_weights()
        states = self.tbe.split_optimizer_states()
        rows_loaded = bytes_loaded = 0
        incremental_rows = []
        for n, data in enumerate(parts):
            rows_loaded += len(data.rows)
            bytes_loaded += data.weights.nbytes + data.momentum.nbytes + data.rows.nbytes + data.tables.nbytes
            with torch.no_grad():
                if n == 0 and self._whole_layout(data):
                    # A full file of this very layout: one contiguous copy per slice.
                    for i in range(len(self.slices)):
                        a, b = self._slice_offsets[i], self._slice_offsets[i + 1]
                        weights[i].copy_(torch.from_numpy(data.weights[a:b]))
                        states[i][0].copy_(torch.from_numpy(data.momentum[a:b]))
                    self._initialized = True
                    continue
                if not self._initialized:
                    self._init_weights(self.seed)  # rows the file does not hold keep their initial value
                shard_rows = []
                for i, s in enumerate(self.slices):
                    mask = (data.tables == s.table) & (data.rows >= s.row_start) & (data.rows < s.row_end)
                    local = data.rows[mask] - s.row_start
                    idx = torch.from_numpy(local)
                    weights[i][idx] = torch.from_numpy(data.weights[mask]).to(weights[i].device)
                    states[i][0][idx] = torch.from_numpy(data.momentum[mask]).to(states[i][0].device)
                    shard_rows.append(local + self._slice_offsets[i])
            if n > 0:
                incremental_rows.append((used[n], np.concatenate(shard_rows)))
        self._pending.clear()
        self.applied_step = used[-1] - 1
        self.first_step_after_load = None
        # Every row now equals its saved copy: nothing is unsaved, so access counts restart.
        self.priority = self._new_policy()
        self.confirm_save(None)
        self._log({"event": "load", "chain": list(used), "why": why})
        self.applied_microbatches = [x for x in self.applied_microbatches if x[0] < used[-1]]
        self._prepare_snapshot_buffer()
        return {
            "rows": int(rows_loaded),
            "bytes": int(bytes_loaded),
            "incremental_rows": incremental_rows,
            "chain": list(used),
            "fallbacks": fallbacks,
            "duration_s": time.perf_counter() - t0,
        }

    def _whole_layout(self, data) -> bool:
        """Whether ``data`` holds exactly this shard's rows, slice by slice in row order (what
        a full save of this plan writes)."""
        if len(data.rows) != int(self._slice_offsets[-1]):
            return False
        for i, s in enumerate(self.slices):
            a, b = int(self._slice_offsets[i]), int(self._slice_offsets[i + 1])
            if not ((data.tables[a:b] == s.table).all() and np.array_equal(data.rows[a:b], np.arange(s.row_start, s.row_end))):
                return False
        return True

    def applied_log(self) -> list[tuple[int, tuple[int, ...]]]:
        """(step, microbatch ids) of every embedding update this shard applied, in order."""
        return list(self.applied_microbatches)

    def get_rows(self) -> list[tuple[np.ndarray, np.ndarray]]:
        """(weights float32 [rows, D], momentum float32 [rows]) per slice, as copies."""
        weights = self.tbe.split_embedding_weights()
        states = self.tbe.split_optimizer_states()
        return [
            (w.detach().cpu().numpy().copy(), st[0].detach().cpu().numpy().copy())
            for w, st in zip(weights, states)
        ]
