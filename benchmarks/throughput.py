"""Throughput: this product against a single-process torchrec DLRM, side by side.

(a) one process: torchrec FusedEmbeddingBagCollection (fbgemm TBE, fused row-wise Adagrad)
    plus the same dense arches, one step = M microbatches as one batch, torch using every
    core of the machine (what a user running torchrec alone gets);
(b) cpr with 1 trainer, and (c) cpr with 2 trainers: Ray Train + torchft trainers, 2
    EmbeddingShard actors, checkpoints and fault injection off.

Two workloads: ``demo`` (configs/local.yaml) and ``ref`` (configs/dlrm_ref.yaml, a
DLRM-reference-sized dense part). Every pair runs (a), (b), (c) back to back, in reversed
order on odd pairs, so that neither side always runs first; a pair's ratio is b/a (c/a)
of that pair, and the table gives the median and the spread (min-max) over the pairs.
samples/s is the training phase (first to last step; startup and evaluation excluded).
cpr's per-phase breakdown (ms a step) comes from the trainers' own phase timers.

Also measured: startup (from launching ``cpr train`` to the first committed step, the
local config), and the checkpoint write rate against a raw sequential write of the same
bytes, in alternating order. Writes benchmarks/results/throughput.md (and .json).

    .venv/bin/python benchmarks/throughput.py                      # the recorded run
    .venv/bin/python benchmarks/throughput.py --workloads demo --pairs 1 --startup-reps 0   # a quick look
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
# As `./dev.sh` sets them: Ray reads the auth mode when it is imported.
os.environ.setdefault("RAY_AUTH_MODE", "token")
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

from benchmarks.meta import describe, run_metadata  # noqa: E402
from core.store import MicrobatchStore  # noqa: E402
from core.config import RunConfig, load_config  # noqa: E402
from core.data import NUM_DENSE, NUM_SPARSE  # noqa: E402

WORKLOADS = {"demo": ("configs/local.yaml", 90), "ref": ("configs/dlrm_ref.yaml", 40)}
PHASES = ("quorum", "data", "lookup", "dense", "push", "allreduce", "commit")


def single_process(cfg: RunConfig, train_cache: str, steps: int) -> dict:
    """Samples/s of a single-process torchrec DLRM on the same microbatches, torch on
    every core."""
    import torch
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection
    from torchrec.optim import RowWiseAdagrad
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from core.schedule import StepSchedule
    from core.model import torchrec_dense_model

    torch.set_num_threads(os.cpu_count() or 1)
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
    model = torchrec_dense_model(NUM_DENSE, NUM_SPARSE, cfg.model.dense_arch, cfg.model.over_arch)
    opt = torch.optim.Adagrad(model.parameters(), lr=cfg.training.dense_learning_rate)
    data = MicrobatchStore(train_cache)
    tr = cfg.training
    schedule = StepSchedule.from_config(len(data), tr.microbatches_per_step, tr.epochs, steps, cfg.seed)
    keys = [f"f{t}" for t in range(NUM_SPARSE)]
    t_data = t_compute = 0.0
    t0 = time.perf_counter()
    for step in range(schedule.total_steps):
        t1 = time.perf_counter()
        parts = [data.get(schedule.microbatch(step, m)) for m in range(tr.microbatches_per_step)]
        labels = torch.from_numpy(np.concatenate([p[0] for p in parts]))
        dense = torch.from_numpy(np.concatenate([p[1] for p in parts]))
        rows = np.concatenate([p[2] for p in parts]).astype(np.int64)  # mapped when the store was built
        batch = rows.shape[0]
        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=keys,
            values=torch.from_numpy(np.ascontiguousarray(rows.T).reshape(-1)),
            lengths=torch.ones(batch * NUM_SPARSE, dtype=torch.int64),
        )
        t2 = time.perf_counter()
        pooled = ebc(kjt).values().view(batch, NUM_SPARSE, dim)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(model(dense, pooled), labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
        t3 = time.perf_counter()
        t_data += t2 - t1
        t_compute += t3 - t2
    elapsed = time.perf_counter() - t0
    n = schedule.total_steps
    return {
        "samples_per_s": n * tr.microbatches_per_step * tr.microbatch_rows / elapsed,
        "phase_ms": {"data": 1e3 * t_data / n, "compute": 1e3 * t_compute / n},
    }


def product(cfg: RunConfig, steps: int) -> dict:
    """Samples/s of the training phase of a cpr run, and its per-phase ms a step."""
    from app.job import run_training

    report = run_training(cfg, show_progress=False)
    if report["steps"] != steps:
        raise RuntimeError(f"the cpr run trained {report['steps']} steps, expected {steps}")
    totals = dict.fromkeys(PHASES, 0.0)
    for p in report.get("progress") or []:
        for k in PHASES:
            totals[k] += (p.get("phase_s") or {}).get(k, 0.0)
    # Phase times are the saving trainer's (participant 0's); every trainer runs every step.
    return {
        "samples_per_s": report["samples_per_s"],
        "phase_ms": {k: 1e3 * v / steps for k, v in totals.items()},
        "auc": report.get("auc"),
    }


def startup_times(config: str, reps: int, runs_root: Path) -> list[float]:
    """Seconds from launching ``cpr train`` (a fresh process, embedded Ray) to the first
    committed step, read from the run's training_started event."""
    out = []
    for rep in range(reps):
        run_dir = runs_root / f"startup{rep}"
        # This checkout's code, whatever the virtual environment's editable install points at.
        env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", RAY_AUTH_MODE="token", PYTHONPATH=str(ROOT))
        t0 = time.time()
        subprocess.run(
            [sys.executable, "-m", "app", "train", "--config", config, "--set", f"run_dir={run_dir}", "--set", "faults=null",
             "--set", "training.max_steps=5", "--set", "checkpoint.every_steps=null", "--set", "checkpoint.final=false"],
            cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
        started = next(e for e in events if e["kind"] == "training_started")
        # Sent when step 0 begins, after the first quorum; its commit follows within ~0.1 s.
        out.append(started["wall_time"] - t0)
        print(f"startup {rep}: {out[-1]:.1f}s", flush=True)
    return out


def checkpoint_write_rate(shard_rows: int, dim: int, reps: int) -> dict:
    """MB/s of write_shard_file for one shard of this config vs a raw sequential write of
    the same bytes, both into the page cache of the same disk (no fsync, as in a run).
    The order alternates, and dirty pages are flushed before each write, so neither pays
    the other's writeback."""
    from core.checkpoint import ShardRows, write_shard_file

    rng = np.random.default_rng(0)
    data = ShardRows(
        tables=np.zeros(shard_rows, dtype=np.int32),
        rows=np.arange(shard_rows, dtype=np.int64),
        weights=rng.standard_normal((shard_rows, dim)).astype(np.float32),
        momentum=rng.random(shard_rows).astype(np.float32),
    )
    ours, raw = [], []
    with tempfile.TemporaryDirectory(dir=ROOT / "benchmarks") as tmp:
        entry = write_shard_file(tmp, 10_000, 0, data)
        payload = Path(tmp, f"ckpt-{10_000:012d}", "shard-0.arrow").read_bytes()

        def write_ours(rep: int) -> None:
            os.sync()
            t0 = time.perf_counter()
            write_shard_file(tmp, rep, 0, data)
            ours.append(entry.size_bytes / (time.perf_counter() - t0) / 1e6)

        def write_raw(rep: int) -> None:
            os.sync()
            t0 = time.perf_counter()
            with open(Path(tmp, f"raw-{rep}.bin"), "wb") as f:
                f.write(payload)
            raw.append(len(payload) / (time.perf_counter() - t0) / 1e6)

        for rep in range(reps):
            first, second = (write_ours, write_raw) if rep % 2 == 0 else (write_raw, write_ours)
            first(rep)
            second(rep)
    return {
        "file_mb": entry.size_bytes / 1e6,
        "checkpoint_mb_s": ours,
        "raw_mb_s": raw,
        "ratio": statistics.median(ours) / statistics.median(raw),
    }


def _spread(xs: list[float]) -> str:
    return f"{min(xs):.2f}-{max(xs):.2f}"


def run_workload(name: str, args, runs_root: Path) -> dict:
    from app.dataengines import LocalEngine
    from app.dataprep import prepare_data

    config, default_steps = WORKLOADS[name]
    steps = args.steps or default_steps
    base = load_config(ROOT / config, dict(args.set or {}))
    base = base.model_copy(
        update={
            "training": base.training.model_copy(update={"max_steps": steps}),
            "checkpoint": base.checkpoint.model_copy(update={"every_steps": None, "every_s": None, "final": False}),
            "faults": None,
        }
    )
    data = prepare_data(base.model_copy(update={"run_dir": str(runs_root / f"{name}-prep")}), LocalEngine())
    variants = {"single": None, **{f"cpr{n}": n for n in args.trainers}}
    results: dict[str, list[dict]] = {k: [] for k in variants}
    for pair in range(args.pairs):
        order = list(variants) if pair % 2 == 0 else list(reversed(variants))
        for key in order:
            n = variants[key]
            if n is None:
                results[key].append(single_process(base, data["train"].uri, steps))
            else:
                cfg = base.model_copy(
                    update={
                        "run_dir": str(runs_root / f"{name}-{key}-{pair}"),
                        "training": base.training.model_copy(update={"num_trainers": n}),
                    }
                )
                results[key].append(product(cfg, steps))
        line = ", ".join(f"{k} {results[k][-1]['samples_per_s']:,.0f}" for k in variants)
        print(f"{name} pair {pair}: {line} samples/s", flush=True)
    single = [r["samples_per_s"] for r in results["single"]]
    out = {
        "config": config,
        "steps": steps,
        "samples_per_step": base.training.microbatches_per_step * base.training.microbatch_rows,
        "runs": results,
        "median_samples_per_s": {k: statistics.median(r["samples_per_s"] for r in v) for k, v in results.items()},
        "ratios": {},
    }
    for key in variants:
        if key == "single":
            continue
        ratios = [b["samples_per_s"] / a for b, a in zip(results[key], single)]
        out["ratios"][key] = {"per_pair": ratios, "median": statistics.median(ratios)}
        out[f"{key}_phase_ms"] = {
            k: statistics.median(r["phase_ms"][k] for r in results[key]) for k in PHASES
        }
    out["single_phase_ms"] = {
        k: statistics.median(r["phase_ms"][k] for r in results["single"]) for k in ("data", "compute")
    }
    return out


def render(result: dict) -> str:
    """throughput.md from throughput.json (also docs/RESULTS.md, through benchmarks/render_docs.py)."""
    meta = result.get("meta")
    source = (describe(meta) if meta else f"`{result['command']}` at commit `{result['commit']}` on "
              f"{result['machine']} (CPU model, memory and date not recorded)")
    lines = [
        "# Throughput: cpr vs a single-process torchrec DLRM",
        "",
        f"Rendered from `throughput.json`: {source}.",
        "",
        "(a) single process: torchrec FusedEmbeddingBagCollection + the same dense arches, torch on "
        f"{result['cores']} threads (every core); (b) cpr, 1 trainer; (c) cpr, 2 trainers; 2 embedding shards, "
        "no checkpoints, no faults. Training-phase samples/s; the ratio is per pair, then median and min-max "
        f"over {result['pairs']} pairs (order a-b-c, then c-b-a).",
        "",
    ]
    for name, w in result["workloads"].items():
        med = w["median_samples_per_s"]
        lines += [
            f"## {name}: `{w['config']}`, {w['steps']} steps of {w['samples_per_step']:,} samples",
            "",
            "| method | samples/s (median) | all pairs | ratio to (a), median | ratio spread |",
            "|---|---:|---|---:|---:|",
            f"| (a) single process | {med['single']:,.0f} | "
            + ", ".join(f"{r['samples_per_s']:,.0f}" for r in w["runs"]["single"]) + " | | |",
        ]
        for key, ratio in w["ratios"].items():
            label = {"cpr1": "(b) cpr, 1 trainer", "cpr2": "(c) cpr, 2 trainers"}.get(key, key)
            lines.append(
                f"| {label} | {med[key]:,.0f} | " + ", ".join(f"{r['samples_per_s']:,.0f}" for r in w["runs"][key])
                + f" | **{ratio['median']:.2f}** | {_spread(ratio['per_pair'])} |"
            )
        lines += ["", "cpr per step (ms, median over pairs; participant 0's timers):", ""]
        keys = [k for k in w if k.endswith("_phase_ms") and k.startswith("cpr")]
        lines += ["| phase | " + " | ".join(k[: -len("_phase_ms")] for k in keys) + " |",
                  "|---|" + "---:|" * len(keys)]
        for ph in PHASES:
            lines.append(f"| {ph} | " + " | ".join(f"{w[k][ph]:.1f}" for k in keys) + " |")
        lines.append("| **sum** | " + " | ".join(f"**{sum(w[k].values()):.1f}**" for k in keys) + " |")
        sp = w["single_phase_ms"]
        lines += ["", f"Single process per step: data {sp['data']:.1f} ms, compute {sp['compute']:.1f} ms.", ""]
    if result.get("startup_s"):
        s = result["startup_s"]
        lines += [
            "## Startup",
            "",
            f"`cpr train --config configs/local.yaml` (a fresh process, embedded Ray) to its first step: "
            f"median **{statistics.median(s):.1f} s** (" + ", ".join(f"{x:.1f}" for x in s) + ").",
            "",
        ]
    ck = result.get("checkpoint_write")
    if ck:
        lines += [
            "## Checkpoint write",
            "",
            "One shard file of the demo config (Arrow IPC + sha256) against a raw sequential write of the same "
            f"{ck['file_mb']:.0f} MB on the same disk (page cache, no fsync in either; alternating order, dirty pages "
            "flushed before each write):",
            "",
            "| write | MB/s (median) | all |",
            "|---|---:|---|",
            f"| write_shard_file | {statistics.median(ck['checkpoint_mb_s']):,.0f} | "
            + ", ".join(f"{x:,.0f}" for x in ck["checkpoint_mb_s"]) + " |",
            f"| raw `write()` | {statistics.median(ck['raw_mb_s']):,.0f} | "
            + ", ".join(f"{x:,.0f}" for x in ck["raw_mb_s"]) + " |",
            f"| **ratio** | **{ck['ratio']:.2f}** | |",
            "",
        ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", nargs="*", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--steps", type=int, default=None, help="steps per run (default: 90 demo, 40 ref)")
    parser.add_argument("--trainers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--set", nargs="*", type=lambda kv: kv.split("=", 1), default=[],
                        help="config overrides for every cpr run, KEY=VALUE (YAML value)")
    parser.add_argument("--startup-reps", type=int, default=3)
    parser.add_argument("--checkpoint-reps", type=int, default=6)
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/throughput.md"))
    args = parser.parse_args()
    import yaml

    args.set = [(k, yaml.safe_load(v)) for k, v in args.set]

    import ray

    from app.rayenv import connect_ray

    runs_root = Path(tempfile.mkdtemp(prefix="cpr-bench-"))
    result = {
        "meta": run_metadata(),
        "cores": os.cpu_count(),
        "pairs": args.pairs,
        "workloads": {},
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def write() -> str:  # after every part, so that a later failure loses nothing
        text = render(result)
        out.write_text(text)
        out.with_suffix(".json").write_text(json.dumps(result, indent=2))
        return text

    if args.workloads:
        connect_ray(load_config(ROOT / WORKLOADS["demo"][0]))
        for name in args.workloads:
            result["workloads"][name] = run_workload(name, args, runs_root)
            write()
        ray.shutdown()
    if args.startup_reps:
        result["startup_s"] = startup_times(str(ROOT / WORKLOADS["demo"][0]), args.startup_reps, runs_root)
        write()
    if args.checkpoint_reps:
        base = load_config(ROOT / WORKLOADS["demo"][0])
        shard_rows = sum(base.model.rows_per_table) // base.embeddings.num_shards
        result["checkpoint_write"] = checkpoint_write_rate(shard_rows, base.model.embedding_dim, args.checkpoint_reps)
    print(write())


if __name__ == "__main__":
    main()
