"""The worker of baseline (b) (``benchmarks/ddp_baseline.py``): one data-parallel replica of the
whole DLRM on the embedding kernels cpr's shards use, with saves of the kind cpr makes.

- Embeddings: one fbgemm ``SplitTableBatchedEmbeddingBagsCodegen`` holding all 26 tables, with
  the fused ``EXACT_ROWWISE_ADAGRAD`` (``EmbeddingLocation.HOST``, ``ComputeDevice.CPU``), the
  same kernel, optimizer, learning rate, eps and initial rows as ``actors/shard.py``.
- The fused kernel applies its update inside backward, so replicas stay identical this way:
  each worker looks up its own rows of the step (no grad), runs the dense model (in
  ``DistributedDataParallel``: its gradients are averaged by DDP), then all-gathers (gloo) the
  ids and the gradients of the pooled embeddings, and every worker runs the kernel's forward
  and backward over the whole gathered step. Each replica applies the same update, and it is
  the one a cpr shard applies when a step's M microbatches are in: one backward over the
  step's ids with the gradient of the step's mean loss (``actors/shard.py``'s ``_apply``,
  ``actors/trainer/step.py``'s ``loss_total / (m * microbatch_rows)``).
- Saves, as cpr's shards do them: at the step boundary rank 0 copies the state into memory
  (the only part the step waits for) and a thread writes it to disk (fsync, atomic rename).
  A save is registered with Ray Train (``ray.train.report`` with a checkpoint naming the file)
  once it is durable: rank 0 tells the others through the step's all-gather, so every rank
  reports at the same step. A restarted group loads the last registered save.

Every worker publishes its pid, attempt and step in ``workdir/status/rank<r>.json`` after each
step and one line per process start in ``workdir/starts.jsonl`` (the driver reads both).
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

__all__ = ["train_loop", "train_step", "read_json", "read_starts", "write_json_atomic"]

_POINTER = "pointer.json"
_KEEP_SAVES = 3


def write_json_atomic(path: Path, obj: dict) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)


def read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def read_starts(workdir: Path) -> list[dict]:
    """One record per worker process start (rank, attempt, pid, times, start and previous step)."""
    path = workdir / "starts.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a line being written
            pass
    return out


def build_tables(cfg):
    """fbgemm's table-batched embedding bags with fused row-wise Adagrad, rows initialized
    exactly as ``actors/shard.py`` initializes a table-wise slice (DLRM's uniform(+-sqrt(1/rows)),
    seeded per table)."""
    import numpy as np
    import torch
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice,
        SplitTableBatchedEmbeddingBagsCodegen,
    )

    rows = cfg.model.rows_per_table
    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        embedding_specs=[(r, cfg.model.embedding_dim, EmbeddingLocation.HOST, ComputeDevice.CPU) for r in rows],
        optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD,
        learning_rate=cfg.embeddings.learning_rate,
        eps=cfg.embeddings.eps,
        device=torch.device("cpu"),
    )
    with torch.no_grad():
        for table, (r, w) in enumerate(zip(rows, tbe.split_embedding_weights())):
            gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + table * 7919 + 0)
            w.copy_(torch.empty(w.shape).uniform_(-float(np.sqrt(1.0 / r)), float(np.sqrt(1.0 / r)), generator=gen))
    return tbe


def lookup(tbe, rows, grad: bool):
    """Pooled embeddings [B, T, D] of ``rows`` int64 [B, T] (one id per bag, sum pooling)."""
    import torch

    b, t = rows.shape
    indices = rows.t().contiguous().view(-1)  # fbgemm's table-major layout
    offsets = torch.arange(b * t + 1, dtype=torch.int64)
    if grad:
        return tbe(indices, offsets).view(b, t, -1)
    with torch.no_grad():
        return tbe(indices, offsets).view(b, t, -1)


class BackgroundSaves:
    """Rank 0's saves: ``snapshot`` copies the state at the step boundary and starts the write on
    a thread; ``durable`` is the newest step whose file is written and synced."""

    def __init__(self, saves_dir: Path, tbe, dense, dense_opt):
        self.dir, self.tbe, self.dense, self.dense_opt = saves_dir, tbe, dense, dense_opt
        self.dir.mkdir(parents=True, exist_ok=True)
        # The snapshot's memory, allocated once (as a cpr shard prepares its snapshot buffer).
        self._weights = [w.detach().clone() for w in tbe.split_embedding_weights()]
        self._momentum = [s[0].detach().clone() for s in tbe.split_optimizer_states()]
        self.durable = -1
        self.snapshot_s: list[float] = []
        self.write_s: list[float] = []
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def snapshot(self, step: int) -> None:
        import copy

        self.wait()  # the previous write first, as a cpr shard waits for its last one
        t0 = time.perf_counter()
        for buf, w in zip(self._weights, self.tbe.split_embedding_weights()):
            buf.copy_(w)
        for buf, st in zip(self._momentum, self.tbe.split_optimizer_states()):
            buf.copy_(st[0])
        state = {
            "step": step,
            "weights": self._weights,
            "momentum": self._momentum,
            "dense": {k: v.detach().clone() for k, v in self.dense.state_dict().items()},
            "dense_opt": copy.deepcopy(self.dense_opt.state_dict()),
        }
        self.snapshot_s.append(time.perf_counter() - t0)
        self._thread = threading.Thread(target=self._write, args=(state,), name=f"save-{step}", daemon=True)
        self._thread.start()

    def _write(self, state: dict) -> None:
        import torch

        t0 = time.perf_counter()
        try:
            final = self.dir / f"step-{state['step']:08d}.pt"
            tmp = final.with_suffix(".tmp")
            with open(tmp, "wb") as f:
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, final)
            for old in sorted(self.dir.glob("step-*.pt"))[:-_KEEP_SAVES]:
                old.unlink(missing_ok=True)
            self.write_s.append(time.perf_counter() - t0)
            self.durable = state["step"]
        except BaseException as err:  # raised on the training thread by wait()
            self._error = err

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            raise self._error

    def path(self, step: int) -> Path:
        return self.dir / f"step-{step:08d}.pt"


def restore(checkpoint, tbe, dense, dense_opt) -> tuple[int, float]:
    """Loads the save a Ray Train checkpoint names; returns (its step, seconds it took)."""
    import torch

    if checkpoint is None:
        return 0, 0.0
    t0 = time.perf_counter()
    with checkpoint.as_directory() as d:
        pointer = json.loads(Path(d, _POINTER).read_text())
    state = torch.load(pointer["path"], weights_only=True)
    with torch.no_grad():
        for w, saved in zip(tbe.split_embedding_weights(), state["weights"]):
            w.copy_(saved)
        for s, saved in zip(tbe.split_optimizer_states(), state["momentum"]):
            s[0].copy_(saved)
    dense.load_state_dict(state["dense"])
    dense_opt.load_state_dict(state["dense_opt"])
    return int(state["step"]), time.perf_counter() - t0


def gather_step(rows, grad, durable: int, world: int, pad_to: int):
    """All-gathers every rank's ids [b, T] and pooled gradients [b, T*D] (padded to ``pad_to``
    rows, the count and rank 0's newest durable save riding in one extra row); returns the
    step's ids and gradients in rank order, and rank 0's durable step."""
    import torch
    import torch.distributed as dist

    b, t = rows.shape
    meta = torch.zeros(1, max(t, 2), dtype=torch.int64)
    meta[0, 0], meta[0, 1] = b, durable
    ids = torch.cat([rows, torch.zeros(pad_to - b, t, dtype=torch.int64)])
    ids = torch.cat([torch.nn.functional.pad(ids, (0, meta.shape[1] - t)), meta])
    g = torch.cat([grad, torch.zeros(pad_to - b, grad.shape[1])])
    all_ids = [torch.empty_like(ids) for _ in range(world)]
    all_g = [torch.empty_like(g) for _ in range(world)]
    dist.all_gather(all_ids, ids)
    dist.all_gather(all_g, g)
    counts = [int(x[-1, 0]) for x in all_ids]
    step_ids = torch.cat([x[:c, :t] for x, c in zip(all_ids, counts)])
    step_grad = torch.cat([x[:c] for x, c in zip(all_g, counts)])
    return step_ids, step_grad, int(all_ids[0][-1, 1])


def evaluate(tbe, dense, eval_path: str, table_rows) -> dict:
    import numpy as np
    import torch

    from core.store import MicrobatchStore
    from core.data import _auc

    eval_file = MicrobatchStore(eval_path)
    preds, ys = [], []
    dense.eval()
    with torch.no_grad():
        for i in range(len(eval_file)):
            y, x, sparse = eval_file.get(i)
            pooled = lookup(tbe, torch.from_numpy(sparse.astype(np.int64)), grad=False)
            preds.append(torch.sigmoid(dense(torch.from_numpy(x), pooled)).numpy())
            ys.append(y)
    p, y = np.concatenate(preds), np.concatenate(ys)
    pc = np.clip(p, 1e-7, 1 - 1e-7)
    return {"auc": float(_auc(p, y)), "log_loss": float(-np.mean(y * np.log(pc) + (1 - y) * np.log(1 - pc))),
            "eval_rows": int(len(y))}


def fingerprint(tbe, dense) -> str:
    """A digest of the replica's state (tables, row-wise Adagrad sums, dense weights)."""
    import hashlib

    h = hashlib.sha256()
    for w in tbe.split_embedding_weights():
        h.update(w.detach().numpy().tobytes())
    for s in tbe.split_optimizer_states():
        h.update(s[0].detach().numpy().tobytes())
    for v in dense.state_dict().values():
        h.update(v.detach().numpy().tobytes())
    return h.hexdigest()[:16]


def _report_durable(ray_train, saves: BackgroundSaves | None, step: int, workdir: Path) -> None:
    """Every rank registers the durable save of ``step`` with Ray Train at the same step; rank 0's
    report carries a checkpoint that names the file."""
    if saves is None:
        ray_train.report({"step": step})
        return
    d = workdir / "tmp" / f"pointer-{step}-{os.getpid()}"
    d.mkdir(parents=True, exist_ok=True)
    (d / _POINTER).write_text(json.dumps({"path": str(saves.path(step)), "step": step}))
    ray_train.report({"step": step}, checkpoint=ray_train.Checkpoint.from_directory(str(d)))


def train_step(tbe, ddp, dense_opt, batch, global_rows: int, pad_to: int, durable: int) -> int:
    """One step on this worker's rows ``batch`` (labels, dense features, ids); returns rank 0's
    newest durable save, which every rank learns from the step's all-gather."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    labels, x, rows = batch
    world = dist.get_world_size()
    pooled = lookup(tbe, rows, grad=False).requires_grad_(True)
    logits = ddp(torch.from_numpy(x), pooled)
    # DDP averages over the workers: world / global_rows makes the dense gradient that of the
    # step's mean loss; the pooled gradients, not averaged, are divided by world below.
    loss = F.binary_cross_entropy_with_logits(logits, torch.from_numpy(labels), reduction="sum")
    (loss * (world / global_rows)).backward()
    step_ids, step_grad, durable = gather_step(rows, pooled.grad.flatten(1) / world, durable, world, pad_to)
    lookup(tbe, step_ids, grad=True).flatten(1).backward(step_grad)  # the fused update, same on every replica
    dense_opt.step()
    ddp.module.zero_grad(set_to_none=True)
    return durable


def train_loop(loop_config: dict) -> None:
    """Ray Train ``train_loop_per_worker``: one replica of the whole DLRM."""
    import numpy as np
    import ray.train
    import torch
    from torch.nn.parallel import DistributedDataParallel

    from core.store import MicrobatchStore
    from core.config import config_from_dict
    from core.data import NUM_DENSE, NUM_SPARSE
    from core.model import DenseAdagrad, DenseModel
    from core.schedule import StepSchedule

    entered = time.time()
    torch.set_num_threads(1)
    cfg = config_from_dict(loop_config["config"])
    tr, workdir = cfg.training, Path(loop_config["workdir"])
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    status_path = workdir / "status" / f"rank{rank}.json"
    attempt = sum(1 for s in read_starts(workdir) if s["rank"] == rank)
    previous = read_json(status_path)

    torch.manual_seed(cfg.seed)  # identical dense model on every worker
    tbe = build_tables(cfg)
    dense = DenseModel(NUM_DENSE, NUM_SPARSE, cfg.model.dense_arch, cfg.model.over_arch)
    dense_opt = DenseAdagrad(dense.parameters(), lr=tr.dense_learning_rate)
    start_step, load_s = restore(ray.train.get_checkpoint(), tbe, dense, dense_opt)
    ddp = DistributedDataParallel(dense)
    saves = BackgroundSaves(workdir / "saves", tbe, dense, dense_opt) if rank == 0 else None
    with open(workdir / "starts.jsonl", "a") as f:
        f.write(json.dumps({"rank": rank, "attempt": attempt, "pid": os.getpid(), "start_step": start_step,
                            "prev_step": previous["step"] if previous else None, "entered": entered,
                            "load_s": load_s, "time": time.time()}) + "\n")

    train_file = MicrobatchStore(loop_config["train_cache"])
    m, table_rows = tr.microbatches_per_step, cfg.model.rows_per_table
    schedule = StepSchedule.from_config(len(train_file), m, tr.epochs, tr.max_steps, cfg.seed)
    global_rows = m * tr.microbatch_rows
    bounds = [r * global_rows // world for r in range(world + 1)]
    lo, hi = bounds[rank], bounds[rank + 1]
    pad_to = max(bounds[r + 1] - bounds[r] for r in range(world))
    every, reported = loop_config["checkpoint_every"], start_step

    def publish(step: int) -> None:
        write_json_atomic(status_path, {"pid": os.getpid(), "attempt": attempt, "step": step,
                                        "start_step": start_step, "time": time.time()})

    publish(start_step)
    for step in range(start_step, schedule.total_steps):
        parts = [train_file.get(schedule.microbatch(step, k)) for k in range(m)]
        labels, x, sparse = (np.concatenate([p[j] for p in parts])[lo:hi] for j in range(3))
        rows = torch.from_numpy(sparse.astype(np.int64))
        durable = train_step(tbe, ddp, dense_opt, (labels, x, rows), global_rows, pad_to,
                             saves.durable if saves is not None else -1)
        done = step + 1
        if durable > reported:
            _report_durable(ray.train, saves, durable, workdir)
            reported = durable
        if every and done % every == 0 and done < schedule.total_steps and saves is not None:
            saves.snapshot(done)
        publish(done)

    train_end = time.time()
    if saves is not None:
        saves.wait()
    final = {"rank": rank, "attempt": attempt, "train_end": train_end, "steps": schedule.total_steps,
             "fingerprint": fingerprint(tbe, dense)}
    if saves is not None:
        final.update(snapshot_s=saves.snapshot_s, write_s=saves.write_s)
    if rank == 0:
        final.update(evaluate(tbe, dense, loop_config["eval_cache"], table_rows), eval_s=time.time() - train_end)
    write_json_atomic(workdir / f"final{rank}.json", final)
