"""EmbeddingShard: one Ray actor holding its slices of the embedding tables in fbgemm's
table-batched kernel with fused row-wise Adagrad. It imports torch and fbgemm, not torchrec (a
respawned shard is back 1.5 s sooner). Its saves and loads are ``actors.shard_save``'s."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
import threading
import time
from collections import deque

import numpy as np
import ray

from core.checkpoint import warm_up
from core.deadlines import Deadline, Deadlines
from core.logs import configure_process_logging
from core.errors import StaleLease
from core.plan import TableSlice
from core.records import PushResult, ShardFacts, ShardInfo, ShardState
from actors.lease import LeaseSpec, shard_place
from actors.shard_chunks import (
    PendingSteps, at_idle_priority, init_weights, load_kernel, merge_chunks, offsets, table_bytes, tables_wanted, writable,
)
from actors.shard_link import LinkServer, exclusive, link_supported
from actors.shard_mirror import MirrorRole
from actors.shard_persist import ShardSaving
from actors.shard_save import ShardCheckpoints
from actors.shm import ShmArray, ShmReader

__all__ = ["EmbeddingShard"]

logger = logging.getLogger(__name__)

APPLIED_WINDOW = 1024  # updates whose microbatch ids a shard keeps in memory (applied_log)


class EmbeddingShard(MirrorRole, ShardSaving):
    """Holds ``slices`` (TableSlice) of the embedding tables, dimension ``dim``.

    A step's embedding update is applied once, at its commit: its gradients must all be here
    (``microbatches_per_step`` microbatches), and the trainers must have committed it, which a
    request for a later step (or a save of it) shows. The update then does not depend on which
    trainer computed which microbatch, a microbatch resent by a redo overwrites its earlier copy
    instead of being applied twice, and a step that failed elsewhere and is redone finds the
    rows it found the first time. A mirror (``actors.shard_mirror``) gets every complete step.

    Its callers wait ``call_timeout_s`` (T); every wait of its own is shorter
    (``core.deadlines``), so a slow mirror or slow storage fails, not this shard.
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
        lease: LeaseSpec | None = None,
        idle_warmup: bool = False,
        ready_rows: list[int] | None = None,
        spare_tables: str = "lazy",
        call_timeout_s: float = 60.0,  # embeddings.call_timeout_s (its default); the fleet passes the run's
    ):
        """``shard_id`` None: a warm spare (``spare`` names it). It imports torch and fbgemm
        (``idle_warmup``: only on CPU time nobody else wants, not to slow a run's first steps)
        and waits, without table memory unless ``spare_tables`` wants tables of ``ready_rows``
        rows per slice ahead (``tables_wanted``), until ``adopt`` makes it a shard."""
        role = spare.rsplit("-", 1)[-1] if spare else f"shard-{shard_id}"
        self._lock = threading.RLock()  # the default group's methods and the link's requests (exclusive)
        self.deadlines = Deadlines(call_timeout_s)
        configure_process_logging(log_dir, role, ray.util.get_node_ip_address())
        warm = at_idle_priority if idle_warmup else lambda fn, *args: fn(*args)
        kernel = warm(load_kernel, threads)
        self._torch, self._tbe_cls, self._optim, self.device, self._location, self._compute = kernel
        self.dim = dim
        self.learning_rate, self.eps = learning_rate, eps
        self.seed = seed
        self.microbatches_per_step = microbatches_per_step
        self._priority_args = {"policy": "full", "r": 1.0, "sample_rate": 1.0, "full_every": 1, **(priority or {})}
        self._audit_dir = audit_dir
        self._lease_spec, self._lease = lease, None
        self.spare = spare
        self.shard_id: int | None = None
        self.generation = generation
        self._released = threading.Event()
        # Arrays of trainers on this node come through shared memory (actors.shm).
        self._shm = ShmReader()
        self._ready_tables: tuple[tuple[int, ...], object] | None = None
        if shard_id is not None:
            self._allocate(shard_id, list(slices or []), init=True)
            self._activate(shard_id, generation)
        else:
            # A spare does now what a recovery would wait for: load's and save's imports, tables.
            warm(warm_up)
            if ready_rows and tables_wanted(spare_tables, ready_rows, dim, self.device):
                self._ready_tables = (tuple(ready_rows), warm(self._new_tables, ready_rows))
        # Trainers on this node call lookup and push_grads over a socket, not Ray.
        self._link = LinkServer(
            {"lookup": self.lookup, "lookup_eval": self.lookup_eval, "push_grads": self.push_grads}, role,
            after_reply=self._after_reply) if link_supported() else None

    def _allocate(self, shard_id: int, slices: list[TableSlice], init: bool) -> None:
        """Allocates the tables of ``slices`` and every per-shard structure. ``init`` False
        (a spare adopted for a recovery, or a mirror) leaves the rows zero: the load that
        follows writes every row from the checkpoint, or ``reset_to_init`` initializes them."""
        self.slices = list(slices)
        rows = tuple(s.num_rows for s in self.slices)
        ready, self._ready_tables = self._ready_tables, None  # a spare's tables, if of this shape
        if ready is not None and ready[0] != rows:
            ready = None  # freed before this shard's own are allocated
        self.tbe = ready[1] if ready is not None else self._new_tables(rows)
        self._initialized = False
        if init:
            self._init_weights(self.seed)
        self._ckpt = ShardCheckpoints(
            self._torch, self.tbe, shard_id, self.slices, self.dim, self._priority_args, self.seed + shard_id, self._lock
        )
        self._audit = None
        self.tracking_s = 0.0
        self.steps_dropped = 0
        self.first_step_after_load: int | None = None
        self._promoted = False  # a mirror that took its primary's place: its rows hold the primary's steps
        # (step, microbatch ids) of the last APPLIED_WINDOW updates; the audit log keeps every one
        self.applied_microbatches: deque[tuple[int, tuple[int, ...]]] = deque(maxlen=APPLIED_WINDOW)
        self._pending = PendingSteps(self.microbatches_per_step)
        self._complete: int | None = None  # a step whose gradients are all here, applied at its commit
        self.applied_step = -1
        self.rows_updated_total = 0
        self.compute_s = 0.0
        if init:
            self._ckpt.prepare_snapshot_buffer()

    def _activate(self, shard_id: int, generation: int) -> None:
        """Serves shard ``shard_id`` as ``generation``: its lease, its audit log."""
        self.shard_id = shard_id
        self.generation = generation
        if self._lease_spec is not None:  # applies only while it holds shard_id's place (actors.lease)
            self._lease = self._lease_spec.lease(shard_place(shard_id, generation)).start()
        if self._audit_dir is not None:
            # Append-only record of every update applied and every load, for the soak's
            # exactly-once checks; written by this process, independent of the supervisor.
            os.makedirs(self._audit_dir, exist_ok=True)
            path = os.path.join(self._audit_dir, f"shard-{shard_id}-g{generation}.jsonl")
            self._audit = open(path, "a", buffering=1)
            self._log({"event": "open", "pid": os.getpid(), "host": socket.gethostname(),
                       "ip": ray.util.get_node_ip_address(),
                       "slices": [[s.table, s.row_start, s.row_end] for s in self.slices]})

    @exclusive
    def adopt(self, shard_id: int, slices: list[TableSlice], generation: int, committed: int | None = None) -> ShardInfo:
        """A warm spare becomes shard ``shard_id`` of ``generation``: its tables are allocated
        now (a spare holds no table memory). A mirror of that shard becomes it with its rows
        (refused if it missed a step: ``committed`` steps are committed). Idempotent for the
        same shard and generation (a restarted supervisor adopts again: that answer has no
        ``adopt_s``); a spare already adopted as another refuses."""
        t0 = time.perf_counter()
        if self._mirror is not None:
            self._promote(shard_id, generation, committed)
            return dataclasses.replace(self.ready(), adopt_s=time.perf_counter() - t0)
        if self.shard_id is not None:
            if (self.shard_id, self.generation) != (shard_id, generation):
                raise RuntimeError(
                    f"{self.spare} is already shard {self.shard_id} generation {self.generation}; "
                    f"cannot become shard {shard_id} generation {generation}"
                )
            return self.ready()
        self._allocate(shard_id, list(slices), init=False)
        self._activate(shard_id, generation)
        logger.warning(
            "%s adopted as shard %d generation %d in %.3fs", self.spare, shard_id, generation, time.perf_counter() - t0
        )
        return dataclasses.replace(self.ready(), adopt_s=time.perf_counter() - t0)

    def _after_reply(self) -> None:  # the tracker counts once the trainer has its answer
        if getattr(self, "_ckpt", None) is not None:
            self._ckpt.wake()

    def _new_tables(self, rows) -> object:
        """fbgemm's kernel with tables of ``rows`` rows (zero, as is their Adagrad state)."""
        return self._tbe_cls(embedding_specs=[(n, self.dim, self._location, self._compute) for n in rows],
                             optimizer=self._optim, learning_rate=self.learning_rate, eps=self.eps, device=self.device)

    def _init_weights(self, seed: int) -> None:
        init_weights(self._torch, self.tbe, self.slices, seed)
        self._initialized = True

    def watch(self) -> None:
        """Never returns while the shard lives: its death fails the supervisor's pending call."""
        self._released.wait()

    def ready(self) -> ShardInfo:
        """Identifies the process (used to kill it in chaos tests) and its size."""
        return ShardInfo(
            shard_id=self.shard_id, spare=self.spare, generation=self.generation, pid=os.getpid(),
            node_id=ray.get_runtime_context().get_node_id(),
            node_ip=ray.util.get_node_ip_address(),
            rows=sum(s.num_rows for s in self.slices) if self.shard_id is not None else 0,
            device=str(self.device),
            link=self._link.address if self._link is not None else None,
            tables_ready_bytes=table_bytes(self._ready_tables[0], self.dim) if self._ready_tables else 0,
            mirror_of=self._mirror.shard_id if self._mirror is not None else None,
            applied_steps=getattr(self, "applied_step", -1) + 1,
        )

    def _forward(self, lengths: np.ndarray, indices: np.ndarray, grad: bool):
        torch = self._torch
        idx = torch.from_numpy(writable(indices)).to(self.device)
        off = torch.from_numpy(offsets(lengths)).to(self.device)
        if grad:
            return self.tbe(idx, off)
        with torch.no_grad():
            return self.tbe(idx, off)

    @exclusive
    def lookup(
        self,
        step: int,
        microbatches: tuple[int, ...],
        lengths: np.ndarray | ShmArray,
        indices: np.ndarray | ShmArray,
        out: ShmArray | None = None,
    ) -> np.ndarray | ShmArray:
        """Pooled embeddings float32 [B, S*D] of a trainer's microbatches of ``step`` (written
        to ``out`` when given: a trainer on this node, see actors.shm). The ids are kept until
        the step's gradients arrive, so the trainer does not send them twice."""
        t0 = time.perf_counter()
        lengths, indices = self._shm.get(lengths), self._shm.get(indices)
        graph = None
        self._commit_before(step)
        if step > self.applied_step:
            # A whole-step chunk keeps the kernel's autograd record: its update needs no second forward.
            whole = len(microbatches) >= self.microbatches_per_step
            pooled = graph = self._forward(lengths, indices, grad=whole)
            self._pending.add(step, microbatches, lengths, indices, graph if whole else None)
            if self._complete == step:
                self._complete = None  # a redo: its chunks are replaced, their gradients come again
            if self._ckpt.tracking:
                t_track = time.perf_counter()
                self._ckpt.observe(lengths, indices)
                self.tracking_s += time.perf_counter() - t_track
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
    def push_grads(self, step: int, microbatches: tuple[int, ...], grad: np.ndarray | ShmArray) -> PushResult:
        """Stores the pooled-embedding gradient of a chunk. ``applied``: the step is complete
        here (and on the mirror), so its update happens once, at its commit."""
        if step <= self.applied_step:
            return PushResult(applied=True, duplicate=True)
        deadline = Deadline(self.deadlines.lock_wait_s)
        chunk = self._pending.chunk(step, microbatches)
        if chunk is None:
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
        self._log({"event": "complete", "step": step,
                   "microbatches": [m for c in self._pending.ordered(step) for m in c.microbatches]})
        return PushResult(applied=True)

    def _commit_before(self, step: float, deadline: Deadline | None = None) -> None:
        """Steps before ``step`` are committed (a trainer asks for ``step``, a save of ``step``
        steps comes): the complete step, if older, applies now. ``deadline``: the call's bound
        on its waits under the lock (``Deadlines.lock_wait_s`` from now by default)."""
        if self._complete is not None and self._complete < step:
            if not self._hold_lease(deadline or Deadline(self.deadlines.lock_wait_s)):
                # Cut off from the cluster: its successor may hold the place and apply this step.
                raise StaleLease(f"shard {self.shard_id}: its place was not confirmed in time; "
                                 f"step {self._complete} is not applied here")
            complete, self._complete = self._complete, None
            record = self._apply(complete)
            self._check_act(f"apply of step {complete}")
            # Recorded only now: an apply that outlasted the lease may have overlapped the
            # successor's, and this process exits with it (the rows it changed go with it).
            self._log(record)

    def _hold_lease(self, deadline: Deadline) -> bool:
        """The lease's confirmation (``Lease.hold``) for an act that follows, waited for at most
        two terms and never past ``deadline``; True without a lease."""
        return self._lease is None or self._lease.hold(timeout_s=deadline.remaining(2 * self._lease.term_s))

    def _check_act(self, act: str) -> None:
        """The act just done under ``_hold_lease`` ended while the lease held; else it may have
        overlapped a successor's, and the process is fenced: it exits (``Lease.check_act``)."""
        if self._lease is not None:
            self._lease.check_act(f"shard {self.shard_id}'s {act}")

    def _apply(self, step: int) -> dict:
        """Applies ``step``; returns its audit record, stamped with the moment the apply ended,
        for the caller to write once the act is known to have ended within the lease."""
        torch = self._torch
        t0 = time.perf_counter()
        ordered = self._pending.ordered(step)
        self.applied_microbatches.append((step, tuple(m for c in ordered for m in c.microbatches)))
        lengths, indices, grad = merge_chunks(ordered)
        pooled = ordered[0].graph if len(ordered) == 1 and ordered[0].graph is not None else None
        if pooled is None:
            pooled = self._forward(lengths, indices, grad=True)
        pooled.backward(torch.from_numpy(writable(grad)).to(self.device))
        self.rows_updated_total += int(indices.size)
        if self.first_step_after_load is None:
            self.first_step_after_load = step
        self.applied_step = step
        record = {"t": round(time.time(), 6), "event": "apply", "step": step,
                  "microbatches": list(self.applied_microbatches[-1][1])}
        # An older step still pending never completed here (its other chunks went to a
        # shard that died, or were redone): its update to this shard is lost, not delayed.
        self.steps_dropped += self._pending.drop_through(step)
        self.compute_s += time.perf_counter() - t0
        return record

    @exclusive
    def facts(self) -> ShardFacts:
        """What this process confirms when a recovery asks (``actors.supervisor.survey``): the
        shard and generation it serves, the steps in its rows and the first it applied since it
        was created or loaded (None for a promoted mirror: its rows hold its primary's steps
        too); a mirror says which shard it mirrors, the steps it holds and whether it is in sync."""
        m, applied = self._mirror, getattr(self, "applied_step", -1) + 1
        return ShardFacts(
            shard_id=self.shard_id, generation=self.generation, pid=os.getpid(), applied_steps=applied,
            first_step=None if getattr(self, "_promoted", False) else getattr(self, "first_step_after_load", None),
            complete_step=getattr(self, "_complete", None), mirror_of=m.shard_id if m is not None else None,
            held_steps=self._last_held() + 1 if m is not None and m.based else applied,
            in_sync=m is not None and m.based and not m.broken,
        )

    @exclusive
    def state(self) -> ShardState:
        """Counters for the report."""
        return ShardState(
            shard_id=self.shard_id, applied_step=self.applied_step, compute_s=self.compute_s,
            rows_updated_total=self.rows_updated_total, steps_dropped=self.steps_dropped,
            first_step_after_load=self.first_step_after_load, tracking_s=self.tracking_s,
            tracking_thread_s=self._ckpt.tracking_thread_s, tracking_bytes=self._ckpt.priority.tracking_bytes,
            shm_reads=self._shm.reads, mirror_steps=self.mirror_steps, mirror_send_s=self.mirror_send_s,
        )

    def _log(self, record: dict) -> None:
        if self._audit is not None:
            self._audit.write(json.dumps({"t": round(time.time(), 6), "gen": self.generation, **record}) + "\n")

    @exclusive
    def applied_log(self) -> list[tuple[int, tuple[int, ...]]]:
        """(step, microbatch ids) of the last ``APPLIED_WINDOW`` updates this process applied,
        in order (a check after a short run; ``audit_log: true`` records every one on disk)."""
        self._commit_before(float("inf"))  # asked for after training
        return list(self.applied_microbatches)

    @exclusive
    def get_rows(self) -> list[tuple[np.ndarray, np.ndarray]]:
        """(weights float32 [rows, D], momentum float32 [rows]) per slice, as copies (after training)."""
        self._commit_before(float("inf"))
        return [(w.detach().cpu().numpy().copy(), st[0].detach().cpu().numpy().copy())
                for w, st in zip(self.tbe.split_embedding_weights(), self.tbe.split_optimizer_states())]
