"""The trainer loop, run by every Ray Train worker (one torchft replica group each).

A step ``s`` is M microbatches with stable ids; the live trainers split them round-robin
over the torchft quorum, look up pooled embeddings on the shards, run the dense model,
push embedding gradients back to the shards and all-reduce the dense gradients.
"""

from __future__ import annotations

import copy
import io
import json
import logging
import math
import os
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from urllib.parse import urlsplit

import numpy as np

from core.schedule import StepSchedule

__all__ = ["train_loop", "ShardCallFailed", "StaleStep", "GroupBroken", "sum_over_trainers"]


class _PhaseTimer:
    """Wall time per phase of a step, summed between progress reports."""

    PHASES = ("quorum", "data", "lookup", "dense", "push", "allreduce", "commit", "checkpoint")

    def __init__(self):
        self.totals = dict.fromkeys(self.PHASES, 0.0)
        self._t = time.perf_counter()

    def start(self) -> None:
        self._t = time.perf_counter()

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.totals[phase] += now - self._t
        self._t = now

    def take(self) -> dict[str, float]:
        out = {k: round(v, 4) for k, v in self.totals.items()}
        self.totals = dict.fromkeys(self.PHASES, 0.0)
        return out


class ShardCallFailed(Exception):
    """A call to embedding shard ``shard`` failed: the actor died, or did not answer in time."""

    def __init__(self, shard: int, reason: str):
        super().__init__(shard, reason)
        self.shard = shard
        self.reason = reason

    def __str__(self) -> str:
        return f"shard {self.shard}: {self.reason}"


class GroupBroken(Exception):
    """Another trainer's all-reduce of this step failed in the same quorum: a trainer of it
    died. This trainer stopped waiting for its own all-reduce, which cannot complete."""


# How often a trainer still waiting for its all-reduce asks whether the group broke.
_GROUP_CHECK_S = 0.1


def sum_over_trainers(pg, flat, group_broken) -> Exception | None:
    """Sums ``flat`` in place over the quorum's trainers. Returns None, or why the sum failed.

    A trainer killed in the middle of a gloo ring all-reduce makes its neighbours' calls fail
    at once, but a survivor that was waiting for data from one of those neighbours (not from
    the dead one) waits out the whole collective timeout: gloo cannot cancel a pending
    receive (``abort``, ``shutdown`` and dropping the group leave it blocked; measured), and
    the failed neighbour never sends. Meanwhile it heartbeats, so the lighthouse holds the
    next quorum for it. So the wait here is in slices: while the sum is pending,
    ``group_broken()`` is asked every ``_GROUP_CHECK_S`` (a failed all-reduce elsewhere in
    the same quorum and step); if so the trainer walks away. The abandoned receive ends in
    gloo's worker thread at its timeout; nothing reads its result, and the next quorum
    builds a new group. A sum done within ``_GROUP_CHECK_S`` asks nothing; a slower one (a
    peer still computing) costs one small supervisor call per slice.
    """
    from torch.distributed import AllreduceOptions, ReduceOp

    opts = AllreduceOptions()
    opts.reduceOp = ReduceOp.SUM
    try:
        fut = pg.allreduce([flat], opts).get_future()
    except Exception as err:  # the group is already known broken (a peer died before the call)
        return err
    finished = threading.Event()
    fut.add_done_callback(lambda _: finished.set())
    while not finished.wait(_GROUP_CHECK_S):
        if group_broken():
            return GroupBroken("another trainer's all-reduce of this step failed; stopped waiting for this one")
    try:
        fut.value()
    except Exception as err:
        return err
    return None


class StaleStep(Exception):
    """A shard dropped this attempt's gradients: a newer attempt of the step replaced them.
    The step fails and is redone; no shard is at fault."""


class _ShardClient:
    """Routes ids to the shards and gathers their pooled outputs, with timeouts.

    With ``shared_memory``, the arrays for a shard on this trainer's node go through a
    shared-memory slab (actors.shm) and the Ray call carries only where they lie; a shard
    on another node (or without /dev/shm) gets them in the call, as Ray objects.
    """

    def __init__(self, shards, plan, dim: int, timeout_s: float, run_id: str = "", node_id: str | None = None,
                 shared_memory: bool = False):
        from actors.shm import shm_available

        self.plan = plan
        self.dim = dim
        self.timeout_s = timeout_s
        self.run_id = run_id
        self.node_id = node_id
        self.shared_memory = shared_memory and node_id is not None and shm_available()
        self._slabs: dict = {}
        self._shards = list(shards)
        self._pooled: np.ndarray | None = None

    @property
    def shards(self) -> list:
        return self._shards

    @shards.setter
    def shards(self, handles) -> None:
        """New shard handles (a recovery): their slabs start afresh."""
        self.close()
        self._shards = list(handles)

    def close(self) -> None:
        for slab in self._slabs.values():
            if slab is not None:
                slab.close()
        self._slabs = {}

    def _slab(self, k: int):
        """Shard ``k``'s slab, or None when its arrays travel in the call."""
        if not self.shared_memory:
            return None
        if k not in self._slabs:
            from actors.shm import ShmSlab

            info = self._gather([self._shards[k].ready.remote()], first=k)[0]
            self._slabs[k] = ShmSlab(self.run_id, f"s{k}") if info["node_id"] == self.node_id else None
        return self._slabs[k]

    def _gather(self, refs: list, first: int = 0) -> list:
        """Results of one call per shard (shard ``first + i`` for ref i); raises
        ShardCallFailed naming the first bad shard, and drops its slab (a call that did not
        answer may still write there)."""
        import ray

        _, not_ready = ray.wait(refs, num_returns=len(refs), timeout=self.timeout_s)
        out = []
        for i, ref in enumerate(refs):
            k = first + i
            try:
                if ref in not_ready:
                    raise ShardCallFailed(k, f"no answer within {self.timeout_s}s")
                try:
                    out.append(ray.get(ref))
                except (ray.exceptions.RayActorError, ray.exceptions.ObjectLostError) as err:
                    # ObjectLostError: the answer lay in the object store of a host that is gone.
                    raise ShardCallFailed(k, type(err).__name__) from None
            except ShardCallFailed:
                slab = self._slabs.pop(k, None)
                if slab is not None:
                    slab.close()
                raise
        return out

    def lookup(self, rows: np.ndarray, step: int | None = None, chunk: tuple[int, ...] = (), routed=None) -> np.ndarray:
        """Pooled embeddings float32 [B, F, D] of ``rows`` (int64 [B, F]); ``routed``: the
        rows already split per shard (ShardingPlan.route), when a prefetch did it."""
        batch = rows.shape[0]
        refs = []
        for k, shard in enumerate(self._shards):
            sb = routed[k] if routed is not None else self.plan.route(rows, k)
            slab = self._slab(k)
            out = None
            args = (sb.lengths, sb.indices)
            if slab is not None:
                width = sb.lengths.shape[0] * self.dim
                d_len, d_idx, out = slab.layout(
                    [(sb.lengths.shape, np.int64), (sb.indices.shape, np.int64), ((batch, width), np.float32)]
                )
                slab.view(d_len)[...] = sb.lengths
                slab.view(d_idx)[...] = sb.indices
                args = (d_len, d_idx)
            if step is None:
                refs.append(shard.lookup_eval.remote(*args, out=out))
            else:
                refs.append(shard.lookup.remote(step, chunk, *args, out=out))
        parts = [p if isinstance(p, np.ndarray) else self._slabs[k].view(p) for k, p in enumerate(self._gather(refs))]
        if step is None:
            return self.plan.assemble_pooled(parts)
        # A training step's pooled rows go into the same buffer every step (no fresh pages to
        # fault in): the previous step's tensor over it is no longer used once its
        # gradients were pushed.
        shape = (batch, rows.shape[1], self.dim)
        if self._pooled is None or self._pooled.shape != shape:
            self._pooled = np.empty(shape, dtype=np.float32)
        return self.plan.assemble_pooled(parts, out=self._pooled)

    def push_grads(self, step: int, chunk: tuple[int, ...], grad: np.ndarray) -> list[dict]:
        refs = []
        for k, shard in enumerate(self._shards):
            slab = self._slab(k)
            if slab is None:
                refs.append(shard.push_grads.remote(step, chunk, self.plan.gather_grad(grad, k)))
                continue
            (d_grad,) = slab.layout([((grad.shape[0], len(self.plan.shards[k]) * self.dim), np.float32)])
            self.plan.gather_grad(grad, k, out=slab.view(d_grad))
            refs.append(shard.push_grads.remote(step, chunk, d_grad))
        results = self._gather(refs)
        if any(r.get("stale") for r in results):
            raise StaleStep(f"step {step} microbatches {chunk}: replaced by a newer attempt")
        return results


class _Prefetcher:
    """Reads and routes the microbatches of the step expected next on a background thread,
    while this step computes. ``get`` returns them if the guess (step and microbatches) was
    right, and loads them on the spot otherwise (a failed step, a new quorum)."""

    def __init__(self, load):
        from concurrent.futures import ThreadPoolExecutor

        self._load = load
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="cpr-prefetch")
        self._key = None
        self._future = None

    def ahead(self, step: int, mine: list[int]) -> None:
        if mine:
            self._key, self._future = (step, tuple(mine)), self._pool.submit(self._load, step, mine)

    def get(self, step: int, mine: list[int]):
        key, future = self._key, self._future
        self._key = self._future = None
        if key == (step, tuple(mine)):
            return future.result()
        if future is not None and not future.cancel():
            future.exception()  # a wrong guess still loading: one reader of the file at a time
        return self._load(step, mine)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


EVAL_ROWS_PER_LOOKUP = 8192


def _evaluate(model, client: _ShardClient, eval_file, table_rows) -> dict:
    import torch
    from torchmetrics.functional.classification import binary_auroc

    from core.data import sparse_to_rows

    preds, labels = [], []
    model.eval()
    with torch.no_grad():
        # Several microbatches per lookup: one round trip per shard for every ~8k rows.
        n = len(eval_file)
        per_lookup = max(1, EVAL_ROWS_PER_LOOKUP // len(eval_file.get(0)[0])) if n else 1
        for first in range(0, n, per_lookup):
            parts = [eval_file.get(i) for i in range(first, min(first + per_lookup, n))]
            y, dense, sparse = (np.concatenate([p[j] for p in parts]) for j in range(3))
            pooled = client.lookup(sparse_to_rows(sparse, table_rows))
            logits = model(torch.from_numpy(dense), torch.from_numpy(pooled))
            preds.append(torch.sigmoid(logits))
            labels.append(torch.from_numpy(y))
    model.train()
    p = torch.cat(preds)
    y = torch.cat(labels)
    log_loss = torch.nn.functional.binary_cross_entropy(p.clamp(1e-7, 1 - 1e-7), y).item()
    return {
        "auc": float(binary_auroc(p, y.to(torch.int64))),
        "log_loss": log_loss,
        "eval_rows": int(y.numel()),
        "positive_rate": float(y.mean()),
    }


def use_node_interface() -> str | None:
    """gloo connects to peers over the interface that holds this node's Ray IP: the hostname
    can resolve to 127.0.0.1 (it does inside the test cluster's hosts), which no peer on
    another host can reach. An interface set by the user (GLOO_SOCKET_IFNAME) wins; the
    embedded Ray sets ``lo``. Returns the interface used."""
    import ray

    from actors.nodes import interface_for

    if not os.environ.get("GLOO_SOCKET_IFNAME"):
        ip = ray.util.get_node_ip_address()
        name = interface_for(ip)
        if name is None:
            logging.getLogger(__name__).warning("no interface holds this node's IP %s; gloo picks one from the hostname", ip)
        else:
            os.environ["GLOO_SOCKET_IFNAME"] = name
    return os.environ.get("GLOO_SOCKET_IFNAME")


def _idle_cores(supervisor, node_id: str, wait_s: float) -> int:
    """torch threads for this trainer: the cores it may use (its CPU affinity) divided among
    the trainers registered on its node. The shards on the node are idle while trainers run
    the dense model, so their cores count too."""
    import ray

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    trainers = ray.get(supervisor.trainers_on_node.remote(node_id), timeout=wait_s)
    return max(1, cores // max(1, trainers))


def _process_start() -> float | None:
    """Wall time this process started (Ray Train's worker), from the OS."""
    try:
        import psutil

        return psutil.Process().create_time()
    except Exception:  # noqa: BLE001 - a missing timing mark only blanks a report line
        return None


def train_loop(loop_config: dict) -> None:
    """Ray Train ``train_loop_per_worker``: trains until the schedule's last step, then
    (on the first participant) evaluates on the held-out split and reports to the supervisor.
    """
    entered = time.time()
    import ray
    import ray.train

    from core.logs import configure_process_logging

    rank = ray.train.get_context().get_world_rank()
    # First, so that library imports' lines land there too. torchft's quorum and commit
    # lines (a few a step) go to the run's log files, and to the console only with
    # `cpr train -v` (the driver's log_to_driver).
    configure_process_logging(loop_config.get("log_dir"), f"trainer-{rank}", ray.util.get_node_ip_address())
    import torch
    from torchft import Manager
    from torchft.checkpointing.pg_transport import PGTransport

    from core.deadlines import Deadlines
    from actors.gloo import ReconfigurableGloo
    from core.cache import MicrobatchFile
    from core.config import config_from_dict
    from core.data import NUM_DENSE, NUM_SPARSE, sparse_to_rows
    from core.errors import ConfigError, TrainerConflict
    from core.model import DenseAdagrad, DenseModel
    from core.storage import problems

    marks = {"process": _process_start(), "train_fn": entered, "imports": time.time()}
    cfg = config_from_dict(loop_config["config"])
    tr = cfg.training
    supervisor = ray.get_actor(loop_config["supervisor"], namespace=cfg.ray.namespace)
    # Waits on the supervisor are longer than the longest wait inside it (core.deadlines).
    wait_s = Deadlines(cfg.embeddings.call_timeout_s).trainer_wait_s
    setup = ray.get(supervisor.trainer_setup.remote(), timeout=wait_s)
    marks["setup"] = time.time()
    if setup["finished"]:
        # Ray Train replaced a trainer that died after the run was over: nothing to do.
        return
    schedule: StepSchedule = setup["schedule"]
    table_rows = cfg.model.rows_per_table
    client = _ShardClient(
        setup["shards"], setup["plan"], cfg.model.embedding_dim, cfg.embeddings.call_timeout_s,
        run_id=loop_config.get("run_id", ""), node_id=ray.get_runtime_context().get_node_id(),
        shared_memory=cfg.embeddings.transport == "auto",
    )
    # A host that does not share the driver's cache would train on another file, or none.
    missing = problems({setup["train_cache"]: {"field": "data.cache_dir", "size": setup["train_cache_bytes"], "content": None}})
    if missing:
        raise ConfigError(f"trainer {rank} on host {ray.util.get_node_ip_address()}: {missing[0]} "
                          "(every host must see the cache at the driver's path)")
    train_file = MicrobatchFile(setup["train_cache"])
    marks["client"] = time.time()

    torch.manual_seed(cfg.seed)  # identical dense init on every trainer
    model = DenseModel(NUM_DENSE, NUM_SPARSE, cfg.model.dense_arch, cfg.model.over_arch)
    optimizer = DenseAdagrad(model.parameters(), lr=tr.dense_learning_rate)
    params = [p for p in model.parameters()]
    for p in params:
        # A trainer with no microbatches in a step still joins the all-reduce with zeros.
        p.grad = torch.zeros_like(p)

    def state_dict():
        return {"model": model.state_dict(), "optim": optimizer.state_dict()}

    # Step 0's dense state: what a full recovery rolls back to before the first checkpoint.
    initial_state = copy.deepcopy(state_dict())
    marks["model"] = time.time()

    def load_state_dict(sd):
        model.load_state_dict(sd["model"])
        optimizer.load_state_dict(sd["optim"])

    # The lighthouse reports its address under the machine's hostname even when bound to
    # one interface; reach it on the interface it was bound to.
    use_node_interface()
    lighthouse = urlsplit(os.environ["TORCHFT_LIGHTHOUSE"])
    lighthouse_addr = f"{lighthouse.scheme}://{loop_config['lighthouse_host']}:{lighthouse.port}"
    collective_timeout = timedelta(seconds=tr.collective_timeout_s)
    pg = ReconfigurableGloo(collective_timeout, timedelta(seconds=tr.connect_timeout_s))
    manager = Manager(
        pg=pg,
        min_replica_size=1,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        replica_id=f"cpr_trainer_{rank}",
        lighthouse_addr=lighthouse_addr,
        hostname=ray.util.get_node_ip_address(),
        timeout=collective_timeout,
        quorum_timeout=collective_timeout,
        checkpoint_transport=PGTransport(pg, timeout=collective_timeout, device=torch.device("cpu")),
        world_size=1,
        rank=0,
        # Synchronous quorum: a replacement finishes healing inside the quorum and then takes
        # its share of the step with the healed state. With the async quorum it would count
        # as a participant while healing, compute its microbatches on a stale model, and have
        # its dense gradient zeroed, so the step would miss microbatches.
        use_async_quorum=False,
    )

    # Start together: a quorum formed before the last trainer has its Manager would leave
    # it healing instead of training. A replacement for a dead trainer does not wait.
    deadline = time.monotonic() + tr.collective_timeout_s
    me = (rank, os.getpid(), ray.get_runtime_context().get_node_id())
    marks["manager"] = time.time()
    while not ray.get(supervisor.register_trainer.remote(*me, marks), timeout=wait_s):
        if time.monotonic() > deadline:
            break
        time.sleep(0.05)

    torch.set_num_threads(tr.threads_per_worker or _idle_cores(supervisor, me[2], wait_s))

    # A resumed run, or a trainer Ray Train started to replace a dead one: begin at the
    # last checkpoint. A live peer further ahead heals this trainer in its first quorum.
    resume = setup["resume"]
    if resume is not None:
        if resume["dense"] is not None:
            load_state_dict(torch.load(io.BytesIO(resume["dense"]), weights_only=True))
        manager.load_state_dict({"step": resume["step"], "batches_committed": resume["step"] * tr.microbatches_per_step})
    replacement = setup["training_started"]
    started_s = time.perf_counter()
    first_quorum = True
    next_checkpoint = setup["next_checkpoint_step"]
    generation = setup["generation"]
    last_participant = None

    def load_step(step: int, mine: list[int]):
        parts = [train_file.get(schedule.microbatch(step, m)) for m in mine]
        rows = sparse_to_rows(np.concatenate([p[2] for p in parts]), table_rows)
        routed = [client.plan.route(rows, k) for k in range(client.plan.num_shards)]
        return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]), rows, routed

    prefetch = _Prefetcher(load_step)
    samples_per_step = tr.microbatches_per_step * tr.microbatch_rows
    audit = None
    if setup["audit_dir"] is not None:
        os.makedirs(setup["audit_dir"], exist_ok=True)
        audit = open(os.path.join(setup["audit_dir"], f"trainer-{rank}-{os.getpid()}.jsonl"), "a", buffering=1)
    status_ref = None
    stopped = False
    loss_sum = 0.0
    loss_rows = 0
    t_last = time.perf_counter()
    steps_since = 0
    phases = _PhaseTimer()
    conflicts = 0

    def roll_back(rollback: dict) -> None:
        """A full recovery's rollback: the checkpoint's dense state (step 0's without one) and step."""
        if rollback["dense"] is not None:
            load_state_dict(torch.load(io.BytesIO(rollback["dense"]), weights_only=True))
        else:
            model.load_state_dict(initial_state["model"])
            optimizer.load_state_dict(initial_state["optim"])
        manager.load_state_dict({"step": rollback["step"], "batches_committed": rollback["step"] * tr.microbatches_per_step})

    while True:
        if manager.current_step() >= schedule.total_steps:
            # The last step committed, but a shard may have died before its final state was
            # saved, and before anyone acted on its death: the run would end with a shard
            # rolled back under a finished dense model. await_final waits for the final save
            # and probes the shards; after a recovery it hands the new ones. The trainers
            # agree (a summed flag) so that all of them redo the steps after a full
            # recovery's rollback; a partial recovery's shard is part of the final model (its
            # lost updates counted as PLS).
            done = manager.current_step()
            info = ray.get(supervisor.await_final.remote(generation, done), timeout=wait_s)
            changed_here = float(info["stop"] or info["generation"] != generation)
            seen = torch.tensor([changed_here])
            if manager.errored() is None and manager.num_participants() > 1:
                quorum_id = manager._quorum_id
                if sum_over_trainers(pg, seen, lambda: ray.get(supervisor.group_broken.remote(quorum_id, done), timeout=wait_s)):
                    seen.fill_(changed_here)  # a peer died meanwhile: go by this trainer's own answer
            if seen.item() > 0 and not info["stop"] and info["generation"] == generation:
                info = ray.get(supervisor.await_shards.remote(generation, done), timeout=wait_s)  # a peer saw it first
            if info["stop"]:
                stopped = True
                break
            if info["generation"] == generation:
                break
            generation, client.shards = info["generation"], info["shards"]
            if info["rollback"] is None:
                break
            roll_back(info["rollback"])
            continue
        # The supervisor's status, polled without blocking: a stop (interrupt, budget) ends
        # the loop at a step boundary; a rollback may have moved the save schedule.
        if status_ref is None:
            status_ref = supervisor.status.remote()
        elif ray.wait([status_ref], timeout=0)[0]:
            status = ray.get(status_ref)
            status_ref = None
            if status["stop"]:
                stopped = True
                break
            next_checkpoint = status["next_checkpoint"]
        phases.start()
        manager.start_quorum()
        manager.wait_quorum()
        phases.lap("quorum")
        step = manager.current_step()
        optimizer.zero_grad(set_to_none=False)
        step_error = None
        committed = False
        participant = manager.participating_rank()
        # Only a quorum that formed decides anything: one whose group failed to connect (a
        # peer died meanwhile) left this trainer at its start step without healing it.
        healthy = manager.errored() is None
        if first_quorum and healthy:
            first_quorum = False
            if replacement and resume is not None and step == resume["step"]:
                # Nobody was ahead to heal from: every trainer died (shards go back to the
                # same checkpoint as the dense state; the supervisor does it once), or the
                # live ones are at this very step (nothing to roll back).
                try:
                    fleet = ray.get(supervisor.fallback_to_checkpoint.remote(step, rank), timeout=wait_s)
                    generation, client.shards = fleet["generation"], fleet["shards"]
                except TrainerConflict as err:
                    # A quorum of replacements only, while a live trainer is ahead: this step
                    # fails everywhere and a later quorum with that trainer heals this one.
                    # Back off first: the live trainer may still be leaving a broken group, and
                    # a tight loop of failed quorums would spend the step's redo budget (and
                    # the CPU it needs) before it comes.
                    first_quorum, step_error = True, err
                    conflicts += 1
                    time.sleep(min(4.0, 0.25 * 2**conflicts))
        if replacement and participant is not None and healthy and step_error is None:
            supervisor.record_trainer_healed.remote(rank, step, time.perf_counter() - started_s, time.time())
            replacement = False
        if last_participant is None and participant == 0:
            supervisor.record_training_started.remote(step, manager.num_participants(), time.time())
        mine = (
            schedule.assignment(step, participant, manager.num_participants())
            if participant is not None and manager.is_participating() and step_error is None
            else []
        )
        if mine:
            labels, dense, rows, routed = prefetch.get(step, mine)
            chunk = tuple(step * tr.microbatches_per_step + m for m in mine)
            phases.lap("data")
            try:
                pooled = torch.from_numpy(client.lookup(rows, step, chunk, routed)).requires_grad_(True)
                phases.lap("lookup")
                if step + 1 < schedule.total_steps:
                    # The next step's data while this one computes (same quorum expected).
                    prefetch.ahead(step + 1, schedule.assignment(step + 1, participant, manager.num_participants()))
                logits = model(torch.from_numpy(dense), pooled)
                # Scaled so that the SUM all-reduce gives the gradient of the step's mean loss
                # over all M microbatches, whoever computed them.
                loss_total = torch.nn.functional.binary_cross_entropy_with_logits(
                    logits, torch.from_numpy(labels), reduction="sum"
                )
                (loss_total / samples_per_step).backward()
                phases.lap("dense")
                client.push_grads(step, chunk, pooled.grad.numpy())
                phases.lap("push")
                loss_sum += loss_total.item()
                loss_rows += len(labels)
            except ShardCallFailed as err:
                supervisor.report_shard_failure.remote(err.shard, generation, err.reason, step)
                step_error = err
            except StaleStep as err:
                step_error = err
        phases.start()
        # Two extra elements ride on the gradient all-reduce: a "this step failed here" flag
        # and this trainer's microbatch count. torchft's commit vote spans one replica group
        # (one trainer here); the summed flag makes the decision unanimous, and the summed
        # count is the step's microbatch total as every trainer sees it.
        extra = torch.tensor([float(step_error is not None), float(len(mine))])
        flat = torch.cat([p.grad.reshape(-1) for p in params] + [extra])
        # The group's collective is called directly, not through manager.allreduce: a wait
        # this trainer walks away from must not report its late error into a later step.
        broken_quorum = None
        if manager.errored() is None:
            if not manager.is_participating():
                flat.zero_()
            quorum_id = manager._quorum_id  # torchft 0.2 keeps the quorum id only privately
            failure = sum_over_trainers(
                pg, flat, lambda: ray.get(supervisor.group_broken.remote(quorum_id, step), timeout=wait_s)
            )
            if failure is not None:
                manager.report_error(failure)
                broken_quorum = quorum_id
        phases.lap("allreduce")
        step_microbatches = int(round(flat[-1].item()))
        if step_error is not None:
            manager.report_error(step_error)
        elif manager.errored() is None and flat[-2].item() > 0:
            step_error = ShardCallFailed(-1, "a peer trainer's step failed")
            manager.report_error(step_error)
        if manager.should_commit():
            offset = 0
            for p in params:
                n = p.numel()
                p.grad.copy_(flat[offset : offset + n].view_as(p))
                offset += n
            optimizer.step()
            steps_since += 1
            committed = True
            supervisor.record_commit.remote(
                step, rank, chunk if mine else (), step_microbatches, manager.num_participants(), time.time(), generation
            )
            if audit is not None:
                audit.write(json.dumps({"t": round(time.time(), 6), "event": "commit", "step": step, "rank": rank,
                                        "quorum": manager._quorum_id, "microbatches": list(chunk) if mine else [],
                                        "total": step_microbatches}) + "\n")
        else:
            supervisor.record_step_failed.remote(
                step, rank, time.time(), str(step_error or manager.errored()), broken_quorum
            )
            # A failed step: pick up respawned shards (and, after a full recovery, the
            # checkpoint's dense state and step) before redoing it.
            info = ray.get(supervisor.await_shards.remote(generation, step), timeout=wait_s)
            if info["stop"]:
                stopped = True
                break
            next_checkpoint = info["next_checkpoint"]
            if info["generation"] != generation:
                generation = info["generation"]
                client.shards = info["shards"]
                if info["rollback"] is not None:
                    roll_back(info["rollback"])
        phases.lap("commit")
        done = manager.current_step()
        if participant == 0 and last_participant != 0 and next_checkpoint is not None:
            # Just became the saving trainer (e.g. the previous one died): ask what is due.
            next_checkpoint = ray.get(supervisor.checkpoint_due.remote(), timeout=wait_s)
        last_participant = participant
        due = next_checkpoint is not None and next_checkpoint <= done < schedule.total_steps
        # The run's last state is saved in full whatever the policy: what `cpr export` and
        # `cpr train --resume` of a finished run read.
        final = committed and done == schedule.total_steps and cfg.checkpoint.final
        if participant == 0 and (due or final):
            phases.start()
            buf = io.BytesIO()
            torch.save(state_dict(), buf)
            saved = ray.get(supervisor.save_checkpoint.remote(done, buf.getvalue(), final), timeout=wait_s)
            if due:
                next_checkpoint = saved["next_step"]
            phases.lap("checkpoint")
        if committed and participant == 0 and (done % tr.progress_every_steps == 0 or done == schedule.total_steps):
            now = time.perf_counter()
            supervisor.record_progress.remote(
                {
                    "step": done,
                    "total_steps": schedule.total_steps,
                    "loss": loss_sum / max(loss_rows, 1),
                    "samples_per_s": steps_since * samples_per_step / max(now - t_last, 1e-9),
                    "trainers": manager.num_participants(),
                    "phase_s": phases.take(),
                }
            )
            loss_sum, loss_rows, steps_since, t_last = 0.0, 0, 0, now

    if rank == 0 and not stopped:
        supervisor.record_event.remote("training_finished", step=manager.current_step(), wall_time=time.time())
        t0 = time.perf_counter()
        for attempt in range(3):
            try:
                metrics = _evaluate(model, client, MicrobatchFile(setup["eval_cache"]), table_rows)
                break
            except ShardCallFailed as err:
                # A shard died during evaluation: it is recovered like any other; evaluate again.
                supervisor.report_shard_failure.remote(err.shard, generation, err.reason, manager.current_step())
                info = ray.get(supervisor.await_shards.remote(generation, manager.current_step()), timeout=wait_s)
                generation, client.shards = info["generation"], info["shards"]
                if attempt == 2:
                    raise
        metrics["eval_s"] = time.perf_counter() - t0
        metrics["steps"] = manager.current_step()
        ray.get(supervisor.record_eval.remote(metrics), timeout=wait_s)
    if audit is not None:
        audit.close()
    client.close()
    prefetch.close()
    manager.shutdown()
