"""Baseline (b) for trainer failures: plain DDP with Ray Train's checkpoint-and-restart.

This is the classic way to make data-parallel DLRM training survive a dead worker, and the
mechanism ReCoVer (and cpr's method (a)) is compared against:

- every Ray Train worker holds the whole model, the 26 embedding tables as well as the
  dense arches, wrapped in ``torch.nn.parallel.DistributedDataParallel`` (gloo, CPU); no
  embedding shards, no torchft;
- rank 0 saves the model and optimizer state every ``checkpoint_every`` steps and hands it
  to Ray Train (``ray.train.report`` with a ``Checkpoint``);
- when any worker dies, Ray Train's ``FailureConfig`` tears down the *whole* worker group,
  starts a new one, and every worker resumes from the last reported checkpoint
  (``ray.train.get_checkpoint()``). The steps trained since that checkpoint are redone,
  and the group restart (new processes, imports, process group, DDP's initial broadcast,
  checkpoint load) is paid on every failure.

It trains on the same data as cpr, in the same order: the microbatch cache that cpr's
driver builds with ``app.job.prepare_data`` (``core.data.CriteoReader``, ``log1p`` dense
features, raw ids folded into the tables with ``sparse_to_rows``) and cpr's
``StepSchedule`` (a step is ``microbatches_per_step`` microbatches, permuted per epoch by the
run's seed). Each worker takes an even share of the rows of every step, so the global batch
is the same whatever the number of workers, and a restart from step ``s`` replays exactly
the data of steps ``s, s+1, ...``. The optimizers mirror cpr's: row-wise Adagrad (as
fbgemm's fused one on cpr's shards) for the embedding tables, whose gradients are sparse,
and ``core.model.DenseAdagrad`` for the dense arches.

The kill schedule is the one of cpr's method (a) in ``trainer_failures.py``: ``kills``
times, wait until the worker group trains (a step completed in the current attempt), wait
``healthy_s`` more, then SIGKILL worker ``i % num_workers`` by its pid. Workers publish
their pid, attempt and step in ``workdir/status/rank<r>.json`` after every step.

    RAY_AUTH_MODE=token GLOO_SOCKET_IFNAME=lo .venv/bin/python benchmarks/ddp_baseline.py --rows 60000
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# Ray Train V2 (the controller actor, FailureConfig restarts of the worker group); it is the
# default in Ray 2.60, set anyway before ray.train is first imported.
os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "1")

import core.config  # noqa: E402

__all__ = ["run_ddp", "main"]

_STATE_FILE = "state.pt"


# ---------------------------------------------------------------------------------------
# Small file helpers shared by the workers and the driver


def _write_json_atomic(path: Path, obj: dict) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def _read_starts(workdir: Path) -> list[dict]:
    """One line per worker process start: rank, attempt, pid, start_step, prev_step."""
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


# ---------------------------------------------------------------------------------------
# The worker


def _train_loop(loop_config: dict) -> None:
    """Ray Train ``train_loop_per_worker``: one DDP replica of the whole DLRM."""
    import numpy as np
    import ray.train
    import torch
    import torch.nn.functional as F
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    from core.schedule import StepSchedule
    from core.cache import MicrobatchFile
    from core.config import config_from_dict
    from core.data import NUM_DENSE, NUM_SPARSE, _auc, sparse_to_rows
    from core.model import DenseAdagrad, DenseModel

    torch.set_num_threads(1)
    cfg = config_from_dict(loop_config["config"])
    tr = cfg.training
    workdir = Path(loop_config["workdir"])
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    pid = os.getpid()
    status_path = workdir / "status" / f"rank{rank}.json"

    # Which attempt this process belongs to: how many processes held this rank before it.
    attempt = sum(1 for s in _read_starts(workdir) if s["rank"] == rank)
    previous = _read_json(status_path)  # the last step this rank completed in the previous attempt

    table_rows = cfg.model.rows_per_table
    dim = cfg.model.embedding_dim

    class DLRM(nn.Module):
        """26 EmbeddingBag tables (one id per bag, sum pooling) + cpr's DenseModel."""

        def __init__(self, init: bool):
            super().__init__()
            tables = []
            for rows in table_rows:
                w = torch.empty(rows, dim)
                if init:  # DLRM's init, as cpr's shards: uniform(+-sqrt(1/rows))
                    bound = (1.0 / rows) ** 0.5
                    w.uniform_(-bound, bound)
                tables.append(nn.EmbeddingBag(rows, dim, mode="sum", sparse=True, _weight=w))
            self.tables = nn.ModuleList(tables)
            self.dense = DenseModel(NUM_DENSE, NUM_SPARSE, cfg.model.dense_arch, cfg.model.over_arch)

        def forward(self, dense: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
            pooled = torch.stack([t(rows[:, f : f + 1]) for f, t in enumerate(self.tables)], dim=1)
            return self.dense(dense, pooled)

    class RowwiseAdagrad:
        """Row-wise Adagrad on the tables' sparse gradients (fbgemm's fused one on cpr's
        shards): one accumulator per row, the mean of the squared gradient over the row."""

        def __init__(self, tables, lr: float, eps: float):
            self.weights = [t.weight for t in tables]
            self.lr, self.eps = lr, eps
            self.sums = [torch.zeros(w.shape[0]) for w in self.weights]

        @torch.no_grad()
        def step(self) -> None:
            for w, acc in zip(self.weights, self.sums):
                if w.grad is None:
                    continue
                g = w.grad.coalesce()
                idx, vals = g.indices()[0], g.values()
                acc.index_add_(0, idx, vals.pow(2).mean(dim=1))
                w.index_add_(0, idx, vals * (-self.lr / (acc[idx].sqrt() + self.eps)).unsqueeze(1))

    checkpoint = ray.train.get_checkpoint()
    state = None
    if checkpoint is not None:
        with checkpoint.as_directory() as d:
            state = torch.load(os.path.join(d, _STATE_FILE), weights_only=True)
    torch.manual_seed(cfg.seed)  # identical initial model on every worker
    model = DLRM(init=state is None)
    dense_opt = DenseAdagrad(model.dense.parameters(), lr=tr.dense_learning_rate)
    emb_opt = RowwiseAdagrad(model.tables, lr=cfg.embeddings.learning_rate, eps=cfg.embeddings.eps)
    start_step = 0
    if state is not None:
        model.load_state_dict(state["model"])
        dense_opt.load_state_dict(state["dense_opt"])
        for acc, saved in zip(emb_opt.sums, state["emb_sums"]):
            acc.copy_(saved)
        start_step = int(state["step"])
        del state
    ddp = DistributedDataParallel(model)

    with open(workdir / "starts.jsonl", "a") as f:
        f.write(json.dumps({
            "rank": rank, "attempt": attempt, "pid": pid, "start_step": start_step,
            "prev_step": previous["step"] if previous else None, "time": time.time(),
        }) + "\n")

    train_file = MicrobatchFile(loop_config["train_cache"])
    m = tr.microbatches_per_step
    schedule = StepSchedule.from_config(len(train_file), m, tr.epochs, tr.max_steps, cfg.seed)
    global_rows = m * tr.microbatch_rows
    lo, hi = rank * global_rows // world, (rank + 1) * global_rows // world
    # With DDP averaging the gradients over the workers, this scale makes them the gradient
    # of the step's mean loss over all its rows, however unevenly they are split.
    loss_scale = world / global_rows

    def load(step: int):
        parts = [train_file.get(schedule.microbatch(step, k)) for k in range(m)]
        labels, dense, sparse = (np.concatenate([p[j] for p in parts])[lo:hi] for j in range(3))
        rows = sparse_to_rows(sparse, table_rows)
        return torch.from_numpy(labels), torch.from_numpy(dense), torch.from_numpy(rows)

    def publish(step: int) -> None:
        _write_json_atomic(status_path, {"pid": pid, "attempt": attempt, "step": step, "start_step": start_step,
                                         "time": time.time()})

    def save(step: int) -> None:
        metrics = {"step": step}
        if rank != 0:
            ray.train.report(metrics)  # V2: every rank reports; only rank 0 carries the checkpoint
            return
        tmp_root = workdir / "tmp"
        tmp_root.mkdir(exist_ok=True)
        with tempfile.TemporaryDirectory(dir=tmp_root) as d:
            torch.save(
                {"model": model.state_dict(), "dense_opt": dense_opt.state_dict(), "emb_sums": emb_opt.sums, "step": step},
                os.path.join(d, _STATE_FILE),
            )
            ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(d))

    publish(start_step)
    every = loop_config["checkpoint_every"]
    for step in range(start_step, schedule.total_steps):
        labels, dense, rows = load(step)
        logits = ddp(dense, rows)
        loss = F.binary_cross_entropy_with_logits(logits, labels, reduction="sum") * loss_scale
        loss.backward()
        dense_opt.step()
        emb_opt.step()
        model.zero_grad(set_to_none=True)
        done = step + 1
        publish(done)
        if every and done % every == 0 and done < schedule.total_steps:
            save(done)

    if rank == 0:
        train_end = time.time()
        eval_file = MicrobatchFile(loop_config["eval_cache"])
        preds, ys = [], []
        model.eval()
        with torch.no_grad():
            for i in range(len(eval_file)):
                y, dense, sparse = eval_file.get(i)
                logits = model(torch.from_numpy(dense), torch.from_numpy(sparse_to_rows(sparse, table_rows)))
                preds.append(torch.sigmoid(logits).numpy())
                ys.append(y)
        p, y = np.concatenate(preds), np.concatenate(ys)
        pc = np.clip(p, 1e-7, 1 - 1e-7)
        _write_json_atomic(workdir / "final.json", {
            "train_end": train_end,
            "eval_s": time.time() - train_end,
            "auc": float(_auc(p, y)),
            "log_loss": float(-np.mean(y * np.log(pc) + (1 - y) * np.log(1 - pc))),
            "eval_rows": int(len(y)),
            "steps": schedule.total_steps,
            "attempt": attempt,
        })


# ---------------------------------------------------------------------------------------
# The driver


def _trainer_class():
    """cpr's TorchTrainer without the helper actors this run does not use (app.job), so that
    both methods pay the same per-group start; plain TorchTrainer if that is not there."""
    try:
        from app.raytrain import trainer_class as cpr_trainer_class

        return cpr_trainer_class()
    except Exception:
        from ray.train.torch import TorchTrainer

        return TorchTrainer


def _group_training(workdir: Path, n: int, attempt: int) -> bool:
    """Every rank of ``attempt`` completed a step in it."""
    for r in range(n):
        s = _read_json(workdir / "status" / f"rank{r}.json")
        if s is None or s["attempt"] != attempt or s["step"] <= s["start_step"]:
            return False
    return True


def run_ddp(cfg: core.config.RunConfig, kills: int, healthy_s: float, checkpoint_every: int, workdir: Path) -> dict:
    """Trains ``cfg``'s DLRM with plain DDP on Ray Train, SIGKILLing a worker ``kills``
    times (each ``healthy_s`` after the group trains again); Ray Train restarts the whole
    group from the last checkpoint (saved every ``checkpoint_every`` steps). Needs Ray
    connected (``app.job.connect_ray``). Returns throughput, restarts, lost steps and AUC."""
    import ray
    import ray.cloudpickle
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig

    from core.schedule import StepSchedule
    from core.cache import prepare_data

    if __name__ != "__main__":  # ship this module's code to the workers whatever their sys.path
        ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

    workdir = Path(workdir).resolve()
    if workdir.exists():
        for name in ("status", "starts.jsonl", "final.json"):
            p = workdir / name
            shutil.rmtree(p) if p.is_dir() else p.unlink(missing_ok=True)
    (workdir / "status").mkdir(parents=True, exist_ok=True)

    tr = cfg.training
    n = tr.num_trainers
    t_data = time.perf_counter()
    data = prepare_data(cfg)  # the same microbatch caches cpr's driver builds (reused if built)
    data_prep_s = time.perf_counter() - t_data
    total_steps = StepSchedule.from_config(
        data["train"].microbatches, tr.microbatches_per_step, tr.epochs, tr.max_steps, cfg.seed
    ).total_steps
    global_rows = tr.microbatches_per_step * tr.microbatch_rows

    trainer = _trainer_class()(
        train_loop_per_worker=_train_loop,
        train_loop_config={
            "config": cfg.model_dump(),
            "workdir": str(workdir),
            "train_cache": data["train"].path,
            "eval_cache": data["eval"].path,
            "checkpoint_every": checkpoint_every,
        },
        scaling_config=ScalingConfig(num_workers=n, use_gpu=False),
        torch_config=TorchConfig(backend="gloo"),
        run_config=RunConfig(
            name=f"ddp-{uuid.uuid4().hex[:8]}",
            storage_path=str(workdir / "ray_train"),
            failure_config=FailureConfig(max_failures=kills + 2),
            checkpoint_config=CheckpointConfig(num_to_keep=2),
        ),
    )

    outcome: dict = {}

    def fit() -> None:
        try:
            outcome["result"] = trainer.fit()
        except BaseException as err:  # re-raised on the driver's thread
            outcome["error"] = err
        finally:
            outcome["end"] = time.time()

    fit_start = time.time()
    thread = threading.Thread(target=fit, name="ddp-fit", daemon=True)
    thread.start()
    killed: list[dict] = []
    for i in range(kills):
        # Attempt i is the group started after i kills; wait until it trains.
        while thread.is_alive() and not _group_training(workdir, n, i):
            time.sleep(0.05)
        if not thread.is_alive():
            break
        time.sleep(healthy_s)
        target = _read_json(workdir / "status" / f"rank{i % n}.json")
        if not thread.is_alive() or target is None or target["step"] >= total_steps:
            break
        try:
            os.kill(target["pid"], signal.SIGKILL)
        except ProcessLookupError:
            break
        killed.append({"rank": i % n, "pid": target["pid"], "attempt": target["attempt"], "step": target["step"],
                       "time": time.time()})
    thread.join()
    if "error" in outcome:
        raise outcome["error"]

    final = _read_json(workdir / "final.json")
    if final is None:
        raise RuntimeError(f"DDP run ended without its final evaluation ({workdir / 'final.json'} missing)")
    starts = _read_starts(workdir)
    attempts = sorted({s["attempt"] for s in starts})
    lost_by_attempt = {}
    for a in attempts:
        if a == 0:
            continue
        this = [s for s in starts if s["attempt"] == a]
        lost_by_attempt[a] = max(
            (s["prev_step"] - s["start_step"] for s in this if s["prev_step"] is not None), default=0
        )
    # When the first group was ready to train (every rank built its model and DDP).
    first_start = max((s["time"] for s in starts if s["attempt"] == 0), default=fit_start)
    training_s = final["train_end"] - fit_start
    from_first_step_s = final["train_end"] - first_start
    return {
        "effective_samples_per_s": total_steps * global_rows / training_s,
        "training_s": training_s,
        "steps": total_steps,
        "trainer_kills": len(killed),
        "restarts": max(attempts, default=0),
        "lost_steps": int(sum(lost_by_attempt.values())),
        "auc": final["auc"],
        # extras, for the write-up. cpr's report measures its training_s from its first
        # step (its startup excluded): these two are the same measure for this baseline.
        "training_from_first_step_s": from_first_step_s,
        "effective_samples_per_s_from_first_step": total_steps * global_rows / from_first_step_s,
        "log_loss": final["log_loss"],
        "lost_steps_by_restart": [lost_by_attempt[a] for a in sorted(lost_by_attempt)],
        "kills": killed,
        "startup_s": first_start - fit_start,
        "evaluation_s": final["eval_s"],
        "fit_s": outcome["end"] - fit_start,
        "data_prep_s": data_prep_s,
        "samples_per_step": global_rows,
        "checkpoint_every": checkpoint_every,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(ROOT / "configs/local.yaml"))
    parser.add_argument("--rows", type=int, default=60_000)
    parser.add_argument("--kills", type=int, default=2)
    parser.add_argument("--healthy-s", type=float, default=1.0)
    parser.add_argument("--checkpoint-every", type=int, default=5)
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory (data, checkpoints)")
    args = parser.parse_args()

    import ray

    from core.config import load_config
    from core.data import generate
    from app.rayenv import connect_ray

    base = load_config(args.config)
    root = Path(tempfile.mkdtemp(prefix="cpr-bench-ddp-"))
    started = False
    try:
        data = generate(str(root / "data"), args.rows, args.rows // 10, seed=0)
        started = connect_ray(base)
        for kills in (0, args.kills):
            name = f"ddp-kills{kills}"
            cfg = base.model_copy(
                update={
                    "run_dir": str(root / name),
                    "data": base.data.model_copy(
                        update={"train": [data.train_path], "eval": [data.eval_path], "cache_dir": str(root / "cache"),
                                "generate": None}
                    ),
                    "checkpoint": base.checkpoint.model_copy(update={"every_steps": args.checkpoint_every}),
                    "faults": None,
                }
            )
            r = run_ddp(cfg, kills, args.healthy_s, args.checkpoint_every, root / name)
            print(f"kills={kills}: " + json.dumps(r, indent=1), flush=True)
    finally:
        if started or ray.is_initialized():
            ray.shutdown()
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
