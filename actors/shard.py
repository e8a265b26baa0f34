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
from core.deadlines import Deadlines
from core.logs import configure_process_logging
from core.plan import TableSlice
from core.records import ShardFacts, ShardInfo, ShardState
from actors.lease import LeaseSpec, shard_place
from actors.shard_chunks import (
    PendingSteps, at_idle_priority, init_weights, load_kernel, offsets, table_bytes, tables_wanted, writable,
)
from actors.shard_link import LinkServer, exclusive, link_supported
from actors.shard_mirror import MirrorRole
from actors.shard_step import ShardSteps
from actors.shard_persist import ShardSaving
from actors.shard_save import ShardCheckpoints
from actors.shm import ShmReader

__all__ = ["EmbeddingShard"]

logger = logging.getLogger(__name__)

APPLIED_WINDOW = 1024  # updates whose microbatch ids a shard keeps in memory (applied_log)


class EmbeddingShard(ShardSteps, MirrorRole, ShardSaving):
    """Holds ``slices`` (TableSlice) of the embedding tables, dimension ``dim``.

    A step's embedding update is applied once, at its commit (``actors.shard_step``: its
    gradients all here, and a request naming its try committed). A mirror
    (``actors.shard_mirror``) gets every complete step.

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
        # Trainers on this node call lookup and push_grads over a socket, not Ray; a primary on
        # this node feeds its mirror (this process, if it becomes one) the same way.
        self._link = LinkServer(
            {"lookup": self.lookup, "lookup_eval": self.lookup_eval, "push_grads": self.push_grads,
             "replicate": self.replicate}, role,
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
        self.commits_refused = 0  # requests refused for naming no commit of the step complete here
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
        self._open_audit(f"shard-{shard_id}-g{generation}.jsonl")

    def _open_audit(self, name: str, **fields) -> str | None:
        """Append-only record of every update applied and every load, for the soak's
        exactly-once checks; written by this process, independent of the supervisor. Opens
        ``name`` in the audit dir (closing the log it wrote before: a mirror's, at its
        promotion) and writes its "open" line; returns its name (None: no audit log)."""
        if self._audit_dir is None:
            return None
        if self._audit is not None:
            self._audit.close()
        os.makedirs(self._audit_dir, exist_ok=True)
        self._audit = open(os.path.join(self._audit_dir, name), "a", buffering=1)
        self._log({"event": "open", "pid": os.getpid(), "host": socket.gethostname(),
                   "ip": ray.util.get_node_ip_address(), "device": str(self.device), **fields,
                   "slices": [[s.table, s.row_start, s.row_end] for s in self.slices]})
        return name

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
        """A line of the audit log: a shard's names its generation, a mirror's the shard it mirrors."""
        if self._audit is not None:
            m = self._mirror
            whose = {"gen": self.generation} if m is None else {"mirror_of": m.shard_id}
            self._audit.write(json.dumps({"t": round(time.time(), 6), **whose, **record}) + "\n")

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
