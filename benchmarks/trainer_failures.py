"""Trainer failures: cpr's replacement of one trainer against Ray Train's own checkpoint-and-restart.

One schedule of successive trainer kills, two methods on the same config and data. Each kill
comes ``--healthy-s`` seconds after the run is healthy again (every trainer back and steps
advancing), so both methods face the same schedule of failures:
(a) cpr: Ray Train + torchft replace only the dead trainer's replica group; the survivors go on
    with all M microbatches per step and the replacement heals from a live peer;
(b) Ray Train's own mechanism for a plain DDP job (``benchmarks/ddp_baseline.py``): a
    ``TorchTrainer`` with ``FailureConfig(max_failures=...)`` whose workers hold the whole DLRM in
    ``DistributedDataParallel``; a dead worker makes Ray Train restart the whole group, which
    resumes from the last checkpoint (saved every ``--checkpoint-every`` steps, as (a)'s shards).
Each method also runs without failures. Effective throughput: samples of the run's steps per
second from its first step to its last (startup and evaluation excluded for both). Reported: the
ratio a/b of effective throughput under failures, and, since the two architectures differ in
failure-free speed, the share of its own failure-free throughput each method keeps, and their
ratio. Writes benchmarks/results/trainer_failures.md (and .json).

    .venv/bin/python benchmarks/trainer_failures.py
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from core.config import load_config  # noqa: E402


def _healthy(ray, supervisor, killed: list[dict]) -> bool:
    """Training runs, and every trainer killed so far has a replacement that healed."""
    events = ray.get(supervisor.events_since.remote(0), timeout=10)
    if not any(e["kind"] == "training_started" for e in events):
        return False
    heals = [e for e in events if e["kind"] == "trainer_healed"]
    return all(
        any(h["rank"] == int(k["target"].split(":")[1]) and h["time"] > k["time"] for h in heals) for k in killed
    )


def _run(cfg, kills: int, healthy_s: float) -> dict:
    """One cpr training run with ``kills`` trainer failures, trainer ``i % n`` the i-th."""
    import time

    import ray
    from ray._common.test_utils import wait_for_condition

    from app.chaos import kill_target
    from app.job import TrainingJob

    job = TrainingJob(cfg, show_progress=False)
    try:
        job.start()
        training = job.fit_in_background()
        killed: list[dict] = []
        n = cfg.training.num_trainers
        for i in range(kills):
            wait_for_condition(lambda: _healthy(ray, job.supervisor, killed), timeout=600, retry_interval_ms=100)
            time.sleep(healthy_s)
            if not training.is_alive():
                break
            killed.append(kill_target(job.supervisor, f"trainer:{i % n}"))
        training.join()
        report = job.finish()
    finally:
        job.close()
    return {
        "effective_samples_per_s": report["samples_trained"] / report["wall_time_s"]["training_s"],
        "training_s": report["wall_time_s"]["training_s"],
        "steps": report["steps"],
        "trainer_kills": len(report["trainer_failures"]),
        "fallbacks": [e["fallback_step"] for e in report["all_trainers_failed"]],
        "steps_with_fewer_trainers": report["steps_with_fewer_trainers"],
        "microbatches_per_committed_step": report["microbatches_per_committed_step"],
        "auc": report["auc"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(ROOT / "configs/local.yaml"))
    parser.add_argument("--rows", type=int, default=400_000)
    parser.add_argument("--kills", type=int, default=2)
    parser.add_argument("--healthy-s", type=float, default=4.0)
    parser.add_argument("--checkpoint-every", type=int, default=20)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/trainer_failures.md"))
    args = parser.parse_args()

    import ray

    from core.data import generate
    from app.rayenv import connect_ray
    from benchmarks.ddp_baseline import run_ddp

    base = load_config(args.config)
    root = Path(tempfile.mkdtemp(prefix="cpr-bench-tf-"))
    data = generate(str(root / "data"), args.rows, args.rows // 10, seed=0)
    runs = [(m, k) for m in ("a_cpr", "b_ray_train_ddp") for k in (0, args.kills)]
    results: dict[str, list[dict]] = {f"{m}/{k}": [] for m, k in runs}
    connect_ray(base)
    for rep in range(args.reps):
        for method, kills in runs:
            cfg = base.model_copy(
                update={
                    "run_dir": str(root / f"{method}-{kills}-{rep}"),
                    "data": base.data.model_copy(
                        update={"train": [data.train_path], "eval": [data.eval_path], "cache_dir": str(root / "cache"), "generate": None}
                    ),
                    "checkpoint": base.checkpoint.model_copy(update={"every_steps": args.checkpoint_every}),
                    "faults": None,
                }
            )
            if method == "a_cpr":
                r = _run(cfg, kills, args.healthy_s)
            else:
                d = run_ddp(cfg, kills, args.healthy_s, args.checkpoint_every, Path(cfg.run_dir))
                r = {
                    "effective_samples_per_s": d["effective_samples_per_s_from_first_step"],
                    "training_s": d["training_from_first_step_s"], "steps": d["steps"],
                    "trainer_kills": d["trainer_kills"], "restarts": d["restarts"], "lost_steps": d["lost_steps"],
                    "startup_s": d["startup_s"], "auc": d["auc"],
                }
            results[f"{method}/{kills}"].append(r)
            print(f"rep {rep} {method} kills={kills}: {r['effective_samples_per_s']:,.0f} samples/s, training "
                  f"{r['training_s']:.1f}s, kills {r['trainer_kills']}, AUC {r['auc']:.4f}", flush=True)
    ray.shutdown()

    med = {key: statistics.median(x["effective_samples_per_s"] for x in rs) for key, rs in results.items()}
    a, b = med[f"a_cpr/{args.kills}"], med[f"b_ray_train_ddp/{args.kills}"]
    keep_a, keep_b = a / med["a_cpr/0"], b / med["b_ray_train_ddp/0"]
    out = {
        "command": "python benchmarks/trainer_failures.py " + " ".join(sys.argv[1:]),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
        "schedule": f"{args.kills} trainer kills, each {args.healthy_s}s after the run is healthy again; "
        f"checkpoints every {args.checkpoint_every} steps",
        "results": results,
        "median_effective_samples_per_s": med,
        "ratio_a_over_b": a / b,
        "kept_of_failure_free": {"a": keep_a, "b": keep_b},
        "ratio_of_kept": keep_a / keep_b,
    }
    names = {
        "a_cpr": "(a) cpr: the dead trainer's replica group is replaced, the survivors go on",
        "b_ray_train_ddp": "(b) Ray Train TorchTrainer, plain DDP, FailureConfig: the whole group restarts from the last checkpoint",
    }
    lines = [
        "# Trainer failures: cpr (replace one trainer) vs Ray Train's checkpoint-and-restart of a DDP group",
        "",
        f"`{out['command']}` on {out['machine']}; config `{Path(args.config).name}` (2 trainers; cpr with 2 shards) on "
        f"{args.rows:,} synthetic rows, 1 epoch; {out['schedule']}; median of {args.reps}. Effective throughput: the "
        "run's samples per second from its first step to its last.",
        "",
        "| method | kills | effective samples/s (median) | per rep | training s | restarts of the whole group | steps redone | AUC |",
        "|---|---:|---:|---|---|---|---|---|",
    ]
    for m, k in runs:
        rs = results[f"{m}/{k}"]
        lines.append(
            f"| {names[m]} | {k} | {med[f'{m}/{k}']:,.0f} | " + ", ".join(f"{r['effective_samples_per_s']:,.0f}" for r in rs)
            + " | " + ", ".join(f"{r['training_s']:.1f}" for r in rs)
            + " | " + ", ".join(str(r.get("restarts", len(r.get("fallbacks", [])))) for r in rs)
            + " | " + ", ".join(str(r.get("lost_steps", "-")) for r in rs)
            + " | " + ", ".join(f"{r['auc']:.4f}" for r in rs) + " |"
        )
    lines += [
        "",
        f"**Ratio a/b of effective throughput under {args.kills} failures: {a / b:.2f}x** (ReCoVer reports 2.23x over "
        "checkpoint-restart at 512 GPUs).",
        f"Share of its own failure-free throughput each keeps: (a) {keep_a:.0%}, (b) {keep_b:.0%}; ratio "
        f"**{keep_a / keep_b:.2f}x**. The failure-free speeds differ by architecture (cpr's shards against DDP's "
        "replicated tables), which the second ratio takes out.",
        "",
    ]
    Path(args.out).write_text("\n".join(lines))
    Path(args.out).with_suffix(".json").write_text(json.dumps(out, indent=2))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
