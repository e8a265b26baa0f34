"""What ``cpr verify --replay`` costs and finds on the shipped configs: each config trained as
a user runs it (``cpr train`` in its own process, the audit log on, every checkpoint kept),
then replayed (``cpr verify --replay``, its own process); the replay's wall time against the
run's, and whether every checkpoint and every step's digests matched bit for bit.

Workloads: ``demo`` (configs/local.yaml, the README's main job with its trainer killed at
step 30 and a shard at 65: a heal and a partial recovery) and ``ref`` (configs/dlrm_ref.yaml:
the DLRM paper's Kaggle-sized dense part, 8,192 samples a step, failure-free).

    .venv/bin/python benchmarks/replay.py --out benchmarks/results/replay.json
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.meta import describe, run_metadata  # noqa: E402

WORKLOADS = {"demo": ("configs/local.yaml", None), "ref": ("configs/dlrm_ref.yaml", 40)}
AUDITED = ["audit_log=true", "checkpoint.keep_last=1000"]
_LINE = re.compile(r"^replay: (\d+) steps, (\d+) checkpoints match (bit for bit|within tolerance) \(([\d.]+) s\)$")


def run_workload(name: str, runs: Path) -> dict:
    config, steps = WORKLOADS[name]
    run_dir = runs / name
    shutil.rmtree(run_dir, ignore_errors=True)
    sets = [f"run_dir={run_dir}", *AUDITED] + ([f"training.max_steps={steps}"] if steps else [])
    train = [sys.executable, "-m", "app", "train", "--config", config, "--no-progress"]
    for s in sets:
        train += ["--set", s]
    t0 = time.perf_counter()
    done = subprocess.run(train, cwd=ROOT, capture_output=True, text=True)
    train_wall = time.perf_counter() - t0
    if done.returncode != 0:
        raise SystemExit(f"{name}: cpr train failed ({done.returncode}): {done.stderr[-2000:]}")
    report = json.loads((run_dir / "report.json").read_text())
    t0 = time.perf_counter()
    checked = subprocess.run([sys.executable, "-m", "app", "verify", "--replay", str(run_dir)], cwd=ROOT,
                             capture_output=True, text=True)
    replay_wall = time.perf_counter() - t0
    line = next((m for m in map(_LINE.match, checked.stdout.splitlines()) if m), None)
    return {
        "config": config, "overrides": sets[1:], "steps": report["steps"],
        "samples_per_step": report["samples_trained"] // max(report["steps"], 1),
        "failures": [f"{f['actor']} ({f['recovery']})" for f in report.get("failures", [])],
        "train_wall_s": round(train_wall, 1), "training_s": report.get("wall_time_s", {}).get("training_s"),
        "verify_exit": checked.returncode, "replay_wall_s": round(replay_wall, 1),
        "replayed_steps": int(line.group(1)) if line else None,
        "checkpoints_matched": int(line.group(2)) if line else None,
        "bit_for_bit": bool(line) and line.group(3) == "bit for bit",
        "replay_s": float(line.group(4)) if line else None,
        "violations": [x for x in checked.stdout.splitlines() if x.startswith("violation:")][:10],
    }


def render(doc: dict) -> str:
    out = [f"# `cpr verify --replay` on the shipped configs", "",
           f"Rendered from `{doc['file']}`: {describe(doc['meta'])}.", "",
           "| workload | config | steps | samples/step | failures in the run | training s (run wall s) | "
           "replay s (verify --replay wall s) | checkpoints matched | bit for bit | exit |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for name, w in doc["workloads"].items():
        out.append(f"| {name} | `{w['config']}` | {w['steps']} | {w['samples_per_step']:,} | "
                   f"{', '.join(w['failures']) or '-'} | {w['training_s']} ({w['train_wall_s']}) | "
                   f"{w['replay_s']} ({w['replay_wall_s']}) | {w['checkpoints_matched']} | {w['bit_for_bit']} | "
                   f"{w['verify_exit']} |")
    return "\n".join(out) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", nargs="*", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--runs", default="/tmp/cpr-replay-bench", help="where the runs go (deleted first)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/replay.json"))
    args = parser.parse_args()
    doc = {"meta": run_metadata(), "file": Path(args.out).name, "workloads": {}}
    for name in args.workloads:
        doc["workloads"][name] = run_workload(name, Path(args.runs))
        print(json.dumps({name: doc["workloads"][name]}), flush=True)
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    Path(args.out).with_suffix(".md").write_text(render(doc))
    print(render(doc))


if __name__ == "__main__":
    main()
