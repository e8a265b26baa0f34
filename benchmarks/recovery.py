"""Shard recovery time: kill -> serving again, split into detection, adoption, load.

For each shard size (the local config's 104 MB shard, and tables scaled so that one shard
holds about 1 GB), with and without a warm spare (``embeddings.spares`` 1 and 0), a real
training run on embedded Ray: once a spare is ready (with spares), a checkpoint has
committed and training went 3 steps past it, shard 1 is SIGKILLed. The report's failure
record gives each part:

- detection: the kill until the supervisor's watch saw the process gone;
- adoption: a spare made the shard (allocates its tables), or a new process started;
- load: the shard read, verified and applied its own files of the chain;
- serving: the kill until the new fleet was committed (trainers redo their step on it).

With ``--recovery replica`` the shard's mirror takes its place (no spares; the kill waits for
the mirror to be in sync): adoption is its promotion, and nothing is loaded.

Writes benchmarks/results/recovery.md (and .json).

    .venv/bin/python benchmarks/recovery.py            # about 10 minutes
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.meta import describe, run_metadata  # noqa: E402
from core.config import load_config  # noqa: E402

PARTS = ("detection_s", "adoption_s", "load_s", "serving_s")


def _run(cfg, spares: int, mirror: bool = False) -> dict:
    import ray
    from ray._common.test_utils import wait_for_condition

    from core.checkpoint import CheckpointStore
    from app.chaos import kill_target
    from app.job import TrainingJob

    job = TrainingJob(cfg, show_progress=False)
    try:
        job.start()
        training = job.fit_in_background()

        def targets():
            return ray.get(job.supervisor.targets.remote(), timeout=30)

        if spares:
            wait_for_condition(lambda: "spare:0" in targets(), timeout=300, retry_interval_ms=100)
        if mirror:
            wait_for_condition(lambda: "mirror:1" in targets(), timeout=300, retry_interval_ms=100)
        store = CheckpointStore(cfg.checkpoint_uri)
        wait_for_condition(lambda: bool(store.list_committed()), timeout=600, retry_interval_ms=100)
        saved = store.list_committed()[-1]
        wait_for_condition(
            lambda: getattr(ray.get(job.supervisor.progress.remote(), timeout=30), "step", 0) >= saved + 3,
            timeout=600, retry_interval_ms=50,
        )
        kill_target(job.supervisor, "shard:1")
        training.join()
        report = job.finish()
    finally:
        job.close()
    [f] = [f for f in report["failures"] if f["actor"] == "shard:1"]
    return {
        **{k: f.get(k) for k in PARTS},
        "spare": f.get("spare"),
        "recovery": f["recovery"],
        "lost_samples": f["lost_samples"],
        "bytes_reloaded": f["bytes_reloaded"],
        "chain": f["chain"],
        "steps": report["steps"],
        "auc": report["auc"],
    }


def render(result: dict) -> str:
    """The table of recovery.json, as markdown (recovery.md, and docs/RESULTS.md through
    benchmarks/render_docs.py)."""
    results = result["results"]
    reps = result.get("reps") or max(len(rs) for rs in results.values())
    meta = result.get("meta")
    source = describe(meta) if meta else f"`{result.get('command', 'not recorded')}` on {result.get('machine', 'not recorded')}"
    lines = [
        "# Shard recovery: kill -> serving again",
        "",
        f"Rendered from `{result.get('file', 'recovery.json')}`: {source}.",
        "",
        f"Config `{result.get('config', 'local.yaml')}` (2 shards table-wise, 2 trainers), 3 epochs, a full "
        "checkpoint every 40 steps, shard 1 SIGKILLed 3 steps after a committed checkpoint; "
        f"{reps} runs per row, medians (min-max).",
        "",
        "| shard | standby | reloaded | detection | adoption | load | serving (kill -> fleet committed) |",
        "|---|---:|---:|---|---|---|---|",
    ]
    for key, rs in results.items():
        size, spares = key.split(", ", 1)
        cells = []
        for k in PARTS:
            xs = [r[k] for r in rs]
            cells.append(f"{statistics.median(xs):.3f} s ({min(xs):.3f}-{max(xs):.3f})")
        lines.append(f"| {size} | {spares} | {rs[0]['bytes_reloaded'] / 1e6:,.0f} MB | " + " | ".join(cells) + " |")
    if any(key.endswith("mirror") for key in results):
        lines += [
            "",
            "With `recovery: replica` the adoption is the mirror's promotion (it applies the committed steps it "
            "holds and takes the shard's lease); nothing is read, verified or copied, so the shard's size shows "
            "only in the detection, which grows with the shard (not the kernel freeing its memory: a "
            "process holding 1.3 GB is seen gone 7 ms after its SIGKILL here).",
            "",
        ]
        return "\n".join(lines)
    lines += [
        "",
        "Adoption with a spare takes over a process that has already imported torch, fbgemm and the load "
        "path, and that holds tables of the shard's shape when `embeddings.spare_tables` allows (the default, "
        "`auto`, does when the node has twice their size free; results of older commits allocated them at "
        "adoption); without a spare it is a new Ray actor process importing them. Load reads, verifies and "
        "copies only the dead shard's own files (files written since chunked checksums are verified on "
        "every core). An adoption near 1 s is the lease's wait: the successor of a process Ray did not "
        "(yet) report as exited waits one `ray.lease_s`.",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(ROOT / "configs/local.yaml"))
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--big-table-rows", type=int, default=1_250_000, help="rows per table of the ~1 GB shard case")
    parser.add_argument("--sizes", nargs="+", default=["104 MB", "1 GB"], choices=["104 MB", "1 GB"])
    parser.add_argument("--spares", type=int, nargs="+", default=[1, 0], choices=[0, 1])
    parser.add_argument("--set", nargs="*", default=[], help="config overrides, KEY=VALUE (YAML value)")
    parser.add_argument("--recovery", default="partial", choices=["partial", "replica"],
                        help="replica: the shard's mirror takes its place (no spares)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/recovery.md"))
    args = parser.parse_args()
    import yaml

    import ray

    from app.rayenv import connect_ray

    base = load_config(args.config, {k: yaml.safe_load(v) for k, v in (kv.split("=", 1) for kv in args.set)})
    root = Path(tempfile.mkdtemp(prefix="cpr-bench-recovery-"))
    sizes = {k: v for k, v in {"104 MB": base.model.table_rows, "1 GB": args.big_table_rows}.items() if k in args.sizes}
    connect_ray(base)
    results: dict[str, list[dict]] = {}
    for size, table_rows in sizes.items():
        replica = args.recovery == "replica"
        for spares in [0] if replica else args.spares:
            key = f"{size}, {'mirror' if replica else f'spares {spares}'}"
            results[key] = []
            for rep in range(args.reps):
                cfg = base.model_copy(
                    update={
                        "run_dir": str(root / f"{size.replace(' ', '')}-s{spares}-{rep}"),
                        "model": base.model.model_copy(update={"table_rows": table_rows}),
                        "embeddings": base.embeddings.model_copy(update={"spares": spares}),
                        # Long enough for a spare to start, a save to commit and the kill.
                        "training": base.training.model_copy(update={"epochs": 3.0}),
                        "checkpoint": base.checkpoint.model_copy(update={"every_steps": 40, "keep_last": 1}),
                        "data": base.data.model_copy(update={"cache_dir": str(root / "cache")}),
                        "faults": None,
                        "recovery": args.recovery,
                    }
                )
                r = _run(cfg, spares, mirror=replica)
                # A 1 GB run leaves about 5 GB of checkpoints: 12 of them filled this disk once.
                if not os.environ.get("CPR_KEEP_RUNS"):
                    shutil.rmtree(cfg.run_dir, ignore_errors=True)
                results[key].append(r)
                print(f"{key} rep {rep}: " + ", ".join(f"{k} {r[k]:.3f}" for k in PARTS)
                      + f", {r['bytes_reloaded'] / 1e6:,.0f} MB, spare {r['spare']}", flush=True)
    ray.shutdown()
    if not os.environ.get("CPR_KEEP_RUNS"):
        shutil.rmtree(root, ignore_errors=True)

    med = {key: {k: statistics.median(r[k] for r in rs) for k in PARTS} for key, rs in results.items()}
    out = {
        "meta": run_metadata(),
        "file": Path(args.out).with_suffix(".json").name,
        "config": Path(args.config).name,
        "reps": args.reps,
        "results": results,
        "median_s": med,
    }
    text = render(out)
    Path(args.out).write_text(text)
    Path(args.out).with_suffix(".json").write_text(json.dumps(out, indent=2))
    print(text)


if __name__ == "__main__":
    main()
