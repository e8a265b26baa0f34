"""CPR's trade-off: checkpoint overhead vs portion of lost samples (PLS) vs held-out AUC.

Every combination of row policy (full, MFU, SSU) and recovery mode (partial, full) trains on
the same data and config and faces the same failures: embedding shards are SIGKILLed when
training reaches fixed steps. A failure-free run with full saves is the AUC reference.
Per run it records the overhead split (save, tracking, load, lost computation, rescheduling,
as % of wall time), the realized PLS and the AUC. Writes benchmarks/results/cpr_tradeoff.md
(and .json).

    .venv/bin/python benchmarks/cpr_tradeoff.py
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from app.config import load_config  # noqa: E402

OVERHEADS = ("save", "tracking", "load", "lost_computation", "rescheduling")


def _run(cfg, kill_steps: list[int]) -> dict:
    """One run; shard ``i % num_shards`` is killed once training reaches ``kill_steps[i]``."""
    import ray
    from ray._common.test_utils import wait_for_condition

    from app.chaos import kill_target
    from app.job import TrainingJob

    def reached(step: int) -> bool:
        p = ray.get(job.supervisor.progress.remote(), timeout=10)
        return p is not None and p["step"] >= step

    job = TrainingJob(cfg, show_progress=False)
    try:
        job.start()
        training = job.fit_in_background()
        for i, step in enumerate(kill_steps):
            wait_for_condition(lambda: reached(step) or not training.is_alive(), timeout=600, retry_interval_ms=50)
            if not training.is_alive():
                break
            kill_target(job.supervisor, f"shard:{i % cfg.embeddings.num_shards}")
        training.join()
        report = job.finish()
    finally:
        job.close()
    pct = report["overhead_pct_of_wall"]
    return {
        "auc": report["auc"],
        "pls": report["pls"],
        "failures": len(report["failures"]),
        "overhead_pct": {k: pct.get(k, 0.0) for k in OVERHEADS},
        "overhead_total_pct": round(sum(pct.get(k, 0.0) for k in OVERHEADS), 2),
        "checkpoints": report["checkpoints_saved"],
        "incremental": report["incremental_checkpoints"],
        "wall_s": report["wall_time_s"]["total_s"],
        "training_s": report["wall_time_s"]["training_s"],
        "steps": report["steps"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(ROOT / "configs/local.yaml"))
    parser.add_argument("--rows", type=int, default=400_000)
    parser.add_argument("--every-steps", type=int, default=40, help="full-save interval; MFU/SSU save r times it")
    parser.add_argument("--r", type=float, default=0.25)
    parser.add_argument("--full-every", type=int, default=4)
    parser.add_argument("--kill-steps", default="60,130", help="steps at which shards 0,1,0,... die")
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/cpr_tradeoff.md"))
    args = parser.parse_args()
    kill_steps = [int(s) for s in args.kill_steps.split(",") if s]

    import ray

    from app.data import generate
    from app.job import connect_ray

    base = load_config(args.config)
    root = Path(tempfile.mkdtemp(prefix="cpr-bench-cpr-"))
    data = generate(str(root / "data"), args.rows, args.rows // 10, seed=0)
    runs = [("full", "partial", []), *[(p, m, kill_steps) for m in ("partial", "full") for p in ("full", "mfu", "ssu")]]
    results = []
    connect_ray(base)
    for policy, recovery, kills in runs:
        name = f"{policy}-{recovery}-{'kills' if kills else 'clean'}"
        cfg = base.model_copy(
            update={
                "run_dir": str(root / name),
                "data": base.data.model_copy(
                    update={"train": [data.train_path], "eval": [data.eval_path], "cache_dir": str(root / "cache"), "generate": None}
                ),
                "checkpoint": base.checkpoint.model_copy(
                    update={
                        "every_steps": args.every_steps, "policy": policy, "r": args.r,
                        "full_every": args.full_every, "keep_last": 100,
                    }
                ),
                "training": base.training.model_copy(update={"progress_every_steps": 1}),
                "recovery": recovery,
                "faults": None,
            }
        )
        r = {"policy": policy, "recovery": recovery, "kill_steps": kills, **_run(cfg, kills)}
        results.append(r)
        print(f"{name}: AUC {r['auc']:.4f}, PLS {r['pls']:.5f}, overhead {r['overhead_total_pct']:.2f}% "
              f"{r['overhead_pct']}, checkpoints {r['checkpoints']} ({r['incremental']} incremental)", flush=True)
    ray.shutdown()

    ref = results[0]["auc"]
    out = {
        "command": "python benchmarks/cpr_tradeoff.py " + " ".join(sys.argv[1:]),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
        "results": results,
    }
    lines = [
        "# CPR trade-off: checkpoint overhead vs PLS vs AUC",
        "",
        f"`{out['command']}` on {out['machine']}; config `{Path(args.config).name}` (2 trainers, 2 shards, table_wise) "
        f"on {args.rows:,} synthetic rows, 1 epoch. Full saves every {args.every_steps} steps; MFU/SSU save r={args.r} "
        f"of a shard's rows every {max(1, round(args.every_steps * args.r))} steps, every {args.full_every}th save full. "
        f"Failures: shards killed at steps {kill_steps}. One run per row; AUC delta against the failure-free run.",
        "",
        "| policy | recovery | failures | PLS | AUC | AUC delta | overhead % of wall (total) | save | tracking | load | lost computation | rescheduling | checkpoints (incremental) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in results:
        o = r["overhead_pct"]
        lines.append(
            f"| {r['policy']} | {r['recovery'] if r['kill_steps'] else '(no failure)'} | {r['failures']} | {r['pls']:.5f} "
            f"| {r['auc']:.4f} | {r['auc'] - ref:+.4f} | {r['overhead_total_pct']:.2f} | {o['save']:.2f} | {o['tracking']:.2f} "
            f"| {o['load']:.2f} | {o['lost_computation']:.2f} | {o['rescheduling']:.2f} | {r['checkpoints']} ({r['incremental']}) |"
        )
    lines.append("")
    Path(args.out).write_text("\n".join(lines))
    Path(args.out).with_suffix(".json").write_text(json.dumps(out, indent=2))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
