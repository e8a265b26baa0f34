"""Check of EmbeddingShard's CUDA path (fbgemm TBE on EmbeddingLocation.DEVICE /
ComputeDevice.CUDA) against its CPU path, built directly (not as Ray actors).

Both shards get the same tables, the same initial rows and the same steps (each step: M
lookups, one per microbatch, then M gradient pushes, the last of which applies the step with
fused row-wise Adagrad). Then the GPU shard saves a full checkpoint to a temp dir, which is
committed and loaded back into a fresh GPU shard and a fresh CPU shard, and one more step is
run on the loaded shards. Printed and written to ``--out``/cuda_shard_check.json: versions,
the max abs differences of the pooled lookups and of the rows (weights and Adagrad state)
GPU vs CPU, of the loaded rows vs the saved ones, and the time per step on each device.

Without CUDA only the CPU shard runs (a dry run); ``--save-ref`` writes its rows to an .npz,
which ``--ref`` on another machine compares with (same steps, another torch/fbgemm build).

    python benchmarks/cuda_shard_check.py --out /tmp/out [--ref ref.npz] [--save-ref ref.npz]

The machine with a GPU has no network: fbgemm-gpu (CUDA) and ray travel to it as wheels (see
docs/RESULTS.md for what was carried and how). ``render`` draws the docs' table from the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TABLE_ROWS = [1000, 5000, 200, 3000, 64]
DIM = 16
BATCH = 256  # samples per microbatch
M = 2  # microbatches per step
LR, EPS, SEED = 0.05, 1e-8, 7


def versions() -> dict:
    import torch

    out = {"python": platform.python_version(), "torch": torch.__version__, "torch_cuda": torch.version.cuda,
           "cuda_available": torch.cuda.is_available(), "numpy": np.__version__}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        out.update(gpu=p.name, capability=f"{p.major}.{p.minor}", gpu_mem_gib=round(p.total_memory / 2**30, 1))
    try:
        import fbgemm_gpu

        out.update(fbgemm_gpu=fbgemm_gpu.__version__, fbgemm_variant=getattr(fbgemm_gpu, "__variant__", "?"),
                   fbgemm_path=os.path.dirname(fbgemm_gpu.__file__))
    except Exception as err:  # noqa: BLE001 - recorded
        out["fbgemm_gpu_error"] = repr(err)
    import ray

    out.update(ray=getattr(ray, "__version__", "?"), ray_stub=bool(getattr(ray, "STUB", False)),
               ray_path=os.path.dirname(ray.__file__))
    return out


def make_shard(plan, on_gpu: bool):
    """An EmbeddingShard on the GPU, or on the CPU (torch.cuda.is_available hidden while it is
    built, which is how the shard picks its device)."""
    import torch

    from actors.shard import EmbeddingShard

    real = torch.cuda.is_available
    if not on_gpu:
        torch.cuda.is_available = lambda: False
    try:
        return EmbeddingShard(0, list(plan.shards[0]), DIM, learning_rate=LR, eps=EPS, seed=SEED,
                              microbatches_per_step=M)
    finally:
        torch.cuda.is_available = real


def batch(step: int, mb: int, size: int = BATCH) -> tuple[np.ndarray, np.ndarray]:
    """Ids int64 [size, F] and the pooled-embedding gradient float32 [size, F*DIM] of
    microbatch ``mb`` of ``step``; the same on every machine."""
    rng = np.random.default_rng(1000 * step + mb)
    rows = np.stack([rng.integers(0, n, size=size) for n in TABLE_ROWS], axis=1)
    grad = rng.standard_normal((size, len(TABLE_ROWS) * DIM)).astype(np.float32)
    return rows, grad


def run_step(shard, plan, step: int, sync, size: int = BATCH) -> tuple[list[np.ndarray], float]:
    """One training step: M lookups, then M pushes (the last applies). Returns the pooled
    lookups and the step's wall time (routing included, device synchronized at the end)."""
    data = [batch(step, mb, size) for mb in range(M)]  # made before the clock starts
    t0 = time.perf_counter()
    pooled = []
    for mb in range(M):
        sb = plan.route(data[mb][0], 0)
        pooled.append(np.asarray(shard.lookup(step, (mb,), sb.lengths, sb.indices)))
    for mb in range(M):
        res = shard.push_grads(step, (mb,), data[mb][1])
        assert res.applied == (mb == M - 1), (step, mb, res)
    sync()
    return pooled, time.perf_counter() - t0


def max_diff(a: list, b: list) -> float:
    return max(float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64)))) for x, y in zip(a, b))


def rows_diff(ra, rb) -> dict:
    return {"weights": max_diff([w for w, _ in ra], [w for w, _ in rb]),
            "adagrad_state": max_diff([m for _, m in ra], [m for _, m in rb])}


def timing(ts: list[float]) -> dict:
    warm = ts[1:] or ts
    return {"first_step_s": ts[0], "steps_timed": len(warm), "mean_s": statistics.fmean(warm),
            "median_s": statistics.median(warm), "min_s": min(warm)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--large-batch", type=int, default=8192)
    ap.add_argument("--large-steps", type=int, default=6)
    ap.add_argument("--ref", help=".npz of another machine's CPU run, to compare with")
    ap.add_argument("--save-ref", help="write this run's CPU rows and lookups to this .npz")
    args = ap.parse_args()

    import torch

    from core.checkpoint import CheckpointStore
    from core.plan import make_plan

    result: dict = {"config": {"table_rows": TABLE_ROWS, "dim": DIM, "batch_per_microbatch": BATCH,
                               "microbatches_per_step": M, "steps": args.steps, "lr": LR, "eps": EPS,
                               "seed": SEED, "optimizer": "EXACT_ROWWISE_ADAGRAD"},
                    "host": platform.node(), "errors": {}}
    result["versions"] = versions()
    print("versions:", json.dumps(result["versions"], indent=1), flush=True)
    on_gpu = torch.cuda.is_available()
    plan = make_plan("table_wise", TABLE_ROWS, 1)
    sync_gpu = torch.cuda.synchronize if on_gpu else (lambda: None)

    def stage(name, fn):
        t0 = time.perf_counter()
        try:
            value = fn()
            print(f"[{name}] ok in {time.perf_counter() - t0:.3f}s", flush=True)
            return value
        except Exception:  # noqa: BLE001 - every failure is a result here
            tb = traceback.format_exc()
            result["errors"][name] = tb
            print(f"[{name}] FAILED\n{tb}", flush=True)
            return None

    devices = ["cuda", "cpu"] if on_gpu else ["cpu"]
    shards, lookups, times = {}, {}, {}
    for dev in devices:
        shard = stage(f"build_{dev}_shard", lambda dev=dev: make_shard(plan, on_gpu=dev == "cuda"))
        if shard is None:
            continue
        print(f"{dev} shard: device={shard.device} tbe_location={shard._location} compute={shard._compute}")
        result[f"{dev}_shard_device"] = str(shard.device)
        shards[dev] = shard
        sync = sync_gpu if dev == "cuda" else (lambda: None)

        def train(shard=shard, sync=sync, dev=dev):
            looks, ts = [], []
            for step in range(args.steps):
                pooled, dt = run_step(shard, plan, step, sync)
                looks.extend(pooled)
                ts.append(dt)
            lookups[dev], times[dev] = looks, ts
            return ts

        if stage(f"train_{dev}", train) is not None:
            result[f"time_per_step_{dev}"] = timing(times[dev])
            print(f"{dev} time per step: {json.dumps(result[f'time_per_step_{dev}'])}", flush=True)
    if "cuda" in shards:
        result["cuda_is_gpu"] = shards["cuda"].device.type == "cuda"
        result["cuda_tbe_weights_device"] = stage("tbe_weights_device",
                                                  lambda: str(shards["cuda"].tbe.weights_dev.device))

    if "cuda" in lookups and "cpu" in lookups:
        result["gpu_vs_cpu"] = {"lookups_max_abs_diff": max_diff(lookups["cuda"], lookups["cpu"]),
                                "rows_max_abs_diff": rows_diff(shards["cuda"].get_rows(), shards["cpu"].get_rows())}
        print("GPU vs CPU:", json.dumps(result["gpu_vs_cpu"]), flush=True)

    ref_dev = "cpu" if "cpu" in lookups else None
    if args.save_ref and ref_dev:
        rows = shards[ref_dev].get_rows()
        np.savez_compressed(args.save_ref, **{f"w{i}": w for i, (w, _) in enumerate(rows)},
                            **{f"m{i}": m for i, (_, m) in enumerate(rows)},
                            **{f"l{i}": x for i, x in enumerate(lookups[ref_dev])},
                            versions=json.dumps(result["versions"]), times=np.array(times[ref_dev]))
        print("reference written to", args.save_ref)
    if args.ref and os.path.exists(args.ref):
        def compare_ref():
            ref = np.load(args.ref)
            n = len(TABLE_ROWS)
            ref_rows = [(ref[f"w{i}"], ref[f"m{i}"]) for i in range(n)]
            ref_looks = [ref[f"l{i}"] for i in range(len(lookups.get(devices[0], [])))]
            out = {"ref_versions": json.loads(str(ref["versions"])),
                   "ref_time_per_step": timing(list(ref["times"]))}
            for dev in lookups:
                out[dev] = {"lookups_max_abs_diff": max_diff(lookups[dev], ref_looks),
                            "rows_max_abs_diff": rows_diff(shards[dev].get_rows(), ref_rows)}
            return out

        result["vs_ref"] = stage("compare_ref", compare_ref)
        print("vs reference run:", json.dumps(result["vs_ref"]), flush=True)

    # Save from the GPU shard (the CPU one in a dry run), load into fresh shards.
    src = "cuda" if "cuda" in lookups else ref_dev
    if src:
        tmp = tempfile.mkdtemp(prefix="cuda_shard_ckpt-")
        uri = os.path.join(tmp, "ckpt")
        saved_at = args.steps
        saved_rows: list = []

        def save():
            t0 = time.perf_counter()
            snap = shards[src].save_checkpoint(uri, saved_at, full=True)
            written = shards[src].save_written(saved_at)
            CheckpointStore(uri).commit(saved_at, [written.entry])
            saved_rows.extend(shards[src].get_rows())
            return {"rows": snap.rows, "full": snap.full, "file": written.entry.name,
                    "bytes": written.entry.size_bytes, "snapshot_s": snap.snapshot_s,
                    "write_s": written.write_s, "save_s": time.perf_counter() - t0}

        result["save"] = stage(f"save_{src}", save)
        print("save:", result["save"], flush=True)
        if result["save"]:
            for dev in devices:
                def load(dev=dev):
                    fresh = make_shard(plan, on_gpu=dev == "cuda")
                    loaded = fresh.load_checkpoint(uri, [saved_at])
                    out = {"device": str(fresh.device), "rows": loaded.rows, "chain": list(loaded.chain),
                           "applied_step": fresh.applied_step, "load_s": loaded.duration_s,
                           "vs_saved_max_abs_diff": rows_diff(fresh.get_rows(), saved_rows)}
                    # One more step on the loaded shard and on the shard that saved.
                    sync = sync_gpu if dev == "cuda" else (lambda: None)
                    pl, _ = run_step(fresh, plan, saved_at, sync)
                    if dev == src:
                        pr, _ = run_step(shards[src], plan, saved_at, sync)
                        out["next_step_vs_saver"] = {"lookups_max_abs_diff": max_diff(pl, pr),
                                                     "rows_max_abs_diff": rows_diff(fresh.get_rows(),
                                                                                    shards[src].get_rows())}
                    shards[f"loaded_{dev}"] = fresh
                    lookups[f"loaded_{dev}"] = pl
                    return out

                result[f"load_into_{dev}"] = stage(f"load_into_{dev}", load)
                print(f"load into {dev}:", json.dumps(result[f"load_into_{dev}"]), flush=True)
            if "loaded_cuda" in shards and "loaded_cpu" in shards:
                result["after_load_next_step_gpu_vs_cpu"] = {
                    "lookups_max_abs_diff": max_diff(lookups["loaded_cuda"], lookups["loaded_cpu"]),
                    "rows_max_abs_diff": rows_diff(shards["loaded_cuda"].get_rows(), shards["loaded_cpu"].get_rows())}
                print("after load, next step GPU vs CPU:", json.dumps(result["after_load_next_step_gpu_vs_cpu"]))

    # Time per step with larger microbatches, on fresh shards (nothing compared).
    for dev in devices:
        def large(dev=dev):
            shard = make_shard(plan, on_gpu=dev == "cuda")
            sync = sync_gpu if dev == "cuda" else (lambda: None)
            ts = [run_step(shard, plan, step, sync, size=args.large_batch)[1] for step in range(args.large_steps)]
            return {"batch_per_microbatch": args.large_batch, **timing(ts)}

        result[f"time_per_step_large_{dev}"] = stage(f"large_batch_timing_{dev}", large)
        print(f"{dev} time per step, batch {args.large_batch}:", json.dumps(result[f"time_per_step_large_{dev}"]),
              flush=True)

    result["ok"] = not result["errors"]
    from benchmarks.meta import run_metadata

    result["meta"] = run_metadata()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    path = Path(args.out) / "cuda_shard_check.json"
    path.write_text(json.dumps(result, indent=1, default=str))
    print("written", path, "ok" if result["ok"] else f"with errors in {sorted(result['errors'])}", flush=True)
    return 0 if result["ok"] else 1


def _e(x: float | None) -> str:
    return "n/a" if x is None else ("0" if x == 0 else f"{x:.1e}")


def _ms(timing: dict) -> str:
    return "n/a" if timing.get("median_s") is None else f"{timing['median_s'] * 1e3:.2f} ms"


def render(result: dict) -> str:
    """The GPU-against-CPU agreement and the step times of a result, as markdown."""
    v, ref = result["versions"], (result.get("vs_ref") or {}).get("ref_versions", {})
    rows = [("GPU shard vs CPU shard, same machine, after the steps", result.get("gpu_vs_cpu"))]
    if result.get("vs_ref"):
        rows.append((f"GPU shard vs a CPU run elsewhere (torch {ref.get('torch')}, fbgemm {ref.get('fbgemm_gpu')})",
                     result["vs_ref"].get("cuda")))
    for dev in ("cuda", "cpu"):
        load = result.get(f"load_into_{dev}") or {}
        rows.append((f"{dev.upper()} shard loaded from the GPU shard's checkpoint vs the saved rows",
                     {"rows_max_abs_diff": load.get("vs_saved_max_abs_diff")}))
    rows.append(("one step after the load: loaded GPU vs loaded CPU shard", result.get("after_load_next_step_gpu_vs_cpu")))
    c = result["config"]
    out = [f"{v.get('gpu')} (capability {v.get('capability')}), torch {v.get('torch')}, fbgemm-gpu {v.get('fbgemm_gpu')} "
           f"({v.get('fbgemm_variant')}), ray {v.get('ray')}; shard device `{result.get('cuda_shard_device')}`; "
           f"{len(c['table_rows'])} tables, dim {c['dim']}, {c['microbatches_per_step']} microbatches of "
           f"{c['batch_per_microbatch']} a step, {c['steps']} steps, {c['optimizer']}. Every stage without error: "
           f"{'yes' if result.get('ok') else 'no: ' + ', '.join(sorted(result.get('errors') or {}))}.", "",
           "| compared | lookups, max abs diff | weights | Adagrad state |", "|---|---:|---:|---:|"]
    for what, d in rows:
        d = d or {}
        r = d.get("rows_max_abs_diff") or {}
        out.append(f"| {what} | {_e(d.get('lookups_max_abs_diff'))} | {_e(r.get('weights'))} | {_e(r.get('adagrad_state'))} |")
    out += ["", "| time per step (median of the timed steps, after the first) | GPU | the same machine's CPU |",
            "|---|---:|---:|"]
    for label, key in ((f"{c['batch_per_microbatch']} rows a microbatch", "time_per_step"),
                       (f"{(result.get('time_per_step_large_cuda') or {}).get('batch_per_microbatch')} rows a microbatch",
                        "time_per_step_large")):
        g, p = result.get(f"{key}_cuda") or {}, result.get(f"{key}_cpu") or {}
        out.append(f"| {label} | {_ms(g)} | {_ms(p)} |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    sys.exit(main())
