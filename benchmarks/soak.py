"""Soak: train under random SIGKILLs of shards, trainers, every trainer and the supervisor
(plus kills aimed at a save and at a recovery), then check the run's invariants from its
files. Writes benchmarks/results/soak.md and soak.json.

    .venv/bin/python benchmarks/soak.py --seeds 0 1 2 --kills 20 --mtbf 6
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.soak import run_soak  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/soak.yaml")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--kills", type=int, default=20)
    p.add_argument("--mtbf", type=float, default=6.0)
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args()
    rows = []
    for seed in args.seeds:
        t0 = time.time()
        result = run_soak(args.config, f"runs/soak-{seed}", seed, args.kills, args.mtbf)
        result["wall_s"] = round(time.time() - t0, 1)
        rows.append(result)
        print(json.dumps({k: v for k, v in result.items() if k != "violations"}), result["violations"][:5], flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "soak.json").write_text(json.dumps(rows, indent=1))
    cmd = " ".join(["python", "benchmarks/soak.py", "--seeds", *map(str, args.seeds), "--kills", str(args.kills),
                    "--mtbf", str(args.mtbf)])
    lines = [
        "# Soak: random SIGKILLs of every kind, invariants checked from the run's files", "",
        f"Command: `{cmd}` (2-core development machine)", "",
        "| seed | kills injected | shard recoveries | trainer kills | supervisor restarts | every-trainer fallbacks "
        "| finished | wedged | invariant violations | PLS | AUC | wall s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['seed']} | {r['kills']} | {r['shard_recoveries']} | {r['trainer_kills']} | {r['supervisor_restarts']} "
            f"| {r['fallbacks']} | {r['finished']} | {r['wedged']} | {len(r['violations'])} | {r['pls']:.5f} "
            f"| {r['auc'] if r['auc'] is None else round(r['auc'], 4)} | {r['wall_s']} |"
        )
    (out / "soak.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
