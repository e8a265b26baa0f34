"""What issue 42's checks cost, against the commit before them: building a store in one
process (its chunks hashed as they are parsed, each input's ends read for the key), finding a
store to reuse, and the report's ``startup_s`` of a short ``cpr train`` (the start now checks
the places it writes and the inputs before anything else).

Each commit runs from a checkout of its own (``git worktree``, this repository's ``.venv``),
each measurement in a process of its own, the two commits alternated; the store's input is
synthetic data written once (``--rows``). Writes ``--out`` (JSON: the meta, every sample and
the medians).

    .venv/bin/python benchmarks/store_checks.py --before df62b36 --out benchmarks/results/store_checks.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.meta import ROOT, run_metadata  # noqa: E402

# One build and one reuse, in the checkout given: its own packages come first on the path.
_BUILD = """
import json, sys, time
sys.path.insert(0, sys.argv[1])
from app.dataengines import LocalEngine
from app.dataprep import prepare_data
from core.config import config_from_dict
cfg = config_from_dict({"run_dir": sys.argv[2] + "/run", "model": {"table_rows": 100000},
    "data": {"train": [sys.argv[3] + "/train.tsv"], "eval": [sys.argv[3] + "/eval.tsv"], "cache_dir": sys.argv[2]},
    "training": {"microbatch_rows": 512}})
t = time.perf_counter(); prepare_data(cfg, LocalEngine()); built = time.perf_counter() - t
t = time.perf_counter(); prepare_data(cfg, LocalEngine()); reused = time.perf_counter() - t
print(json.dumps({"build_s": built, "reuse_s": reused}))
"""


def _checkout(rev: str, where: Path) -> Path:
    tree = where / rev
    subprocess.run(["git", "worktree", "add", "-q", "--detach", str(tree), rev], cwd=ROOT, check=True)
    (tree / ".venv").symlink_to(ROOT / ".venv")
    return tree


def _build(tree: Path, data: Path, scratch: Path) -> dict:
    with tempfile.TemporaryDirectory(dir=scratch) as cache:
        out = subprocess.run([sys.executable, "-c", _BUILD, str(tree), cache, str(data)], cwd=tree, check=True,
                             capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _startup(tree: Path, data: Path, cache: Path, scratch: Path) -> float:
    """``startup_s`` of the report of a 5-step run of configs/local.yaml without its kills."""
    with tempfile.TemporaryDirectory(dir=scratch) as runs:
        run_dir = Path(runs) / "run"
        sets = [f"run_dir={run_dir}", f"data.train=[{data}/train.tsv]", f"data.eval=[{data}/eval.tsv]",
                f"data.cache_dir={cache}", "training.max_steps=5", "faults.at_steps={}", "checkpoint.every_steps=null"]
        argv = [sys.executable, "-m", "app", "train", "--no-progress", "--config", "configs/local.yaml"]
        subprocess.run(argv + [a for s in sets for a in ("--set", s)], cwd=tree, check=True, capture_output=True,
                       env={"PATH": "/usr/bin:/bin", "HOME": runs, "RAY_AUTH_MODE": "token", "GLOO_SOCKET_IFNAME": "lo"})
        return json.loads((run_dir / "report.json").read_text())["wall_time_s"]["startup_s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", default="df62b36", help="the commit before the change")
    ap.add_argument("--rows", type=int, default=2_000_000, help="training rows of the store's input")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/store_checks.json"))
    args = ap.parse_args()
    meta = run_metadata()
    after = meta["commit"]
    with tempfile.TemporaryDirectory(prefix="store-checks-") as tmp:
        scratch = Path(tmp)
        data = scratch / "data"
        subprocess.run([str(ROOT / ".venv/bin/cpr"), "datagen", "--rows", str(args.rows), "--eval-rows", "1000",
                        "--out", str(data)], check=True, capture_output=True)
        trees = {"before": _checkout(args.before, scratch), "after": _checkout(after.removesuffix("+dirty"), scratch)}
        try:
            samples: dict[str, dict[str, list[float]]] = {k: {"build_s": [], "reuse_s": [], "startup_s": []}
                                                          for k in trees}
            caches = {k: scratch / f"cache-{k}" for k in trees}
            for k, tree in trees.items():  # each commit's store built once, outside the samples
                _startup(tree, data, caches[k], scratch)
            for _ in range(args.reps):
                for k, tree in trees.items():
                    for name, value in _build(tree, data, scratch).items():
                        samples[k][name].append(round(value, 4))
                    samples[k]["startup_s"].append(_startup(tree, data, caches[k], scratch))
        finally:
            for tree in trees.values():
                subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT, check=False)
    doc = {"meta": meta, "before": args.before, "rows": args.rows, "samples": samples,
           "median": {k: {n: statistics.median(v) for n, v in s.items()} for k, s in samples.items()}}
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps(doc["median"], indent=1))


if __name__ == "__main__":
    main()
