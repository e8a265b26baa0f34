"""Throughput: this product against a single-process torchrec DLRM, side by side, each the
way its users run it.

(a) one process: torchrec FusedEmbeddingBagCollection (fbgemm TBE, fused row-wise Adagrad)
    plus the same dense arches, one step = M microbatches as one batch, torch using every
    core of the machine, in a process of its own with no Ray running (what a user running
    torchrec alone gets);
(b) cpr with 1 trainer, and (c) cpr with 2 trainers: ``python -m app train`` in a process
    of its own (its embedded Ray), 2 EmbeddingShard actors and the config's warm spare,
    checkpoints and fault injection off.

This driver only starts them and reads their results: it runs no Ray and no torch itself.
Two workloads: ``demo`` (configs/local.yaml) and ``ref`` (configs/dlrm_ref.yaml, a
DLRM-reference-sized dense part). Every pair runs (a), (b), (c) back to back, in reversed
order on odd pairs, so that neither side always runs first; a pair's ratio is b/a (c/a)
of that pair, and the table gives the median and the spread (min-max) over the pairs.
samples/s is the training phase (first to last step; startup and evaluation excluded).
Both sides print their per-phase breakdown (ms a step): cpr's from the trainers' own phase
timers, the single process's from its own.

Also measured: startup, from launching ``cpr train`` to its first step, with the embedded Ray
and against a Ray already running on the machine (``ray start --head``, then ``cpr train``
with RAY_ADDRESS, twice), and the checkpoint write rate against a raw sequential write of
the same bytes, in alternating order. Writes benchmarks/results/throughput.md (and .json).

    .venv/bin/python benchmarks/throughput.py                      # the recorded run
    .venv/bin/python benchmarks/throughput.py --workloads demo --pairs 1 --startup-reps 0   # a quick look
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
# As `./dev.sh` sets them: Ray reads the auth mode when it is imported.
os.environ.setdefault("RAY_AUTH_MODE", "token")
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

from benchmarks.meta import describe, run_metadata  # noqa: E402
from benchmarks.throughput_runs import (  # noqa: E402
    PHASES, SINGLE_PHASES, checkpoint_write_rate, product, running_ray, single_process, single_process_run,
    startup_times,
)
from core.config import load_config  # noqa: E402

WORKLOADS = {"demo": ("configs/local.yaml", 90), "ref": ("configs/dlrm_ref.yaml", 40)}


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
                results[key].append(single_process_run(config, steps, data["train"].uri, args.set_raw))
            else:
                results[key].append(product(config, steps, n, runs_root / f"{name}-{key}-{pair}", args.set_raw))
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
        k: statistics.median(r["phase_ms"][k] for r in results["single"]) for k in SINGLE_PHASES
    }
    out["single_threads"] = results["single"][0].get("threads")
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
        lines += ["", "Single process per step (ms, median over pairs): "
                  + ", ".join(f"{k} {v:.1f}" for k, v in sp.items()) + f"; **sum {sum(sp.values()):.1f}**.", ""]
    if result.get("startup_s"):
        s = result["startup_s"]
        lines += [
            "## Startup",
            "",
            "`cpr train --config configs/local.yaml` (a fresh process) to its first step:",
            "",
            f"- with its embedded Ray: median **{statistics.median(s):.1f} s** (" + ", ".join(f"{x:.1f}" for x in s) + ");",
        ]
        r = result.get("startup_running_ray_s")
        if r:
            lines.append(f"- against a Ray already running on the machine (`ray start --head`, then `cpr train` with "
                         f"RAY_ADDRESS): first run {r[0]:.1f} s, then median **{statistics.median(r[1:] or r):.1f} s** ("
                         + ", ".join(f"{x:.1f}" for x in r) + ").")
        lines.append("")
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
    parser.add_argument("--set", nargs="*", default=[],
                        help="config overrides for every run, KEY=VALUE (YAML value), as `cpr train --set`")
    parser.add_argument("--startup-reps", type=int, default=3)
    parser.add_argument("--checkpoint-reps", type=int, default=6)
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/throughput.md"))
    parser.add_argument("--single", metavar="CONFIG", help=argparse.SUPPRESS)  # (a) in its own process
    parser.add_argument("--train-uri", help=argparse.SUPPRESS)
    args = parser.parse_args()
    import yaml

    args.set_raw = list(args.set)
    args.set = [(k, yaml.safe_load(v)) for k, v in (kv.split("=", 1) for kv in args.set)]
    if args.single:
        cfg = load_config(ROOT / args.single, dict(args.set))
        print(json.dumps(single_process(cfg, args.train_uri, args.steps)))
        return

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

    for name in args.workloads:
        result["workloads"][name] = run_workload(name, args, runs_root)
        write()
    if args.startup_reps:
        config = str(ROOT / WORKLOADS["demo"][0])
        result["startup_s"] = startup_times(config, args.startup_reps, runs_root, "embedded")
        write()
        from app.rayenv import resources_needed

        cfg = load_config(config)
        with running_ray(max(os.cpu_count() or 1, int(resources_needed(cfg)["CPU"] + 0.999) + 1)) as address:
            result["startup_running_ray_s"] = startup_times(config, args.startup_reps + 1, runs_root, "running", address)
        write()
    if args.checkpoint_reps:
        base = load_config(ROOT / WORKLOADS["demo"][0])
        shard_rows = sum(base.model.rows_per_table) // base.embeddings.num_shards
        result["checkpoint_write"] = checkpoint_write_rate(shard_rows, base.model.embedding_dim, args.checkpoint_reps)
    print(write())


if __name__ == "__main__":
    main()
