"""Resharding by stop and resume: what a change of the number of shards costs today.

A run on 2 row-wise shards is killed (with its driver, SIGKILL) once its checkpoint of step 40
is committed; a copy of its run directory is then resumed on 3 shards
(``cpr train --resume RUN_DIR --set embeddings.num_shards=3``: each shard of the new plan reads
its rows from the checkpoint's files that hold them) and another copy on its own 2 shards (the
control: the same path without a plan change). This is the path a TorchRec user has (stop,
save, restart with the new world size, load) in our own product; an online move (issue 44)
is measured against it. For each table size (about 100 MB and 1 GB a shard at 2 shards), per
resume: seconds from launching the resume to its first step, the shards' load time (the
slowest), bytes loaded, rows and bytes read from another shard's file, and the steps redone
(from the checkpoint to where the killed run was).

    .venv/bin/python benchmarks/reshard.py                 # writes benchmarks/results/reshard.json
    .venv/bin/python benchmarks/reshard.py --render        # the table from the results file
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.meta import describe, run_metadata  # noqa: E402

# Read when Ray is imported: token authentication on, gloo on the loopback (as the tests' Ray).
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
os.environ.setdefault("RAY_AUTH_MODE", "token")

OUT = ROOT / "benchmarks" / "results" / "reshard.json"
DIM = 16
# Rows per table for about 100 MB and 1 GB of weights and row-wise Adagrad state a shard, at 2 shards.
SIZES = {"100MB": 113_000, "1GB": 1_130_000}
KILL_AT = 40


def _config(run_dir: Path, data: Path, rows: int) -> dict:
    return {
        "run_dir": str(run_dir),
        "seed": 1,
        "data": {"train": [str(data / "train.tsv")], "eval": [str(data / "eval.tsv")],
                 "generate": {"train_rows": 30_000, "eval_rows": 4_000, "seed": 1, "format": "tsv", "vocab_rows": 5_000}},
        "model": {"embedding_dim": DIM, "table_rows": rows, "dense_arch": [64, DIM], "over_arch": [64, 1]},
        "embeddings": {"num_shards": 2, "sharding": "row_wise", "spares": 0},
        "training": {"num_trainers": 2, "microbatch_rows": 128, "microbatches_per_step": 4, "epochs": 1},
        "checkpoint": {"every_steps": 20, "keep_last": 5},
        "faults": {"max_failures": 0},
        "ray": {"warm_pool_s": 0},  # each resume starts its processes itself, as the first one would
    }


def _env() -> dict:
    """The drivers join this process's Ray (``_start_ray``), as ``cpr train`` joins a cluster."""
    import ray

    return dict(os.environ, RAY_ADDRESS=ray.get_runtime_context().gcs_address)


def _start_ray():
    """A local Ray of this process's own, as the tests start theirs: 127.0.0.1, token auth."""
    import ray

    from app.rayenv import embedded_system_config, keep_ray_on_loopback, ray_system_config, worker_env

    keep_ray_on_loopback()
    os.environ.update(worker_env())
    ray.init(_node_ip_address="127.0.0.1", num_cpus=8, namespace="cpr", include_dashboard=False,
             _system_config={**ray_system_config(), **embedded_system_config(8)})
    return ray


def _events(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines() if x.strip()]


def _committed(run_dir: Path) -> list[int]:
    root = run_dir / "checkpoints"
    return sorted(int(p.name.split("-")[1]) for p in root.glob("ckpt-*") if (p / "manifest.json").exists()) \
        if root.exists() else []


def _killed_run(work: Path, rows: int) -> tuple[Path, int]:
    """A run killed with its driver after its checkpoint of step ``KILL_AT``: (its directory,
    the last step its trainers committed)."""
    run_dir, cfg = work / "killed", work / "c.yaml"
    cfg.write_text(yaml.safe_dump(_config(run_dir, work / "data", rows)))
    log = open(work / "killed.out", "w")
    proc = subprocess.Popen([sys.executable, "-m", "app", "train", "--no-progress", "--config", str(cfg)], cwd=ROOT,
                            env=_env(), stdout=log, stderr=subprocess.STDOUT)
    deadline = time.time() + 900
    while KILL_AT not in _committed(run_dir):
        if proc.poll() is not None or time.time() > deadline:
            raise RuntimeError(f"the first run ended before checkpoint {KILL_AT}: {(work / 'killed.out').read_text()[-2000:]}")
        time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)  # the driver; its trainers go with it, its detached shards stay
    proc.wait()
    log.close()
    progress = [json.loads(x) for x in (run_dir / "progress.jsonl").read_text().splitlines() if x.strip()]
    return run_dir, max((p["step"] for p in progress), default=KILL_AT)


def _resume(killed: Path, work: Path, shards: int) -> dict:
    run_dir = work / f"resumed-{shards}"
    shutil.copytree(killed, run_dir, symlinks=True)
    for name in ("config.yaml",):  # the copy's own run_dir
        cfg = yaml.safe_load((run_dir / name).read_text())
        cfg["run_dir"] = str(run_dir)
        cfg["checkpoint"]["storage"] = None
        (run_dir / name).write_text(yaml.safe_dump(cfg, sort_keys=False))
    t0 = time.time()
    done = subprocess.run([sys.executable, "-m", "app", "train", "--no-progress", "--resume", str(run_dir),
                           "--set", f"embeddings.num_shards={shards}"], cwd=ROOT, env=_env(), capture_output=True,
                          text=True)
    if done.returncode != 0:
        raise RuntimeError(f"the resume on {shards} shards failed: {done.stderr[-3000:]}")
    events = [e for e in _events(run_dir) if e.get("time", 0) >= t0]
    first = next(e for e in events if e["kind"] == "training_started")
    resumed = next(e for e in events if e["kind"] == "resumed")
    changed = next((e for e in events if e["kind"] == "plan_changed"), None)
    return {
        "shards": shards,
        "first_step_s": round(first["time"] - t0, 2),
        "load_s": resumed.get("load_s"),
        "bytes_loaded": resumed.get("bytes_loaded"),
        "rows_moved": changed["rows_moved"] if changed else 0,
        "bytes_moved": changed["bytes_moved"] if changed else 0,
        "resumed_at": resumed["step"],
        "total_s": round(time.time() - t0, 2),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--render", action="store_true", help="print the table from the results file")
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    args = parser.parse_args()
    if args.render:
        print(render(json.loads(OUT.read_text())))
        return 0
    result = {"meta": run_metadata(), "kill_at_checkpoint": KILL_AT, "sizes": []}
    ray = _start_ray()
    try:
        measure(args.sizes, result)
    finally:
        ray.shutdown()
    OUT.write_text(json.dumps(result, indent=2) + "\n")
    print(render(result))
    return 0


def measure(sizes: list[str], result: dict) -> None:
    for size in sizes:
        with tempfile.TemporaryDirectory(prefix="cpr-reshard-") as tmp:
            work = Path(tmp)
            killed, reached = _killed_run(work, SIZES[size])
            runs = [_resume(killed, work, shards) for shards in (3, 2)]
            result["sizes"].append({"size": size, "rows_per_table": SIZES[size], "killed_after_step": reached,
                                    "resumes": runs})
            print(json.dumps(result["sizes"][-1]), flush=True)


def render(result: dict) -> str:
    lines = [f"Rendered from `benchmarks/results/reshard.json`: {describe(result['meta'])}.", "",
             "| shard size (2 shards) | resumed on | launch to first step | shards' load | loaded | read from another shard's file | steps redone (at least) |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for s in result["sizes"]:
        for r in s["resumes"]:
            lines.append(
                f"| {s['size']} ({s['rows_per_table']:,} rows a table) | {r['shards']} shards | {r['first_step_s']:.1f} s "
                f"| {r['load_s']:.2f} s | {r['bytes_loaded'] / 1e9:.2f} GB | {r['bytes_moved'] / 1e9:.2f} GB "
                f"| {s['killed_after_step'] - r['resumed_at']} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
