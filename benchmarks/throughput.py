"""Throughput: this product against a single-process torchrec DLRM, side by side.

(a) one process: torchrec FusedEmbeddingBagCollection (fbgemm TBE, fused row-wise Adagrad)
    plus the same dense arches, one step = M microbatches as one batch;
(b) cpr: 1 trainer (Ray Train + torchft) and 2 EmbeddingShard actors, checkpoints and
    fault injection off.
Same config, same data, same number of steps; samples/s of the training phase, median of
``--reps`` repetitions. Also the checkpoint write rate against a raw sequential write of
the same size. Writes benchmarks/results/throughput.md (and .json).

    .venv/bin/python benchmarks/throughput.py            # the recorded run
    .venv/bin/python benchmarks/throughput.py --steps 30 --reps 1   # a quick look
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from app.cache import MicrobatchFile  # noqa: E402
from app.config import RunConfig, load_config  # noqa: E402
from app.data import NUM_DENSE, NUM_SPARSE, sparse_to_rows  # noqa: E402


def single_process(cfg: RunConfig, train_cache: str, steps: int) -> float:
    """Samples/s of a single-process torchrec DLRM on the same microbatches."""
    import torch
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection
    from torchrec.optim import RowWiseAdagrad
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from actors.trainer import StepSchedule
    from app.model import DenseModel

    torch.set_num_threads(cfg.training.threads_per_worker)
    torch.manual_seed(cfg.seed)
    rows_per_table = cfg.model.rows_per_table
    dim = cfg.model.embedding_dim
    tables = [
        EmbeddingBagConfig(name=f"t{t}", embedding_dim=dim, num_embeddings=rows_per_table[t], feature_names=[f"f{t}"])
        for t in range(NUM_SPARSE)
    ]
    ebc = FusedEmbeddingBagCollection(
        tables=tables,
        optimizer_type=RowWiseAdagrad,
        optimizer_kwargs={"lr": cfg.embeddings.learning_rate, "eps": cfg.embeddings.eps},
        device=torch.device("cpu"),
    )
    model = DenseModel(NUM_DENSE, NUM_SPARSE, cfg.model.dense_arch, cfg.model.over_arch)
    opt = torch.optim.Adagrad(model.parameters(), lr=cfg.training.dense_learning_rate)
    data = MicrobatchFile(train_cache)
    tr = cfg.training
    schedule = StepSchedule.from_config(len(data), tr.microbatches_per_step, tr.epochs, steps, cfg.seed)
    keys = [f"f{t}" for t in range(NUM_SPARSE)]
    t0 = time.perf_counter()
    for step in range(schedule.total_steps):
        parts = [data.get(schedule.microbatch(step, m)) for m in range(tr.microbatches_per_step)]
        labels = torch.from_numpy(np.concatenate([p[0] for p in parts]))
        dense = torch.from_numpy(np.concatenate([p[1] for p in parts]))
        rows = sparse_to_rows(np.concatenate([p[2] for p in parts]), rows_per_table)
        batch = rows.shape[0]
        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=keys,
            values=torch.from_numpy(np.ascontiguousarray(rows.T).reshape(-1)),
            lengths=torch.ones(batch * NUM_SPARSE, dtype=torch.int64),
        )
        pooled = ebc(kjt).values().view(batch, NUM_SPARSE, dim)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(model(dense, pooled), labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
    elapsed = time.perf_counter() - t0
    return schedule.total_steps * tr.microbatches_per_step * tr.microbatch_rows / elapsed


def product(cfg: RunConfig, steps: int) -> tuple[float, dict]:
    """Samples/s of the training phase of a cpr run (startup and evaluation excluded)."""
    from app.job import run_training

    report = run_training(cfg, show_progress=False)
    assert report["steps"] == steps, report["steps"]
    return report["samples_per_s"], report["wall_time_s"]


def checkpoint_write_rate(shard_rows: int, dim: int, reps: int) -> dict:
    """MB/s of write_shard_file for one shard of this config vs a raw sequential write of
    the same bytes, both into the page cache of the same disk (no fsync, as in a run)."""
    from actors.checkpoint import ShardRows, write_shard_file

    rng = np.random.default_rng(0)
    data = ShardRows(
        tables=np.zeros(shard_rows, dtype=np.int32),
        rows=np.arange(shard_rows, dtype=np.int64),
        weights=rng.standard_normal((shard_rows, dim)).astype(np.float32),
        momentum=rng.random(shard_rows).astype(np.float32),
    )
    ours, raw = [], []
    with tempfile.TemporaryDirectory(dir=ROOT / "benchmarks") as tmp:
        for rep in range(reps):
            t0 = time.perf_counter()
            entry = write_shard_file(tmp, rep, 0, data)
            ours.append(entry.size_bytes / (time.perf_counter() - t0) / 1e6)
            payload = Path(tmp, f"ckpt-{rep:012d}", "shard-0.arrow").read_bytes()
            t0 = time.perf_counter()
            with open(Path(tmp, f"raw-{rep}.bin"), "wb") as f:
                f.write(payload)
            raw.append(len(payload) / (time.perf_counter() - t0) / 1e6)
    return {
        "file_mb": entry.size_bytes / 1e6,
        "checkpoint_mb_s": statistics.median(ours),
        "raw_mb_s": statistics.median(raw),
        "ratio": statistics.median(ours) / statistics.median(raw),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(ROOT / "configs/local.yaml"))
    parser.add_argument("--steps", type=int, default=90)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/throughput.md"))
    args = parser.parse_args()

    import ray

    from app.job import connect_ray, prepare_data

    base = load_config(args.config)
    runs_root = Path(tempfile.mkdtemp(prefix="cpr-bench-"))
    cfg_b = base.model_copy(
        update={
            "training": base.training.model_copy(update={"num_trainers": 1, "max_steps": args.steps}),
            "checkpoint": base.checkpoint.model_copy(update={"every_steps": None, "every_s": None}),
            "faults": None,
        }
    )
    data = prepare_data(cfg_b.model_copy(update={"run_dir": str(runs_root / "prep")}))
    connect_ray(cfg_b)
    a_rates, b_rates, b_walls = [], [], []
    for rep in range(args.reps):
        a_rates.append(single_process(cfg_b, data["train"].path, args.steps))
        rate, wall = product(cfg_b.model_copy(update={"run_dir": str(runs_root / f"b{rep}")}), args.steps)
        b_rates.append(rate)
        b_walls.append(wall)
        print(f"rep {rep}: single-process {a_rates[-1]:,.0f} samples/s, cpr {rate:,.0f} samples/s", flush=True)
    ray.shutdown()
    shard_rows = sum(base.model.rows_per_table) // base.embeddings.num_shards
    ckpt = checkpoint_write_rate(shard_rows, base.model.embedding_dim, args.reps)

    a, b = statistics.median(a_rates), statistics.median(b_rates)
    result = {
        "command": "python benchmarks/throughput.py " + " ".join(sys.argv[1:]),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
        "config": args.config,
        "steps": args.steps,
        "samples_per_step": base.training.microbatches_per_step * base.training.microbatch_rows,
        "reps": args.reps,
        "single_process_samples_per_s": a_rates,
        "cpr_samples_per_s": b_rates,
        "cpr_wall_time_s": b_walls,
        "median_single_process": a,
        "median_cpr": b,
        "ratio_cpr_over_single": b / a,
        "checkpoint_write": ckpt,
    }
    lines = [
        "# Throughput: cpr vs a single-process torchrec DLRM",
        "",
        f"`{result['command']}` on {result['machine']}, config `{Path(args.config).name}`, "
        f"{args.steps} steps of {result['samples_per_step']} samples, median of {args.reps}.",
        "",
        "| method | samples/s (median) | all reps |",
        "|---|---:|---|",
        f"| (a) single process: torchrec FusedEmbeddingBagCollection + DLRM dense arches | {a:,.0f} | "
        + ", ".join(f"{x:,.0f}" for x in a_rates) + " |",
        f"| (b) cpr: 1 trainer (Ray Train + torchft), 2 EmbeddingShard actors, no checkpoints | {b:,.0f} | "
        + ", ".join(f"{x:,.0f}" for x in b_rates) + " |",
        f"| **ratio b/a** | **{b / a:.2f}** | |",
        "",
        "Checkpoint write of one shard file (Arrow IPC + sha256) against a raw sequential write of",
        f"the same {ckpt['file_mb']:.0f} MB on the same disk (page cache, no fsync in either):",
        "",
        "| write | MB/s (median) |",
        "|---|---:|",
        f"| write_shard_file | {ckpt['checkpoint_mb_s']:,.0f} |",
        f"| raw `write()` | {ckpt['raw_mb_s']:,.0f} |",
        f"| **ratio** | **{ckpt['ratio']:.2f}** |",
        "",
    ]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines))
    out.with_suffix(".json").write_text(json.dumps(result, indent=2))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
