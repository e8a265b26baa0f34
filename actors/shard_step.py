"""An embedding shard's side of the step protocol (``core.step_protocol``, ``docs/ARCHITECTURE.md``):
lookups and gradient pushes of a try, the explicit commit that applies a step, and the apply,
which records nothing before fbgemm's update returned. Mixed into ``EmbeddingShard``.

A step's update is applied once, at its commit: its gradients must all be here
(``microbatches_per_step`` microbatches, all of one try), and a request must name that try
committed (a lookup of a later step carries the newest committed try; a save of the step and
the end of training commit what came before). The update then does not depend on which trainer
computed which microbatch (they apply in microbatch-id order), a microbatch resent by a redo
replaces its earlier copy instead of being applied twice, and a step that failed elsewhere and
is redone finds the rows it found the first time."""

from __future__ import annotations

import logging
import os
import time

import numpy as np

from actors.shard_chunks import merge_chunks, rows_digest, writable
from actors.shard_link import exclusive
from actors.shm import ShmArray
from core.deadlines import Deadline
from core.errors import StaleLease, StaleRequest
from core.records import PushResult
from core.step_protocol import StepId

__all__ = ["ShardSteps"]

logger = logging.getLogger(__name__)


class ShardSteps:
    """Uses the shard's ``_lock``, ``_pending``, ``_complete``, ``_forward``, ``_shm``, ``_ckpt``,
    ``_lease``, ``_log``, ``_send_to_mirror`` and its counters."""

    @exclusive
    def lookup(
        self,
        step: int,
        microbatches: tuple[int, ...],
        lengths: np.ndarray | ShmArray,
        indices: np.ndarray | ShmArray,
        out: ShmArray | None = None,
        attempt: StepId | None = None,
        commit: StepId | None = None,
    ) -> np.ndarray | ShmArray:
        """Pooled embeddings float32 [B, S*D] of a trainer's microbatches of ``step`` (written
        to ``out`` when given: a trainer on this node, see actors.shm). The ids are kept until
        the step's gradients arrive, so the trainer does not send them twice. ``attempt``: the
        try the lookup belongs to; ``commit``: the newest committed try, applied here first if
        it is the step this shard holds complete (``core.step_protocol``). A caller without
        tries (a test or a benchmark driving the shard alone) commits every earlier step."""
        t0 = time.perf_counter()
        lengths, indices = self._shm.get(lengths), self._shm.get(indices)
        graph = None
        if attempt is None:
            self._commit_before(step)
        else:
            self._commit_named(commit, step)
        if step > self.applied_step:
            try_ = (attempt.generation, attempt.attempt) if attempt is not None else None
            if self._pending.newer_try(step, try_) is False:
                raise StaleRequest(f"shard {self.shard_id}: {attempt} is older than the try of step {step} here")
            # A whole-step chunk keeps the kernel's autograd record: its update needs no second forward.
            whole = len(microbatches) >= self.microbatches_per_step
            pooled = graph = self._forward(lengths, indices, grad=whole)
            self._pending.add(step, microbatches, lengths, indices, graph if whole else None, try_)
            if self._complete == step:
                self._complete = None  # a redo: its chunks are replaced, their gradients come again
        else:
            pooled = self._forward(lengths, indices, grad=False)
        out = self._shm.put(out, pooled.detach().cpu().numpy())
        self.compute_s += time.perf_counter() - t0
        return out

    @exclusive
    def lookup_eval(self, lengths: np.ndarray | ShmArray, indices: np.ndarray | ShmArray, out: ShmArray | None = None):
        """Pooled embeddings for evaluation (training committed every step); nothing is kept."""
        self._commit_before(float("inf"))
        lengths, indices = self._shm.get(lengths), self._shm.get(indices)
        return self._shm.put(out, self._forward(lengths, indices, grad=False).cpu().numpy())

    @exclusive
    def push_grads(self, step: int, microbatches: tuple[int, ...], grad: np.ndarray | ShmArray,
                   attempt: StepId | None = None) -> PushResult:
        """Stores the pooled-embedding gradient of a chunk of try ``attempt``. ``applied``: the
        step is complete here (and on the mirror), so its update happens once, at its commit."""
        if step <= self.applied_step:
            return PushResult(applied=True, duplicate=True)
        deadline = Deadline(self.deadlines.lock_wait_s)
        chunk = self._pending.chunk(step, microbatches)
        try_ = (attempt.generation, attempt.attempt) if attempt is not None else None
        if chunk is None or self._pending.newer_try(step, try_) is not None:
            # A newer attempt of this step split it differently and replaced this chunk (or a
            # load dropped it): this gradient belongs to an abandoned attempt. The caller's
            # step fails and is redone; nothing here changes.
            return PushResult(applied=False, stale=True)
        if not self._pending.completes(step, chunk):
            chunk.grad = self._shm.get(grad)  # kept until the step's other chunks arrive: a copy
            return PushResult(applied=False)
        if not self._hold_lease(deadline):
            # The cluster did not confirm this shard's place in time: not taken, the step is
            # redone (a process replaced meanwhile raises Fenced here and exits).
            return PushResult(applied=False, stale=True)
        chunk.grad = self._shm.get(grad)  # the trainer's slab is rewritten before the commit
        if not self._send_to_mirror(step):  # within mirror_feed_s: a slow mirror is killed, not this shard
            chunk.grad = None  # not complete: the redo sends it again, to this shard alone
            return PushResult(applied=False, stale=True)
        self._check_act(f"completion of step {step}")
        self._complete = step
        self._log({"event": "complete", "step": step, "try": self._pending.try_of(step),
                   "microbatches": [m for c in self._pending.ordered(step) for m in c.microbatches]})
        return PushResult(applied=True)

    def _commit_named(self, commit: StepId | None, step: int) -> None:
        """The explicit commit a request for ``step`` carries: the step held complete here applies
        if ``commit`` names its try, or a later step (steps commit in order). One the request
        does not commit is refused: serving ``step`` would give rows without it."""
        c = self._complete
        if c is None or c >= step:
            return
        held = self._pending.try_of(c)
        named = commit is not None and (commit.step > c or (
            commit.step == c and held in (None, (commit.generation, commit.attempt))))
        if not named:
            self.commits_refused += 1
            raise StaleRequest(f"shard {self.shard_id} holds step {c} complete (try {held}); the request for "
                               f"step {step} commits {commit or 'nothing'}")
        self._commit_before(c + 1)

    def _commit_before(self, step: float, deadline: Deadline | None = None) -> None:
        """Steps before ``step`` are committed (an explicit commit, a save of ``step`` steps, the
        end of training): the complete step, if older, applies now. ``deadline``: the call's
        bound on its waits under the lock (``Deadlines.lock_wait_s`` from now by default). The
        step stays complete until its apply returned: an apply that raised may have changed
        some rows, so the process ends (``_apply_failed``) and is recovered, never dropping it."""
        if self._complete is not None and self._complete < step:
            if not self._hold_lease(deadline or Deadline(self.deadlines.lock_wait_s)):
                # Cut off from the cluster: its successor may hold the place and apply this step.
                raise StaleLease(f"shard {self.shard_id}: its place was not confirmed in time; "
                                 f"step {self._complete} is not applied here")
            complete = self._complete
            try:
                record = self._apply(complete)
            except Exception as err:  # noqa: BLE001 - any failure of the kernel: the rows are unknown
                self._apply_failed(complete, err)
                raise
            self._complete = None
            self._check_act(f"apply of step {complete}")
            # Recorded only now: an apply that outlasted the lease may have overlapped the
            # successor's, and this process exits with it (the rows it changed go with it).
            self._log(record)

    def _apply_failed(self, step: int, err: Exception) -> None:
        """The kernel raised applying ``step`` (out of memory, say): some rows may hold it and
        some not. The shard cannot serve: it says so and ends its process, whose death the
        supervisor recovers like any other (the step's loss counted), instead of going on with
        the step neither applied nor pending."""
        logger.error("shard %s: applying step %d failed (%r); the process ends for a recovery", self.shard_id, step, err)
        self._log({"event": "apply_failed", "step": step, "error": repr(err)[:200]})
        self._exit_process(70)

    def _exit_process(self, code: int) -> None:
        os._exit(code)

    def _hold_lease(self, deadline: Deadline) -> bool:
        """The lease's confirmation (``Lease.hold``) for an act that follows, waited for at most
        two terms and never past ``deadline``; True without a lease."""
        return self._lease is None or self._lease.hold(timeout_s=deadline.remaining(2 * self._lease.term_s))

    def _may_act(self) -> bool:
        """Whether this shard may act on the cluster now (kill its mirror): its lease confirmed
        within the lock's wait."""
        return self._hold_lease(Deadline(self.deadlines.lock_wait_s))

    def _check_act(self, act: str) -> None:
        """The act just done under ``_hold_lease`` ended while the lease held; else it may have
        overlapped a successor's, and the process is fenced: it exits (``Lease.check_act``)."""
        if self._lease is not None:
            self._lease.check_act(f"shard {self.shard_id}'s {act}")

    def _track(self, lengths: np.ndarray, indices: np.ndarray) -> None:
        """Counts the rows of a step being applied for MFU/SSU: once, however often it was
        looked up (a redo looks it up again). A mirror counts nothing: no save of its own
        clears its counts, and a promoted one saves every row first (``_promote``)."""
        if self._ckpt.tracking and self._mirror is None:
            t0 = time.perf_counter()
            self._ckpt.observe(lengths, indices)
            self.tracking_s += time.perf_counter() - t0

    def _apply(self, step: int) -> dict:
        """Applies ``step``; returns its audit record, stamped with the moment the apply ended,
        for the caller to write once the act is known to have ended within the lease. Nothing
        records the step as applied before the kernel's update returned."""
        torch = self._torch
        t0 = time.perf_counter()
        ordered = self._pending.ordered(step)
        lengths, indices, grad = merge_chunks(ordered)
        pooled = ordered[0].graph if len(ordered) == 1 and ordered[0].graph is not None else None
        if pooled is None:
            pooled = self._forward(lengths, indices, grad=True)
        pooled.backward(torch.from_numpy(writable(grad)).to(self.device))
        microbatches = tuple(m for c in ordered for m in c.microbatches)
        self.applied_microbatches.append((step, microbatches))
        self._track(lengths, indices)
        self.rows_updated_total += int(indices.size)
        if self.first_step_after_load is None:
            self.first_step_after_load = step
        self.applied_step = step
        record = {"t": round(time.time(), 6), "event": "apply", "step": step, "try": self._pending.try_of(step),
                  "microbatches": list(microbatches)}
        if self._audit is not None:  # the rows it left, for cpr verify --replay
            record["rows"] = rows_digest(self.tbe, self.slices, lengths, indices)
        # An older step still pending never completed here (its other chunks went to a
        # shard that died, or were redone): its update to this shard is lost, not delayed.
        self.steps_dropped += self._pending.drop_through(step)
        self.compute_s += time.perf_counter() - t0
        return record

