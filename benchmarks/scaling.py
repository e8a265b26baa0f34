"""How each cost grows with the model, on this machine.

1. **Step time** of cpr (``python -m app train``, 1 trainer, 2 shards, as throughput.py runs
   it) and of the single-process torchrec baseline (its own process, no Ray) as the rows per
   table grow (the demo model otherwise) and as the embedding dimension grows.
2. **Saves and loads** of one shard as it grows, in one process (no Ray): the snapshot that
   holds training, the background write, and a load into a fresh shard (read, verify, copy);
   beside the machine's own limits for the same bytes: ``dd`` writing them (fdatasync) and a
   memory copy.
3. **MFU/SSU tracking** time per step (a demo step's ids) as the shard's rows grow: the
   counting the tracker thread does beside the step (``actors.tracking``).

Kill-to-serving as the shard grows is ``benchmarks/recovery.py`` (104 MB and 1.3 GB shards).
Writes benchmarks/results/scaling.json and .md, and docs/images/scaling.png.

    .venv/bin/python benchmarks/scaling.py                   # about 15 minutes
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("RAY_AUTH_MODE", "token")

from benchmarks.meta import describe, run_metadata  # noqa: E402
from benchmarks.throughput_runs import product, single_process_run  # noqa: E402
from core.config import load_config  # noqa: E402

CONFIG = "configs/local.yaml"


def step_times(args, root: Path) -> list[dict]:
    """ms a step of cpr (1 trainer) and the single process, for each (rows per table, dim)."""
    from app.dataengines import LocalEngine
    from app.dataprep import prepare_data

    points = [(rows, 16) for rows in args.rows] + [(args.rows[0], dim) for dim in args.dims if dim != 16]
    out = []
    for rows, dim in points:
        sets = [f"model.table_rows={rows}", f"model.embedding_dim={dim}", f"model.dense_arch=[64,{dim}]",
                f"data.cache_dir={root / 'cache'}"]
        cfg = load_config(ROOT / CONFIG, {"model.table_rows": rows, "model.embedding_dim": dim,
                                          "model.dense_arch": [64, dim], "data.cache_dir": str(root / "cache")})
        data = prepare_data(cfg.model_copy(update={"run_dir": str(root / f"prep-{rows}-{dim}")}), LocalEngine())
        samples = cfg.training.microbatches_per_step * cfg.training.microbatch_rows
        singles, cprs = [], []
        for pair in range(args.pairs):  # alternated: a-b, then b-a, so a drift of the machine hits both
            order = ("single", "cpr") if pair % 2 == 0 else ("cpr", "single")
            for side in order:
                if side == "single":
                    singles.append(single_process_run(CONFIG, args.steps, data["train"].uri, sets))
                else:
                    run_dir = root / f"cpr-{rows}-{dim}-{pair}"
                    cprs.append(product(CONFIG, args.steps, 1, run_dir, sets))
                    shutil.rmtree(run_dir, ignore_errors=True)
        single_ms = [1e3 * samples / r["samples_per_s"] for r in singles]
        cpr_ms = [1e3 * samples / r["samples_per_s"] for r in cprs]
        mid = int(np.argsort(cpr_ms)[len(cpr_ms) // 2])  # the phases of the median cpr run
        point = {"rows_per_table": rows, "dim": dim, "pairs": args.pairs,
                 "single_ms": float(np.median(single_ms)), "cpr_ms": float(np.median(cpr_ms)),
                 "ratio": float(np.median([a / b for a, b in zip(single_ms, cpr_ms)])),
                 "single_ms_all": single_ms, "cpr_ms_all": cpr_ms,
                 "cpr_phase_ms": cprs[mid]["phase_ms"], "single_phase_ms": singles[mid]["phase_ms"]}
        out.append(point)
        print(f"rows {rows:,} dim {dim}: single {point['single_ms']:.1f} ms, cpr {point['cpr_ms']:.1f} ms, "
              f"ratio {point['ratio']:.2f}", flush=True)
    return out


def _dd_write_mb_s(path: Path, nbytes: int) -> float:
    t0 = time.perf_counter()
    subprocess.run(["dd", "if=/dev/zero", f"of={path}", "bs=16M", f"count={max(1, nbytes >> 24)}", "conv=fdatasync"],
                   check=True, capture_output=True)
    mb = max(1, nbytes >> 24) * 16 * (1 << 20) / 1e6
    path.unlink()
    return mb / (time.perf_counter() - t0)


def _memcpy_mb_s(nbytes: int) -> float:
    src = np.ones(nbytes // 4, dtype=np.float32)
    dst = np.empty_like(src)
    dst[...] = src  # pages faulted in once
    t0 = time.perf_counter()
    dst[...] = src
    return nbytes / 1e6 / (time.perf_counter() - t0)


def save_load(args, root: Path) -> list[dict]:
    """One shard (no Ray) per size: snapshot, background write, load into a new shard."""
    from actors.shard import EmbeddingShard
    from core.checkpoint import FULL, CheckpointStore
    from core.plan import make_plan

    out = []
    for mb in args.shard_mb:
        dim = 16
        rows = int(mb * 1e6 / (dim * 4 + 4) / 13)  # 13 tables a shard
        plan = make_plan("table_wise", [rows] * 26, 2)
        uri = str(root / f"ckpt-{mb}")
        shard = EmbeddingShard(1, list(plan.shards[1]), dim, 0.05, 1e-8, 0, microbatches_per_step=1)
        shard.save_checkpoint(uri, 0, save_index=0, full=True)  # fills the snapshot buffer once, as a run's first save
        shard.save_written(0)
        uri = str(root / f"ckpt-{mb}-b")  # the measured save: step 0 again, under another root
        snap = shard.save_checkpoint(uri, 0, save_index=0, full=True)
        written = shard.save_written(0)
        CheckpointStore(uri).commit(0, [written.entry], kind=FULL)
        nbytes = written.entry.size_bytes
        del shard
        gc.collect()  # its tables and snapshot buffer, before the next shard's
        fresh = EmbeddingShard(1, list(plan.shards[1]), dim, 0.05, 1e-8, 0, microbatches_per_step=1)
        load = fresh.load_checkpoint(uri, [0])
        del fresh
        gc.collect()
        point = {"shard_mb": nbytes / 1e6, "snapshot_s": snap.snapshot_s, "write_s": written.write_s,
                 "load_s": load.duration_s, "dd_write_mb_s": _dd_write_mb_s(root / "dd.bin", nbytes),
                 "memcpy_mb_s": _memcpy_mb_s(min(nbytes, 1 << 30))}
        out.append(point)
        print(f"shard {point['shard_mb']:,.0f} MB: snapshot {snap.snapshot_s:.2f}s, write {written.write_s:.2f}s, "
              f"load {load.duration_s:.2f}s; dd {point['dd_write_mb_s']:,.0f} MB/s, memcpy "
              f"{point['memcpy_mb_s']:,.0f} MB/s", flush=True)
        shutil.rmtree(root / f"ckpt-{mb}", ignore_errors=True)
        shutil.rmtree(uri, ignore_errors=True)
    return out


def tracking(args) -> list[dict]:
    """ms a step of MFU's and SSU's counting (a demo step's ids: 2,048 samples x 13 tables of a
    shard) as the shard's rows grow, as the shard's tracker thread runs it."""
    import torch

    from policies.priority import make_policy

    def add(counts, ids):  # as the shard counts (actors.shard_save.ShardCheckpoints._add_ones)
        torch.from_numpy(counts).index_add_(0, torch.from_numpy(ids), torch.ones(1, dtype=torch.int32).expand(ids.size))

    rng = np.random.default_rng(0)
    out = []
    for rows in args.rows:
        n = rows * 13
        point = {"shard_rows": n}
        for name in ("mfu", "ssu"):
            policy = make_policy(name, n, 0.1, 0.5, 0, add=add)
            steps = [np.minimum(rng.zipf(1.2, 2048 * 13) - 1, n - 1).astype(np.int64) for _ in range(40)]
            for ids in steps[:20]:  # warm: the counters' pages are faulted in once, in a run's first steps
                policy.observe(ids)
            steps = steps[20:]
            t0 = time.perf_counter()
            for ids in steps:
                policy.observe(ids)
            point[f"{name}_ms"] = 1e3 * (time.perf_counter() - t0) / len(steps)
            point[f"{name}_bytes"] = policy.tracking_bytes
        out.append(point)
        print(f"tracking, {n:,} rows: MFU {point['mfu_ms']:.2f} ms, SSU {point['ssu_ms']:.2f} ms a step", flush=True)
    return out


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    steps = [p for p in result["steps"] if p["dim"] == 16]
    ax = axes[0]
    ax.plot([p["rows_per_table"] for p in steps], [p["cpr_ms"] for p in steps], "o-", label="cpr (1 trainer)")
    ax.plot([p["rows_per_table"] for p in steps], [p["single_ms"] for p in steps], "s-", label="single process")
    ax.set(xscale="log", xlabel="rows per table (26 tables, D=16)", ylabel="ms a step (2,048 samples)",
           title="Step time as tables grow")
    ax.legend()
    ax = axes[1]
    sl = result["save_load"]
    size = [p["shard_mb"] for p in sl]
    for key, label in (("snapshot_s", "save: snapshot (holds training)"), ("write_s", "save: background write"),
                       ("load_s", "load (read, verify, copy)")):
        ax.plot(size, [p[key] for p in sl], "o-", label=label)
    ax.plot(size, [p["shard_mb"] / p["dd_write_mb_s"] for p in sl], "k--", label="dd write, same bytes")
    ax.plot(size, [p["shard_mb"] / p["memcpy_mb_s"] for p in sl], "k:", label="memory copy, same bytes")
    ax.set(xscale="log", yscale="log", xlabel="shard size (MB)", ylabel="seconds", title="Saves and loads")
    ax.legend(fontsize=8)
    ax = axes[2]
    tr = result["tracking"]
    for name in ("mfu", "ssu"):
        ax.plot([p["shard_rows"] for p in tr], [p[f"{name}_ms"] for p in tr], "o-", label=name.upper())
    ax.set(xscale="log", xlabel="rows in the shard", ylabel="ms a step (tracker thread)", title="Access tracking")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)


def render(result: dict) -> str:
    again = "".join(f" {part} measured again: {describe(meta)}." for part, meta in (result.get("remeasured") or {}).items())
    lines = ["# How each cost grows with the model", "",
             f"Rendered from `scaling.json`: {describe(result['meta'])}.{again} The plot: `docs/images/scaling.png`.", "",
             f"**Step time** (ms a step of 2,048 samples, {result['step_count']} steps; cpr: `python -m app train`, "
             "1 trainer, 2 shards; single process: torchrec in its own process, no Ray, every core; the median of "
             f"{result['steps'][0].get('pairs', 1)} alternated pair(s) of runs, the ratio the median of the pairs' ratios):", "",
             "| rows per table | D | single process | cpr | ratio (single/cpr) | cpr lookup | cpr push |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    for p in result["steps"]:
        lines.append(f"| {p['rows_per_table']:,} | {p['dim']} | {p['single_ms']:.1f} | {p['cpr_ms']:.1f} | "
                     f"{p.get('ratio', p['single_ms'] / p['cpr_ms']):.2f} | {p['cpr_phase_ms']['lookup']:.1f} | "
                     f"{p['cpr_phase_ms']['push']:.1f} |")
    lines += ["", "**Saves and loads of one shard** (one process, no Ray; the file in the page cache, as in a run):", "",
              "| shard | snapshot (holds training) | background write | load (read, verify, copy) | dd write (fdatasync) | "
              "memory copy |", "|---:|---:|---:|---:|---:|---:|"]
    for p in result["save_load"]:
        lines.append(f"| {p['shard_mb']:,.0f} MB | {p['snapshot_s']:.2f} s | {p['write_s']:.2f} s | {p['load_s']:.2f} s | "
                     f"{p['shard_mb'] / p['dd_write_mb_s']:.2f} s ({p['dd_write_mb_s']:,.0f} MB/s) | "
                     f"{p['shard_mb'] / p['memcpy_mb_s']:.2f} s ({p['memcpy_mb_s']:,.0f} MB/s) |")
    lines += ["", "**MFU/SSU tracking** (ms a step of the tracker thread, a demo step's ids; memory it holds):", "",
              "| rows in the shard | MFU | MFU memory | SSU | SSU memory |", "|---:|---:|---:|---:|---:|"]
    for p in result["tracking"]:
        lines.append(f"| {p['shard_rows']:,} | {p['mfu_ms']:.2f} ms | {p['mfu_bytes'] / 1e6:.1f} MB | "
                     f"{p['ssu_ms']:.2f} ms | {p['ssu_bytes'] / 1e6:.1f} MB |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[100_000, 1_000_000, 3_000_000])
    parser.add_argument("--dims", type=int, nargs="+", default=[16, 64, 128])
    parser.add_argument("--steps", type=int, default=90)
    parser.add_argument("--pairs", type=int, default=3, help="alternated pairs of runs a point (the median is kept)")
    parser.add_argument("--shard-mb", type=int, nargs="+", default=[100, 1000, 2500])
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/scaling.md"))
    parser.add_argument("--plot", default=str(ROOT / "docs/images/scaling.png"))
    parser.add_argument("--parts", nargs="+", default=["tracking", "save_load", "steps"],
                        choices=["tracking", "save_load", "steps"], help="measure these again, keep the others")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="cpr-bench-scaling-"))
    out = Path(args.out)
    result = {"step_count": args.steps}
    if len(args.parts) < 3:
        result = json.loads(out.with_suffix(".json").read_text())
        result.setdefault("remeasured", {}).update({part: run_metadata() for part in args.parts})
        if "steps" in args.parts:
            result["step_count"] = args.steps
    else:
        result["meta"] = run_metadata()
    parts = {"tracking": lambda: tracking(args), "save_load": lambda: save_load(args, root),
             "steps": lambda: step_times(args, root)}
    try:
        for part in args.parts:
            result[part] = parts[part]()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2))
    plot(result, Path(args.plot))
    out.write_text(render(result))
    print(render(result))


if __name__ == "__main__":
    main()
