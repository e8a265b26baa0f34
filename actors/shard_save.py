"""One embedding shard's side of checkpoints: which rows it saves (MFU/SSU access counts), its
two-phase save (a snapshot at the step boundary, a background write, a confirmation once the
manifest commits) and the load of its own files of a chain into its tables. Its waits for a
write (slow storage) are bounded: the save fails, not the shard (``core.deadlines``).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Callable

import numpy as np

from core.checkpoint import ShardRows, write_shard_file
from core.deadlines import Deadline
from core.plan import TableSlice, shard_row_ids, slice_offsets
from core.records import Snapshot, WrittenPart
from actors.shard_chunks import this_thread_idle
from actors.shard_link import on_link_thread
from actors.tracking import AccessTracker
from policies import make_policy

logger = logging.getLogger(__name__)

__all__ = ["ShardCheckpoints"]


class _Write:
    """The background write of one save's snapshot."""

    def __init__(self, step: int):
        self.step = step
        self.done = threading.Event()
        self.entry = None
        self.error: str | None = None
        self.write_s = 0.0

    def run(self, uri: str, step: int, shard_id: int, data: ShardRows) -> None:
        t0 = time.perf_counter()
        try:
            self.entry = write_shard_file(uri, step, shard_id, data)
        except BaseException as err:  # reported to the coordinator by ShardCheckpoints.written
            self.error = repr(err)[:300]
        finally:
            self.write_s = time.perf_counter() - t0
            self.done.set()


def _nbytes(data: ShardRows) -> int:
    return int(data.weights.nbytes + data.momentum.nbytes + data.rows.nbytes + data.tables.nbytes)


class ShardCheckpoints:
    """Made by an ``EmbeddingShard`` when it allocates its tables: ``tbe`` is its fbgemm
    kernel over ``slices`` (shard rows numbered slice after slice, as ``slice_offsets``
    says), ``torch`` the module the shard imported, ``priority`` the MFU/SSU policy's
    arguments and ``seed`` its sampling seed."""

    def __init__(self, torch, tbe, shard_id: int, slices: list[TableSlice], dim: int, priority: dict, seed: int,
                 lock: threading.RLock | None = None):
        self._torch, self._tbe = torch, tbe
        self.shard_id = shard_id
        self.slices = list(slices)
        self.offsets = slice_offsets(self.slices)
        self.dim = dim
        self._priority_args, self._seed = priority, seed
        self.priority = self._new_policy()
        self.tracking = priority["policy"] != "full"  # a full-only policy needs no access counts
        self._tracker = AccessTracker(self._track, f"shard-{shard_id}", lock)  # counts between the shard's requests
        # The rows written for a save whose manifest is not known to be committed yet:
        # (step, rows). They count as saved only once it is (two-phase save).
        self._unconfirmed: tuple[int, np.ndarray] | None = None
        self._since_save: list[np.ndarray] = []  # shard rows updated after that save's snapshot
        self._write: _Write | None = None  # the background write of the last save's snapshot
        # The buffer a full snapshot is copied into, made by prepare_snapshot_buffer.
        self._buf: ShardRows | None = None
        self._buf_thread: threading.Thread | None = None
        self.full_next: str | None = None  # why the next save writes every row (a promoted mirror counted nothing)

    def _new_policy(self):
        p = self._priority_args
        return make_policy(p["policy"], int(self.offsets[-1]), p["r"], p["sample_rate"], self._seed, p["full_every"],
                           add=self._add_ones)

    def _add_ones(self, counts: np.ndarray, ids: np.ndarray) -> None:
        """MFU's counting (``policies.priority.add_ones``) with torch's index_add: 0.06 ms for
        a demo step's 27k ids, against 1.2 ms for the sort-based count and 1.7 for add.at."""
        torch = self._torch
        index = torch.from_numpy(np.ascontiguousarray(ids, dtype=np.int64))
        torch.from_numpy(counts).index_add_(0, index, torch.ones(1, dtype=torch.int32).expand(ids.size))

    def observe(self, lengths: np.ndarray, indices: np.ndarray) -> None:
        """Counts the rows of a step applied (``tracking`` policies only), on the tracker's
        thread (``actors.tracking``): every method below that reads or changes the counts
        drains it first."""
        self._tracker.put(lengths, indices, wake=not on_link_thread())  # a link wakes it after its reply

    def wake(self) -> None:
        self._tracker.wake()

    @property
    def tracking_thread_s(self) -> float:
        """Time the tracker's thread spent counting, beside the steps."""
        return self._tracker.busy_s

    def _track(self, lengths: np.ndarray, indices: np.ndarray) -> None:
        ids = shard_row_ids(lengths, indices, self.offsets)
        self.priority.observe(ids)
        if self._unconfirmed is not None:
            self._since_save.append(ids)

    def restart(self) -> None:
        """Every row equals its saved copy (a load, or the initial rows): nothing is unsaved,
        so access counts restart and no save waits for confirmation (and a tracking failure
        is forgotten with the counts it spoiled)."""
        self._tracker.reset()
        self.priority = self._new_policy()
        self.confirm(None)

    # ----------------------------------------------------------------- saving

    def wait_written(self, deadline: Deadline) -> None:
        """Waits for the previous save's write (long done, normally) until ``deadline``; one
        still running then (slow storage) raises ``TimeoutError``: this save is not taken (the
        supervisor abandons it and saves again later) and the shard serves on."""
        w = self._write
        if w is not None and not w.done.wait(deadline.remaining()):
            raise TimeoutError(f"shard {self.shard_id}: the write of checkpoint step {w.step} is still running "
                               f"after {deadline.total_s:g}s (slow storage); no new save is taken before it ends")

    def snapshot(self, uri: str, step: int, save_index: int, full: bool, deadline: Deadline) -> Snapshot:
        """Copies the rows to save (all of them with ``full``, else the policy's selection
        for save ``save_index``) and starts writing them as ``step`` in the background. The
        full snapshot's buffer is waited for until ``deadline`` (``TimeoutError`` after it)."""
        self._tracker.drain()
        t0 = time.perf_counter()
        if full or self.full_next:
            selection = self.priority.select_full(save_index, self.full_next or "the run's final checkpoint: every row")
            self.full_next = None
        else:
            selection = self.priority.select(save_index)
        chosen = np.asarray(selection.rows, dtype=np.int64)
        data = self._snapshot_full(deadline) if selection.full else self._snapshot_rows(chosen)
        self._unconfirmed = (step, chosen)
        self._write = _Write(step)
        threading.Thread(
            target=self._write.run, args=(uri, step, self.shard_id, data), name=f"save-{step}", daemon=True
        ).start()
        return Snapshot(
            rows=len(data.rows),
            bytes=_nbytes(data),
            full=selection.full,
            reason=selection.reason,
            # Before the save clears the saved rows' counts (at its confirmation).
            tracked_rows=self.priority.tracked_rows,
            snapshot_s=time.perf_counter() - t0,
        )

    def written(self, step: int, timeout_s: float) -> WrittenPart:
        """Waits for the write of ``step``'s snapshot, ``timeout_s`` at most (``TimeoutError``:
        slow storage); raises if it failed or none is in flight."""
        w = self._write
        if w is None or w.step != step:
            raise RuntimeError(f"shard {self.shard_id}: no save of step {step} in flight here")
        if not w.done.wait(timeout_s):
            raise TimeoutError(f"shard {self.shard_id}: writing checkpoint step {step} took over {timeout_s:g}s "
                               f"(slow storage)")
        if w.error is not None:
            raise RuntimeError(f"shard {self.shard_id}: writing checkpoint step {step} failed: {w.error}")
        return WrittenPart(entry=w.entry, write_s=w.write_s)

    def confirm(self, step: int | None) -> None:
        """The manifest of ``step`` committed: the rows written for it are saved. Their counts
        are cleared, and the accesses they got after the snapshot are counted again (those
        updates are not in the checkpoint). A save that is never confirmed (its manifest did
        not commit) leaves every count as it was."""
        self._tracker.drain()
        if self._unconfirmed is not None and self._unconfirmed[0] == step:
            rows = self._unconfirmed[1]
            self.priority.mark_saved(rows)
            if self._since_save:
                after = np.concatenate(self._since_save)
                self.priority.observe(after[np.isin(after, rows)])
        self._unconfirmed = None
        self._since_save = []

    def _snapshot_full(self, deadline: Deadline) -> ShardRows:
        """Every row, copied once into a buffer kept between saves (a fresh 100 MB allocation
        costs more in page faults than the copy; the previous write is done with it)."""
        self.prepare_snapshot_buffer()
        self._buf_thread.join(deadline.remaining())
        if self._buf_thread.is_alive():  # made at idle priority on a busy host: the next save takes it
            raise TimeoutError(f"shard {self.shard_id}: the snapshot buffer was not ready within {deadline.total_s:g}s")
        buf = self._buf
        weights_all, states_all = self._tbe.split_embedding_weights(), self._tbe.split_optimizer_states()
        for i in range(len(self.slices)):
            a, b = int(self.offsets[i]), int(self.offsets[i + 1])
            self._torch.from_numpy(buf.weights[a:b]).copy_(weights_all[i].detach())
            self._torch.from_numpy(buf.momentum[a:b]).copy_(states_all[i][0].detach())
        return buf

    def prepare_snapshot_buffer(self) -> None:
        """Makes the full snapshot's buffer on a thread at idle priority, once: at a shard's
        start, or after an adopted spare's load (not during it: zeroing 1 GB beside the load
        slowed it 2x). At normal priority, faulting in 2.5 GB beside a run's first steps made
        them three times slower; a save that comes first waits for it (and the trainers it
        holds leave it the CPU)."""
        if self._buf_thread is None:
            self._buf_thread = threading.Thread(target=self._make_snapshot_buf, name="snapshot-buffer", daemon=True)
            self._buf_thread.start()

    def _make_snapshot_buf(self) -> ShardRows:
        """The full snapshot's buffer in this shard's layout, its pages touched (zeroed), so the
        first save does not pay for the page faults of a fresh allocation."""
        this_thread_idle()
        n = int(self.offsets[-1])
        tables = np.concatenate([np.full(s.num_rows, s.table, dtype=np.int32) for s in self.slices])
        rows = np.concatenate([np.arange(s.row_start, s.row_end, dtype=np.int64) for s in self.slices])
        buf = ShardRows(tables, rows, self._torch.zeros((n, self.dim)).numpy(), self._torch.zeros(n).numpy())
        self._buf = buf
        return buf

    def _snapshot_rows(self, chosen: np.ndarray) -> ShardRows:
        """The ``chosen`` shard rows (an MFU/SSU selection), gathered into new arrays."""
        slice_of = np.searchsorted(self.offsets, chosen, side="right") - 1
        weights_all, states_all = self._tbe.split_embedding_weights(), self._tbe.split_optimizer_states()
        tables, rows, weights, momentum = [], [], [], []
        for i, s in enumerate(self.slices):
            local = chosen[slice_of == i] - self.offsets[i]
            idx = self._torch.from_numpy(local)
            weights.append(weights_all[i][idx].detach().cpu().numpy())  # indexing copies
            momentum.append(states_all[i][0][idx].detach().cpu().numpy())
            tables.append(np.full(len(local), s.table, dtype=np.int32))
            rows.append(local + s.row_start)
        return ShardRows(np.concatenate(tables), np.concatenate(rows), np.concatenate(weights), np.concatenate(momentum))

    # ----------------------------------------------------------------- loading

    def restore(
        self, steps: list[int], parts: list[ShardRows], initialized: bool, init_rows: Callable[[], None]
    ) -> tuple[int, int, tuple[tuple[int, np.ndarray], ...]]:
        """``_restore`` with torch on every core: nothing else runs in a shard that loads (a
        1.3 GB copy took 0.23 s on the one thread a shard computes with)."""
        threads, t0 = self._torch.get_num_threads(), time.perf_counter()
        self._torch.set_num_threads(max(threads, os.cpu_count() or 1))
        try:
            return self._restore(steps, parts, initialized, init_rows)
        finally:
            self._torch.set_num_threads(threads)
            logger.info("shard %s: rows of %s copied in %.3fs", self.shard_id, steps, time.perf_counter() - t0)

    def _restore(
        self, steps: list[int], parts: list[ShardRows], initialized: bool, init_rows: Callable[[], None]
    ) -> tuple[int, int, tuple[tuple[int, np.ndarray], ...]]:
        """Writes ``parts`` (this shard's files of the chain ``steps``, a full then its
        incrementals) into the tables, each over the last. ``init_rows`` gives the rows their
        initial values first where the tables are not ``initialized`` and the full does not
        cover every row. Returns the rows and bytes read and, per incremental, (its step, the
        shard rows it held)."""
        torch = self._torch
        weights = self._tbe.split_embedding_weights()
        states = self._tbe.split_optimizer_states()
        rows_loaded = bytes_loaded = 0
        incremental_rows = []
        for n, data in enumerate(parts):
            rows_loaded += len(data.rows)
            bytes_loaded += _nbytes(data)
            with torch.no_grad():
                if n == 0 and self._whole_layout(data):
                    # A full file of this very layout: one contiguous copy per slice.
                    for i in range(len(self.slices)):
                        a, b = self.offsets[i], self.offsets[i + 1]
                        weights[i].copy_(torch.from_numpy(data.weights[a:b]))
                        states[i][0].copy_(torch.from_numpy(data.momentum[a:b]))
                    initialized = True
                    continue
                if not initialized:
                    init_rows()  # rows the file does not hold keep their initial value
                    initialized = True
                shard_rows = []
                for i, s in enumerate(self.slices):
                    mask = (data.tables == s.table) & (data.rows >= s.row_start) & (data.rows < s.row_end)
                    local = data.rows[mask] - s.row_start
                    idx = torch.from_numpy(local)
                    weights[i][idx] = torch.from_numpy(data.weights[mask]).to(weights[i].device)
                    states[i][0][idx] = torch.from_numpy(data.momentum[mask]).to(states[i][0].device)
                    shard_rows.append(local + self.offsets[i])
            if n > 0:
                incremental_rows.append((steps[n], np.concatenate(shard_rows)))
        return int(rows_loaded), int(bytes_loaded), tuple(incremental_rows)

    def _whole_layout(self, data: ShardRows) -> bool:
        """Whether ``data`` holds exactly this shard's rows, slice by slice in row order (what
        a full save of this plan writes)."""
        if len(data.rows) != int(self.offsets[-1]):
            return False
        for i, s in enumerate(self.slices):
            a, b = int(self.offsets[i]), int(self.offsets[i + 1])
            if not ((data.tables[a:b] == s.table).all() and np.array_equal(data.rows[a:b], np.arange(s.row_start, s.row_end))):
                return False
        return True
