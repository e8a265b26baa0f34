"""Startup: seconds from launching ``cpr train`` to its first step, and where they went, for this
checkout and for earlier commits on the same machine, alternated.

Each run is ``python -m app train --config configs/local.yaml`` in a process of its own (5 steps,
no checkpoints, no faults), from the commit's own tree (a ``git worktree`` for an earlier
commit, this venv's packages), with its embedded Ray, and against a Ray already running on the
machine (``ray start --head``, started here as a user starts one, its workers preloading torch
as docs/CLUSTER.md says, then two runs: the first, and the second ``--pause-s`` after the first
ended, as a user's next run comes). A commit's first run (not recorded) generates its synthetic data.
The milestones come from the run's own files: when the driver had its data, when it joined
Ray (its core-worker log), when the shards answered, when the trainers reached their loop and
when step 0 began (the ``training_started`` event; its commit follows within ~0.1 s). Writes
benchmarks/results/startup.json and prints the table (``render``).

    .venv/bin/python benchmarks/startup.py                                # this checkout, 3 reps
    .venv/bin/python benchmarks/startup.py --commits dced4bd 38ca7c3 HEAD --reps 3
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.meta import run_metadata  # noqa: E402
from benchmarks.throughput_runs import running_ray  # noqa: E402

SETS = ["faults=null", "training.max_steps=5", "checkpoint.every_steps=null", "checkpoint.final=false"]
MILESTONES = ("data", "ray", "shards", "trainers", "first_step")
_STAMP = re.compile(r"^\[?(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})")


def _stamp(line: str) -> float | None:
    m = _STAMP.match(line)
    if not m:
        return None
    return datetime.datetime.strptime(m[1], "%Y-%m-%d %H:%M:%S,%f").timestamp()  # local time, as logged


def milestones(run_dir: Path, t0: float) -> dict:
    """Seconds after launch of each milestone the run's files record."""
    out: dict[str, float] = {}
    events = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines() if x.strip()]
    times = {}
    for e in events:
        times.setdefault(e["kind"], []).append(e.get("wall_time") or e.get("time"))
    if times.get("shards_ready"):
        out["shards"] = times["shards_ready"][0] - t0
    if times.get("trainer_started"):
        out["trainers"] = max(times["trainer_started"]) - t0
    out["first_step"] = times["training_started"][0] - t0
    pid = (run_dir / "logs" / "driver.log").read_text().split(" ", 4)[3]  # "<date> <time> <LEVEL> <pid> ..."
    drivers = sorted((run_dir / "logs" / "ray").glob(f"python-core-driver-*_{pid}.log"))
    if drivers:
        first = next((s for s in map(_stamp, drivers[0].open()) if s is not None), None)
        if first is not None:
            out["ray"] = first - t0
    report = run_dir / "report.json"
    if report.exists():
        wall = json.loads(report.read_text()).get("wall_time_s") or {}
        if wall.get("data_prep_s") is not None:
            out["data"] = wall["data_prep_s"]
        out["report_startup_s"] = wall.get("startup_s")
    return {k: round(v, 2) for k, v in out.items() if v is not None}


def one_run(src: Path, run_dir: Path, address: str | None) -> dict:
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", RAY_AUTH_MODE="token", PYTHONPATH=str(src))
    env.pop("RAY_ADDRESS", None)
    if address:
        env["RAY_ADDRESS"] = address
    cmd = [sys.executable, "-m", "app", "train", "--config", "configs/local.yaml", "--no-progress",
           "--set", f"run_dir={run_dir}"] + [a for kv in SETS for a in ("--set", kv)]
    t0 = time.time()
    done = subprocess.run(cmd, cwd=src, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"cpr train at {src} failed ({done.returncode}): {done.stderr[-3000:]}")
    return {"total_s": round(time.time() - t0, 2), **milestones(run_dir, t0)}


def checkout(commit: str, work: Path) -> tuple[str, Path]:
    """(short hash, source tree) of ``commit``: this checkout for HEAD, else a worktree."""
    short = subprocess.run(["git", "rev-parse", "--short", commit], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.strip()
    if commit == "HEAD":
        return short, ROOT
    tree = work / f"tree-{short}"
    if not tree.exists():
        subprocess.run(["git", "worktree", "add", "--detach", str(tree), short], cwd=ROOT, check=True,
                       capture_output=True)
    return short, tree


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--commits", nargs="+", default=["HEAD"])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--modes", nargs="+", default=["embedded", "running"], choices=["embedded", "running"])
    parser.add_argument("--plain-head", action="store_true",
                        help="A plain `ray start --head`, without the warm-cluster settings of docs/CLUSTER.md.")
    parser.add_argument("--pause-s", type=float, default=20.0, help="Between the first and the second run on a running Ray.")
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/startup.json"))
    args = parser.parse_args()
    meta = run_metadata()
    work = Path(tempfile.mkdtemp(prefix="cpr-startup-", dir="/tmp"))
    trees = [checkout(c, work) for c in args.commits]
    results: dict[str, dict[str, list]] = {c: {"embedded": [], "running_first": [], "running_second": []}
                                           for c, _ in trees}
    try:
        for commit, src in trees:  # each commit's data, generated by its first run
            one_run(src, work / f"warm-{commit}", None)
        for rep in range(args.reps):
            order = trees if rep % 2 == 0 else trees[::-1]
            for commit, src in order:
                if "embedded" in args.modes:
                    r = one_run(src, work / f"e-{commit}-{rep}", None)
                    results[commit]["embedded"].append(r)
                    print(f"{commit} embedded {rep}: {r}", flush=True)
                if "running" in args.modes:
                    with running_ray(num_cpus=max(os.cpu_count() or 1, 6), preload=not args.plain_head) as address:
                        for label in ("running_first", "running_second"):
                            if label == "running_second":
                                time.sleep(args.pause_s)
                            r = one_run(src, work / f"{label}-{commit}-{rep}", address)
                            results[commit][label].append(r)
                            print(f"{commit} {label} {rep}: {r}", flush=True)
    finally:
        for commit, src in trees:
            if src != ROOT:
                subprocess.run(["git", "worktree", "remove", "--force", str(src)], cwd=ROOT, capture_output=True)
    out = {"meta": meta, "config": "configs/local.yaml", "sets": SETS, "pause_s": args.pause_s,
           "head": "plain ray start" if args.plain_head else "ray start with docs/CLUSTER.md's warm-cluster settings",
           "results": results}
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(render(out))
    return 0


def _median(runs: list[dict], key: str) -> str:
    xs = [r[key] for r in runs if r.get(key) is not None]
    return f"{statistics.median(xs):.1f}" if xs else "-"


def render(result: dict) -> str:
    """One row a commit and mode: the median seconds after launch of each milestone."""
    rows = ["| commit | Ray | runs | data prep | joined Ray | shards ready | trainers in loop | first step | report's startup_s |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    labels = {"embedded": "embedded", "running_first": "running, 1st run", "running_second": "running, 2nd run"}
    for commit, modes in result["results"].items():
        for mode, runs in modes.items():
            if runs:
                rows.append(f"| `{commit}` | {labels[mode]} | {len(runs)} | " + " | ".join(
                    _median(runs, k) for k in ("data", "ray", "shards", "trainers", "first_step", "report_startup_s")) + " |")
    return "\n".join(rows) + (
        f"\n\nMedian seconds after `cpr train` was launched (data prep: its own seconds; the second run on a "
        f"running Ray {result.get('pause_s', 0):g} s after the first ended; the running Ray: {result.get('head', '')}).\n")


if __name__ == "__main__":
    sys.exit(main())
