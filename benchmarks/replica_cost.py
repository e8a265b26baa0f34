"""What keeping mirrors costs a run without failures: `recovery: replica` against `partial` on
the same config, each a `python -m app train` of its own (as a user runs it), alternating
(partial-replica, then replica-partial), one trainer, no checkpoints. Training-phase samples/s
and its ratio per pair, the phases of a step, the time the trainers waited for the mirrors on
each step and the mirrors' memory, from each run's report.

    .venv/bin/python benchmarks/replica_cost.py --pairs 3        # about 8 minutes here

Writes benchmarks/results/replica_cost.md (and .json); docs/RESULTS.md renders it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.meta import describe, run_metadata  # noqa: E402
from benchmarks.throughput_runs import PHASES, product  # noqa: E402

WORKLOADS = {"ref": ("configs/dlrm_ref.yaml", 40), "demo": ("configs/local.yaml", 90)}
MODES = ("partial", "replica")


def _one(config: str, steps: int, run_dir: Path, mode: str, sets: list[str]) -> dict:
    r = product(config, steps, 1, run_dir, [*sets, f"recovery={mode}"])
    report = json.loads((run_dir / "report.json").read_text())
    return {**r, "mirrors": report.get("mirrors")}


def run_workload(name: str, pairs: int, sets: list[str], root: Path) -> dict:
    config, steps = WORKLOADS[name]
    runs: dict[str, list[dict]] = {m: [] for m in MODES}
    for pair in range(pairs):
        for mode in MODES if pair % 2 == 0 else reversed(MODES):
            runs[mode].append(_one(str(ROOT / config), steps, root / f"{name}-{mode}-{pair}", mode, sets))
        print(f"{name} pair {pair}: " + ", ".join(f"{m} {runs[m][-1]['samples_per_s']:,.0f}" for m in MODES)
              + " samples/s", flush=True)
    ratios = [b["samples_per_s"] / a["samples_per_s"] for a, b in zip(runs["partial"], runs["replica"])]
    feeds = [r["mirrors"]["feed_s_per_step"] for r in runs["replica"] if r["mirrors"] and r["mirrors"]["feed_s_per_step"]]
    return {
        "config": config, "steps": steps, "runs": runs, "ratio_per_pair": ratios, "ratio_median": statistics.median(ratios),
        "median_samples_per_s": {m: statistics.median(r["samples_per_s"] for r in runs[m]) for m in MODES},
        "phase_ms": {m: {k: statistics.median(r["phase_ms"][k] for r in runs[m]) for k in PHASES} for m in MODES},
        "feed_ms_per_step": 1e3 * statistics.median(feeds) if feeds else None,
        "mirror_memory_bytes": runs["replica"][0]["mirrors"]["memory_bytes"],
    }


def render(result: dict) -> str:
    meta = result.get("meta")
    lines = [
        "# What mirrors cost a run without failures",
        "",
        f"Rendered from `replica_cost.json`: {describe(meta) if meta else 'not recorded'}.",
        "",
        "`recovery: replica` against `partial` on the same config, each run a `python -m app train` of its own, "
        f"alternating; one trainer, 2 shards, no checkpoints; {result['pairs']} pairs, medians.",
        "",
        "| workload | partial samples/s | replica samples/s | replica / partial (per pair) | waited for mirrors a step "
        "| mirrors' memory |",
        "|---|---:|---:|---|---:|---:|",
    ]
    for name, w in result["workloads"].items():
        per = ", ".join(f"{x:.3f}" for x in w["ratio_per_pair"])
        feed = f"{w['feed_ms_per_step']:.1f} ms" if w["feed_ms_per_step"] is not None else "n/a"
        lines.append(f"| {name} (`{Path(w['config']).name}`, {w['steps']} steps) | "
                     f"{w['median_samples_per_s']['partial']:,.0f} | {w['median_samples_per_s']['replica']:,.0f} | "
                     f"**{w['ratio_median']:.3f}** ({per}) | {feed} | {w['mirror_memory_bytes'] / 1e6:,.0f} MB |")
    lines += ["", "Per step (ms, medians; the saving trainer's timers):", "",
              "| workload | mode | " + " | ".join(PHASES) + " |", "|---|---|" + "---:|" * len(PHASES)]
    for name, w in result["workloads"].items():
        for mode in MODES:
            lines.append(f"| {name} | {mode} | " + " | ".join(f"{w['phase_ms'][mode][k]:.1f}" for k in PHASES) + " |")
    lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", nargs="*", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--set", nargs="*", default=[], help="config overrides for every run, KEY=VALUE")
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/replica_cost.md"))
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="cpr-bench-replica-"))
    result = {"meta": run_metadata(), "pairs": args.pairs, "workloads": {}}
    out = Path(args.out)
    for name in args.workloads:
        result["workloads"][name] = run_workload(name, args.pairs, list(args.set), root)
        out.with_suffix(".json").write_text(json.dumps(result, indent=2))
    text = render(result)
    out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
