"""An embedding shard's checkpoint methods (mixed into ``EmbeddingShard``, which provides the
lock, the tables and ``ShardCheckpoints``): the two phases of a save, a load of a chain, a reset
to the initial rows. The work itself is ``actors.shard_save``'s."""

from __future__ import annotations

import dataclasses
import time

from core.checkpoint import CheckpointStore, restore_shard
from core.deadlines import Deadline
from core.records import CheckpointFallback, LoadResult, Snapshot, WrittenPart
from actors.shard_link import exclusive

__all__ = ["ShardSaving"]

NO_CHAIN_GIVEN = "no checkpoint chain given: the initial rows"


class ShardSaving:
    @exclusive
    def reset_to_init(self, why: str = "recovery", reason: str = NO_CHAIN_GIVEN) -> LoadResult:
        """Back to the initial rows and empty Adagrad state: step 0's (an empty chain); ``why``
        (recovery or rollback) and ``reason`` (why the initial rows) go to the audit log."""
        self._pending.clear()
        self._init_weights(self.seed)
        with self._torch.no_grad():
            for st in self.tbe.split_optimizer_states():
                st[0].zero_()
        self._loaded([], why, reason)
        return LoadResult(rows=0, bytes=0, chain=(), initial_rows_reason=reason)

    def _loaded(self, chain: list[int], why: str, initial_rows_reason: str | None = None) -> None:
        """The rows are now those of ``chain`` (the initial ones for an empty chain, for
        ``initial_rows_reason``), so the shard is at ``chain[-1]`` committed steps: it forgets
        any step in flight, and the MFU/SSU access counts restart from these rows."""
        done = chain[-1] if chain else 0
        self._pending.clear()
        self._complete = None
        self._drop_mirror()
        self.applied_step = done - 1
        while self.applied_microbatches and self.applied_microbatches[-1][0] >= done:  # applied in step order
            self.applied_microbatches.pop()
        self.first_step_after_load = None
        self._promoted = False
        self._ckpt.restart()
        self._log({"event": "load", "chain": list(chain), "why": why, "initial_rows_reason": initial_rows_reason})
        self._ckpt.prepare_snapshot_buffer()

    @exclusive
    def save_checkpoint(
        self, uri: str, step: int, save_index: int = 0, confirmed_step: int | None = None, full: bool = False
    ) -> Snapshot:
        """Phase one of a save, at the step boundary: copies the rows to save as of ``step``
        committed steps (all of them with ``full``, else the rows the MFU/SSU policy selects
        for save ``save_index``) into memory, starts writing them in the background and
        returns. Only the copy holds the caller; ``save_written`` waits for the file.

        The rows are written by this actor straight to storage; only the file's entry
        (name, size, checksum) goes back to the supervisor, which commits the manifest once
        every part is durable. The rows count as saved (their MFU/SSU counts cleared) only
        when ``confirm_save`` names this step, i.e. its manifest committed.

        Its waits under the lock (the previous write, the lease, the buffer) end within
        ``deadlines.lock_wait_s``: slow storage fails this save (``TimeoutError``), not the shard.
        """
        deadline = Deadline(self.deadlines.lock_wait_s)
        self._ckpt.confirm(confirmed_step)
        self._ckpt.wait_written(deadline)
        self._commit_before(step, deadline)
        if self.applied_step != step - 1:
            raise RuntimeError(
                f"shard {self.shard_id}: asked to save step {step} but has applied "
                f"{self.applied_step + 1} steps; the checkpoint would be inconsistent"
            )
        return self._ckpt.snapshot(uri, step, save_index, full, deadline)

    def save_written(self, step: int) -> WrittenPart:
        """Phase one, part two (runs in its own concurrency group, beside training): waits
        until this shard's file of ``step`` is written and synced; returns its entry (name,
        size, checksum) and the background write time. Raises if that write failed, did not end
        within ``deadlines.written_s`` (slow storage) or no save of ``step`` is in flight (this
        process did not take its snapshot)."""
        return self._ckpt.written(step, self.deadlines.written_s)

    @exclusive
    def confirm_save(self, step: int | None) -> None:
        """Phase two of a save: the manifest of ``step`` committed, so the rows this shard wrote
        for it are saved (``ShardCheckpoints.confirm``; unconfirmed, MFU/SSU counts stay)."""
        self._ckpt.confirm(step)

    @exclusive
    def load_checkpoint(self, uri: str, steps: list[int], why: str = "recovery") -> LoadResult:
        """Restores this shard from a chain (a full checkpoint, then incrementals, each applied
        over the last) and forgets any step in flight.

        It reads and verifies only its own file of each step, each once
        (``core.checkpoint.restore_shard``): a partial recovery (``why`` "recovery") takes the
        newest valid chain at load time, a rollback ``steps`` or older; a corrupt, unlisted or
        removed file is a fallback (an older full, or a shorter run of incrementals), named in
        the result. The initial rows only where no checkpoint exists yet (or a rollback goes to
        step 0), saying so in the result and the audit log. The shard is then exactly at
        ``chain[-1]`` committed steps. Returns the chain used and which shard rows each
        incremental held, for per-row lost-sample accounting.

        Raises:
            NoValidChain: checkpoints exist but none holds a valid chain of this shard's files.
        """
        t0 = time.perf_counter()
        self._pending.clear()  # a restore that fails midway must leave no lookup to apply over it
        self._complete = None
        found = restore_shard(CheckpointStore(uri), self.shard_id, steps, why, self.slices)
        fallbacks = tuple(CheckpointFallback(step=s, reason=r, removed=gone) for s, r, gone in found.fallbacks)
        used, parts = found.steps, found.parts
        if not used:
            reset = self.reset_to_init(why, found.initial_rows_reason)
            return dataclasses.replace(reset, fallbacks=fallbacks, duration_s=time.perf_counter() - t0)
        rows, nbytes, incremental_rows = self._ckpt.restore(
            used, parts, self._initialized, lambda: self._init_weights(self.seed)
        )
        self._initialized = True
        self._loaded(used, why)
        return LoadResult(
            rows=rows,
            bytes=nbytes,
            chain=tuple(used),
            incremental_rows=incremental_rows,
            fallbacks=fallbacks,
            duration_s=time.perf_counter() - t0,
        )
