"""Data preprocessing: the microbatch store built from a Criteo-Kaggle-sized TSV, by Ray Data
and by one process, against a plain pyarrow read of the same file.

Synthetic Criteo data (``core.data.generate``, by default the 45,840,617 rows of the real
Criteo Kaggle train file) is written once into ``--workdir`` and reused while its rows and
seed are the same. Each measurement runs in a process of its own, which reports its own
peak RSS (VmHWM), with a fresh ``data.cache_dir`` so that no store is reused:

- ``pyarrow_read``: the plain read the targets compare against: ``pyarrow.csv.open_csv`` of the
  train TSV with pyarrow's defaults (types inferred: integers as int64, the hex columns as
  strings), multithreaded, streamed, the batches dropped; ``pyarrow_read_strings`` the same
  with every column a string, as the product's reader reads it (the tokenizing alone);
- ``one_process``: ``build_stores`` with ``LocalEngine`` (every task in this process, no Ray);
- ``ray_data``: ``build_stores`` with Ray Data on an embedded Ray holding every CPU: the
  driver's peak RSS (Ray's workers not counted), and each host's peak worker RSS;
- ``first_step``: ``cpr train`` on the same data (fresh cache, a small model, 1 step) from
  its launch to its first committed step (the run's trainer_book.jsonl), with the run's own
  wall-time split (report.json).

rows/s and seconds are those of the train store (the eval store is recorded beside them).
A worker's peak RSS is the product's own figure (StoreInfo.build["hosts"], ``ru_maxrss`` of the
task's process). Disk: the TSV (about 257 bytes a row) and one store at a time (about 165
bytes a row, removed after its section): some 20 GB at the full size.
Then the issue's targets, from the measurements: Ray Data not slower than one process, at
least 0.8x the plain pyarrow read, driver peak RSS under 1 GB. Writes
benchmarks/results/data.json; ``render`` gives its table (benchmarks/render_docs.py).

    .venv/bin/python benchmarks/data.py                                   # the full size
    .venv/bin/python benchmarks/data.py --rows 400000 --out /tmp/data-small.json --workdir /tmp/cpr-data-small
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
# As `./dev.sh` sets them: Ray reads the auth mode when it is imported.
os.environ.setdefault("RAY_AUTH_MODE", "token")
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

from benchmarks.data_cluster import cluster_child, cluster_section  # noqa: E402
from benchmarks.data_render import SECTIONS, render, summarize  # noqa: E402
from benchmarks.meta import run_metadata  # noqa: E402

CRITEO_KAGGLE_ROWS = 45_840_617
CLUSTER_NOTE = ("The 3-host cluster case is not measured by this version of benchmarks/data.py: "
                "every number here comes from one machine.")


def _peak_rss_mb() -> float:
    """This process's peak RSS: VmHWM, which starts afresh at exec; ru_maxrss would carry the
    parent's peak at the fork over (Linux keeps it across execve)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


def _raw_config(spec: dict, cache_dir: str) -> dict:
    return {
        "run_dir": str(Path(spec["workdir"]) / "run"),
        "data": {"train": [spec["train"]], "eval": [spec["eval"]], "cache_dir": cache_dir,
                 "chunk_mb": spec["chunk_mb"], "mapping": "hash"},
        "model": {"table_rows": 100_000, "embedding_dim": 16},
        "training": {"microbatch_rows": spec["microbatch_rows"]},
    }


# --- what each section's own process runs -----------------------------------------------


def _pyarrow_read(spec: dict, strings: bool) -> dict:
    import pyarrow as pa
    import pyarrow.csv as pacsv

    from core.data.criteo import COLUMNS

    read = pacsv.ReadOptions(column_names=list(COLUMNS), use_threads=True, block_size=spec["block_mb"] << 20)
    parse = pacsv.ParseOptions(delimiter="\t", quote_char=False, double_quote=False, escape_char=False)
    convert = pacsv.ConvertOptions(column_types={c: pa.string() for c in COLUMNS}, strings_can_be_null=True,
                                   null_values=[""]) if strings else pacsv.ConvertOptions()
    t0 = time.perf_counter()
    rows = 0
    with pacsv.open_csv(spec["train"], read_options=read, parse_options=parse, convert_options=convert) as reader:
        for batch in reader:
            rows += batch.num_rows
    seconds = time.perf_counter() - t0
    return {"rows": rows, "seconds": round(seconds, 3), "rows_per_s": round(rows / seconds),
            "threads": pa.cpu_count(), "block_mb": spec["block_mb"], "peak_rss_mb": _peak_rss_mb()}


def _build(spec: dict, local: bool) -> dict:
    """``build_stores`` on a fresh cache: ``LocalEngine`` if ``local``, else Ray Data (Ray is up)."""
    from app.dataengines import LocalEngine
    from app.dataprep import build_stores, resolve_data
    from core.config import config_from_dict

    cfg = config_from_dict(_raw_config(spec, spec["cache_dir"]))
    t0 = time.perf_counter()
    stores = build_stores(cfg, resolve_data(cfg), LocalEngine() if local else None)
    wall = time.perf_counter() - t0
    train, ev = stores["train"], stores["eval"]
    if train.reused or ev.reused:
        raise RuntimeError(f"a store in {spec['cache_dir']} was reused: the measurement needs a fresh cache_dir")
    b = train.build
    return {"engine": b["engine"], "rows": train.rows, "seconds": b["seconds"], "rows_per_s": b["rows_per_s"],
            "chunks": b["chunks"], "microbatches": train.microbatches, "hosts": b["hosts"],
            "eval": {"rows": ev.rows, "seconds": ev.build["seconds"], "rows_per_s": ev.build["rows_per_s"]},
            "build_stores_s": round(wall, 3), "peak_rss_mb": _peak_rss_mb()}


def _ray_data(spec: dict) -> dict:
    import ray

    from app.rayenv import keep_ray_on_loopback, ray_system_config, worker_env

    keep_ray_on_loopback()
    t0 = time.perf_counter()
    ray.init(address="local", _node_ip_address="127.0.0.1", num_cpus=os.cpu_count(), namespace="cpr-data-bench",
             include_dashboard=False, log_to_driver=False, _system_config=ray_system_config(),
             runtime_env={"env_vars": {**worker_env(), "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}})
    ray_init_s = time.perf_counter() - t0
    try:
        out = _build(spec, local=False)
    finally:
        ray.shutdown()
    workers = [h["peak_rss_mb"] for h in out["hosts"].values()]
    return {**out, "ray_init_s": round(ray_init_s, 3), "ray_cpus": os.cpu_count(),
            "driver_peak_rss_mb": out["peak_rss_mb"], "worker_peak_rss_mb": max(workers) if workers else None}


CHILDREN = {
    "ray_cluster": lambda spec: cluster_child(spec, _build),
    "pyarrow_read": lambda spec: _pyarrow_read(spec, strings=False),
    "pyarrow_read_strings": lambda spec: _pyarrow_read(spec, strings=True),
    "one_process": lambda spec: _build(spec, local=True),
    "ray_data": _ray_data,
}


# --- the parent: data, one process per section, the summary ---------------------------------


def _child_env() -> dict:
    env = dict(os.environ, RAY_AUTH_MODE="token", GLOO_SOCKET_IFNAME="lo", PYTHONPATH=str(ROOT))
    env.pop("RAY_ADDRESS", None)  # an embedded Ray of its own, never someone else's cluster
    return env


def ensure_data(workdir: Path, rows: int, eval_rows: int, seed: int, vocab_rows: int) -> dict:
    """The synthetic train/eval TSV in workdir/data, generated unless the same rows and seed
    are there already."""
    from core.data import generate

    data = workdir / "data"
    marker = data / "bench-data.json"
    want = {"rows": rows, "eval_rows": eval_rows, "seed": seed, "vocab_rows": vocab_rows}
    if marker.exists():
        have = json.loads(marker.read_text())
        train = data / "train.tsv"
        if {k: have.get(k) for k in want} == want and train.exists() and train.stat().st_size == have["train_bytes"]:
            return {**have, "reused": True}
    shutil.rmtree(data, ignore_errors=True)
    print(f"generating {rows:,} + {eval_rows:,} rows into {data}", flush=True)
    t0 = time.perf_counter()
    generate(str(data), rows, eval_rows, fmt="tsv", seed=seed, vocab_rows=vocab_rows)
    done = {**want, "seconds": round(time.perf_counter() - t0, 1), "train": str(data / "train.tsv"),
            "eval": str(data / "eval.tsv"), "train_bytes": (data / "train.tsv").stat().st_size,
            "eval_bytes": (data / "eval.tsv").stat().st_size}
    marker.write_text(json.dumps(done, indent=2))
    return {**done, "reused": False}


def _tail(path: Path, chars: int = 2000) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else ""


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.exists() else 0


def run_section(name: str, spec: dict) -> dict:
    """``name`` in a process of its own; its result, or ``{"error": ...}`` with its log's tail."""
    workdir = Path(spec["workdir"])
    cache = workdir / f"cache-{name}"
    shutil.rmtree(cache, ignore_errors=True)
    spec = {**spec, "cache_dir": str(cache)}
    out, log = workdir / f"{name}.result.json", workdir / "logs" / f"{name}.log"
    out.unlink(missing_ok=True)
    log.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", name, "--spec", json.dumps(spec),
           "--result", str(out)]
    print(f"{name}: running (log {log})", flush=True)
    t0 = time.perf_counter()
    with open(log, "w") as f:
        rc = subprocess.run(cmd, cwd=ROOT, env=_child_env(), stdout=f, stderr=subprocess.STDOUT).returncode
    elapsed = round(time.perf_counter() - t0, 1)
    store_bytes = _dir_bytes(cache)
    shutil.rmtree(cache, ignore_errors=True)
    if rc != 0 or not out.exists():
        return {"error": f"exit status {rc}; log {log}: ...{_tail(log)}", "process_s": elapsed}
    result = json.loads(out.read_text())
    if store_bytes:
        result["store_bytes"] = store_bytes
    print(f"{name}: {result['rows_per_s']:,} rows/s, {result['seconds']} s, peak RSS {result['peak_rss_mb']} MB",
          flush=True)
    return {**result, "process_s": elapsed}


def _first_commit(run_dir: Path) -> float | None:
    book = run_dir / "trainer_book.jsonl"
    if not book.exists():
        return None
    times = [r["time"] for r in map(json.loads, book.read_text().splitlines())
             if r.get("kind") == "commit" and r.get("step") == 0]
    return min(times) if times else None


def first_step(spec: dict, timeout_s: float) -> dict:
    """``cpr train`` on the same data, 1 step of a small model: launch -> first committed step."""
    import yaml

    workdir = Path(spec["workdir"])
    run_dir, cache = workdir / "first-step-run", workdir / "cache-first_step"
    for d in (run_dir, cache):
        shutil.rmtree(d, ignore_errors=True)
    raw = _raw_config(spec, str(cache))
    raw.update(run_dir=str(run_dir), embeddings={"num_shards": 2, "spares": 0},
               training={**raw["training"], "num_trainers": 1, "max_steps": 1}, checkpoint={"final": False})
    config = workdir / "first-step.yaml"
    config.write_text(yaml.safe_dump(raw, sort_keys=False))
    cpr = ROOT / ".venv" / "bin" / "cpr"
    cmd = ([str(cpr)] if cpr.exists() else [sys.executable, "-m", "app"]) + [
        "train", "--config", str(config), "--no-progress"]
    log = workdir / "logs" / "first_step.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    print(f"first_step: running {' '.join(cmd)} (log {log})", flush=True)
    t0 = time.time()
    try:
        with open(log, "w") as f:
            rc = subprocess.run(cmd, cwd=ROOT, env=_child_env(), stdout=f, stderr=subprocess.STDOUT,
                                timeout=timeout_s).returncode
    except subprocess.TimeoutExpired:
        rc = "timed out"
    exit_s = time.time() - t0
    shutil.rmtree(cache, ignore_errors=True)
    report = json.loads((run_dir / "report.json").read_text()) if (run_dir / "report.json").exists() else None
    commit = _first_commit(run_dir)
    if rc != 0 or report is None or commit is None:
        return {"error": f"exit status {rc}; log {log}: ...{_tail(log)}", "exit_s": round(exit_s, 1)}
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    started = next((e["wall_time"] for e in events if e["kind"] == "training_started"), None)
    pre = (report.get("data") or {}).get("preprocessing") or {}
    out = {"first_step_s": round(commit - t0, 2), "training_started_s": round(started - t0, 2) if started else None,
           "exit_s": round(exit_s, 2), "wall_time_s": report.get("wall_time_s"),
           "train_preprocessing": pre.get("train"), "config": raw, "run_dir": str(run_dir)}
    print(f"first_step: {out['first_step_s']} s to the first committed step", flush=True)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=CRITEO_KAGGLE_ROWS)
    parser.add_argument("--eval-rows", type=int, default=100_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vocab-rows", type=int, default=100_000, help="ids per feature of the synthetic data")
    parser.add_argument("--chunk-mb", type=int, default=64, help="data.chunk_mb")
    parser.add_argument("--microbatch-rows", type=int, default=512, help="training.microbatch_rows")
    parser.add_argument("--block-mb", type=int, default=1, help="pyarrow read block size (MiB)")
    parser.add_argument("--first-step-timeout", type=float, default=3600.0)
    parser.add_argument("--cluster", action="store_true", help="also on a 3-host namespace cluster (root)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/data.json"))
    parser.add_argument("--workdir", default="/tmp/cpr-data-bench")
    parser.add_argument("--child", choices=list(CHILDREN), help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        import logging

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
        Path(args.result).write_text(json.dumps(CHILDREN[args.child](json.loads(args.spec))))
        return 0

    workdir = Path(args.workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    data = ensure_data(workdir, args.rows, args.eval_rows, args.seed, args.vocab_rows)
    spec = {"workdir": str(workdir), "train": data["train"], "eval": data["eval"], "chunk_mb": args.chunk_mb,
            "microbatch_rows": args.microbatch_rows, "block_mb": args.block_mb}
    result = {"meta": run_metadata(), "rows": args.rows, "eval_rows": args.eval_rows, "data": data,
              "settings": {k: spec[k] for k in ("chunk_mb", "microbatch_rows", "block_mb")},
              "cluster": None, "cluster_note": CLUSTER_NOTE}

    def write() -> None:  # after every section, so that a later failure loses nothing
        summarize(result)
        out.write_text(json.dumps(result, indent=2) + "\n")

    write()
    for name in SECTIONS:
        result[name] = run_section(name, spec)
        write()
    result["first_step"] = first_step(spec, args.first_step_timeout)
    write()
    if args.cluster:
        result["cluster"] = cluster_section(spec, Path(__file__).resolve())
        result.pop("cluster_note", None)
        write()
    print(render(result))
    failed = [k for k in (*SECTIONS, "first_step", "cluster") if "error" in (result.get(k) or {})]
    if failed:
        print(f"failed: {', '.join(failed)} (see their errors in {out})", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
