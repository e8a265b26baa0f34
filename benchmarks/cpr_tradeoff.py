"""CPR's trade-off, reproduced: checkpoint overhead vs portion of lost samples (PLS) vs AUC.

Two parts, each over several seeds, each run on real shards and trainers (SIGKILLs, real recoveries):

``--part real``: every row policy (full, MFU, SSU) x recovery mode (partial, full, auto) on the
same data, facing the same failures per seed: shards killed at steps drawn with exponential gaps
(mean ``--mtbf-steps``; which shard from the seed too), applied by the supervisor when that
step commits, so every row of a seed sees the same schedule. Overheads are shares of the
*failure-free training time* (a run of the seed without failures or saves), split into save
(training path; the background write is listed apart, it stalls nothing), load, lost computation
(redone steps x the failure-free step time), rescheduling (kill to serving, less the load) and
tracking; each measured once, from the run's own records. The extra training time measured
against the failure-free run is listed beside their sum.

``--part emulation``: the paper's production-scale emulation (``app.emulation``, ``cpr emulate``),
first as a sweep of PLS targets (checkpoint intervals) under partial recovery to fit AUC change
against PLS, then full recovery at the Young/Daly interval against CPR (partial, full/MFU/SSU
rows) at the PLS target the fit implies for an AUC budget (``--auc-budget``).

Writes benchmarks/results/cpr_tradeoff_{real,emulation}.{md,json}; ``benchmarks/tradeoff_plots.py``
draws the pictures.

    .venv/bin/python benchmarks/cpr_tradeoff.py --part real --seeds 0 1 2
    .venv/bin/python benchmarks/cpr_tradeoff.py --part emulation --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from core.config import load_config  # noqa: E402
from app.emulation import OVERHEADS as COMPONENTS  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"


def kill_schedule(seed: int, total_steps: int, mtbf_steps: float, num_shards: int) -> dict[str, list[int]]:
    """``faults.at_steps`` of a seed: exponential gaps of mean ``mtbf_steps`` steps, a shard each."""
    rng = np.random.default_rng([seed, 7])
    at: dict[str, list[int]] = {}
    step = 0.0
    while True:
        step += rng.exponential(mtbf_steps)
        if step >= total_steps - 1:
            return at
        at.setdefault(f"shard:{int(rng.integers(num_shards))}", []).append(int(step) + 1)


def run(cfg, keep_timeline: Path | None = None) -> dict:
    """Trains ``cfg`` to the end; returns its report."""
    from app.job import TrainingJob

    job = TrainingJob(cfg, show_progress=False)
    try:
        job.start()
        job.fit()
        report = job.finish()
    finally:
        job.close()
    if keep_timeline is not None:
        shutil.copy(Path(cfg.run_dir) / "timeline.png", keep_timeline)
    shutil.rmtree(Path(cfg.run_dir) / "checkpoints", ignore_errors=True)  # the report is all that is kept
    return report


def real_costs(report: dict, clean: dict) -> dict:
    """Overheads of a real run in seconds, each from the run's own records, once."""
    clean_step_s = clean["wall_time_s"]["training_s"] / clean["steps"]
    saves = [e for e in report["events"] if e["kind"] == "checkpoint_saved" and not e.get("final")]
    failures = report["failures"]
    resched = 0.0
    for f in failures:
        if f.get("serving_s") is not None:
            resched += max(f["serving_s"] - (f.get("load_s") or 0.0), 0.0)
        else:
            resched += f.get("reschedule_s") or 0.0
    return {
        "save": sum(e.get("hold_s", e.get("duration_s")) or 0.0 for e in saves),
        "load": sum(f.get("load_s") or 0.0 for f in failures),
        "lost_computation": sum(f.get("lost_steps_recomputed") or 0 for f in failures) * clean_step_s,
        "rescheduling": resched,
        "tracking": report["overhead_s"].get("tracking") or 0.0,
        "save_background": sum(e.get("background_s") or 0.0 for e in saves),
    }


def summarize(values: list[float]) -> dict:
    return {"mean": statistics.fmean(values), "min": min(values), "max": max(values), "n": len(values)}


def _data(root: Path, rows: int):
    from core.data import generate

    return generate(str(root / "data"), rows, rows // 10, seed=0)


def _with(base, root: Path, data, name: str, **sections):
    updates = {
        "run_dir": str(root / name),
        "data": base.data.model_copy(update={"train": [data.train_path], "eval": [data.eval_path],
                                             "cache_dir": str(root / "cache"), "generate": None}),
    }
    for key, value in sections.items():
        current = getattr(base, key)
        updates[key] = current.model_copy(update=value) if hasattr(current, "model_copy") and isinstance(value, dict) else value
    return base.model_copy(update=updates)


def part_real(args, root: Path) -> dict:
    base = load_config(args.config)
    data = _data(root, args.rows)
    total_steps = data.train_rows // (base.training.microbatch_rows * base.training.microbatches_per_step)
    rows = []
    for seed in args.seeds:
        at = kill_schedule(seed, total_steps, args.mtbf_steps, base.embeddings.num_shards)
        clean = run(_with(base, root, data, f"s{seed}-clean", seed=seed,
                          checkpoint={"every_steps": None, "final": False},
                          training={"progress_every_steps": 1}, faults=None))
        clean_train_s = clean["wall_time_s"]["training_s"]
        print(f"seed {seed}: failure-free training {clean_train_s:.1f}s, AUC {clean['auc']:.4f}; kills {at}", flush=True)
        for recovery in args.recoveries:
            for policy in args.policies:
                name = f"s{seed}-{policy}-{recovery}"
                timeline = RESULTS / "timeline_real.png" if (seed, policy, recovery) == (args.seeds[0], "mfu", "partial") else None
                cfg = _with(
                    base, root, data, name, seed=seed, recovery=recovery,
                    checkpoint={"every_steps": args.every_steps, "policy": policy, "r": args.r, "full_every": args.full_every,
                                "keep_last": 100, "mtbf_s": args.mtbf_steps * clean_train_s / clean["steps"]},
                    training={"progress_every_steps": 1},
                    faults=base.faults.model_copy(update={"max_failures": 0, "at_steps": at, "seed": seed}),
                )
                report = run(cfg, timeline)
                costs = real_costs(report, clean)
                stall = {k: costs[k] for k in COMPONENTS}
                r = {
                    "seed": seed, "policy": policy, "recovery": recovery,
                    "modes_used": sorted({f["recovery"] for f in report["failures"]}),
                    "failures": len(report["failures"]), "kills": sum(len(v) for v in at.values()),
                    "auc": report["auc"], "auc_change": report["auc"] - clean["auc"], "pls": report["pls"],
                    "checkpoints": report["checkpoints_saved"], "incremental": report["incremental_checkpoints"],
                    "overhead_pct": {k: 100 * v / clean_train_s for k, v in stall.items()},
                    "overhead_total_pct": 100 * sum(stall.values()) / clean_train_s,
                    "save_background_pct": 100 * costs["save_background"] / clean_train_s,
                    "extra_training_pct": 100 * (report["wall_time_s"]["training_s"] - clean_train_s) / clean_train_s,
                    "training_s": report["wall_time_s"]["training_s"], "clean_training_s": clean_train_s,
                }
                rows.append(r)
                print(f"  {name}: AUC {r['auc']:.4f} ({r['auc_change']:+.4f}), PLS {r['pls']:.4f}, overhead "
                      f"{r['overhead_total_pct']:.1f}% {({k: round(v, 1) for k, v in r['overhead_pct'].items()})}, "
                      f"extra training {r['extra_training_pct']:.1f}%, modes {r['modes_used']}", flush=True)
    return {"rows": rows, "total_steps": total_steps}


def fit_line(points: list[tuple[float, float]]) -> dict:
    """Least squares of AUC change on PLS through the origin (no failure, no change)."""
    x = np.array([p for p, _ in points])
    y = np.array([a for _, a in points])
    slope = float((x @ y) / (x @ x)) if len(x) and (x @ x) > 0 else 0.0
    resid = y - slope * x
    return {"slope": slope, "n": len(points), "rmse": float(np.sqrt(np.mean(resid**2))) if len(x) else None}


def part_emulation(args, root: Path) -> dict:
    base = load_config(args.emulation_config)
    base = base.model_copy(update={"training": base.training.model_copy(update={"microbatch_rows": args.microbatch_rows})})
    data = _data(root, args.rows)
    out: dict = {"sweep": [], "rows": [], "clean": {}}
    tr = base.training
    out["total_steps"] = data.train_rows // (tr.microbatch_rows * tr.microbatches_per_step)

    def emulated(name: str, seed: int, recovery: str, policy: str, pls_target: float, timeline: Path | None = None) -> dict:
        cfg = _with(base, root, data, name, seed=seed, recovery=recovery,
                    checkpoint={"policy": policy, "pls_target": pls_target},
                    emulation={"seed": seed})
        report = run(cfg, timeline)
        e = report["emulation"]
        ref = out["clean"][seed]
        return {
            "seed": seed, "recovery": recovery, "policy": policy, "pls_target": pls_target,
            "every_steps": e["every_steps"], "interval_h": e["interval_s"] / 3600, "failures": len(e["kills"]),
            "auc": report["auc"], "auc_change": report["auc"] - ref, "pls": report["pls"],
            "expected_pls": e["expected_pls"], "overhead_pct": e["overhead_pct"],
            "overhead_total_pct": e["overhead_total_pct"], "expected_overhead_pct": e["expected_overhead_pct"],
        }

    for seed in args.seeds:
        clean = run(_with(base, root, data, f"e{seed}-clean", seed=seed, emulation=None,
                          checkpoint={"every_steps": None, "final": False}))
        out["clean"][seed] = clean["auc"]
        print(f"seed {seed}: failure-free AUC {clean['auc']:.4f}", flush=True)
        for target in args.sweep:
            r = emulated(f"e{seed}-sweep-{target}", seed, "partial", "full", target)
            out["sweep"].append(r)
            print(f"  sweep target {target}: every {r['every_steps']} steps, {r['failures']} failures, PLS {r['pls']:.4f}, "
                  f"AUC change {r['auc_change']:+.4f}", flush=True)
    fit = fit_line([(r["pls"], r["auc_change"]) for r in out["sweep"]])
    implied = args.auc_budget / -fit["slope"] if fit["slope"] < 0 else max(args.sweep)
    target = float(min(max(implied, 0.005), 0.5))
    out["fit"] = {**fit, "auc_budget": args.auc_budget, "implied_pls_target": implied, "pls_target_used": target}
    print(f"fit: AUC change = {fit['slope']:.4f} x PLS (rmse {fit['rmse']:.4f}); budget {args.auc_budget} -> "
          f"PLS target {implied:.4f} (used {target:.4f})", flush=True)
    for seed in args.seeds:
        for recovery, policy in (("full", "full"), ("partial", "full"), ("partial", "mfu"), ("partial", "ssu")):
            timeline = RESULTS / "timeline_emulation.png" if (seed, recovery, policy) == (args.seeds[0], "partial", "mfu") else None
            r = emulated(f"e{seed}-{recovery}-{policy}", seed, recovery, policy, target, timeline)
            out["rows"].append(r)
            print(f"  {recovery}/{policy}: every {r['every_steps']} steps ({r['interval_h']:.1f} h), {r['failures']} failures, "
                  f"overhead {r['overhead_total_pct']:.2f}% (model {r['expected_overhead_pct']:.2f}%), PLS {r['pls']:.4f}, "
                  f"AUC {r['auc']:.4f} ({r['auc_change']:+.4f})", flush=True)
    return out


def _mm(rows: list[dict], key, spec: str = ".2f") -> str:
    """Mean (min–max) of ``key`` over ``rows``."""
    s = summarize([key(r) for r in rows])
    return f"{s['mean']:{spec}} ({s['min']:{spec}}–{s['max']:{spec}})"


def _mm4(rows: list[dict], key) -> str:
    return _mm(rows, key, "+.4f")


def write_real(args, res: dict, header: str) -> list[str]:
    rows = res["rows"]
    lines = [
        "# CPR trade-off on real runs: overhead vs PLS vs AUC", "", header, "",
        f"Config `{Path(args.config).name}` (2 trainers, 2 shards, table_wise) on {args.rows:,} synthetic rows "
        f"({res['total_steps']} steps), seeds {args.seeds}. Checkpoints every {args.every_steps} steps with full saves; "
        f"MFU/SSU save r={args.r} of a shard's rows every {max(1, round(args.every_steps * args.r))} steps, every "
        f"{args.full_every}th save full. Failures: shards SIGKILLed at steps drawn with exponential gaps of mean "
        f"{args.mtbf_steps} steps, the same for every row of a seed. Overheads in % of the seed's failure-free training "
        "time (no saves, no failures); mean (min–max) over seeds. *Extra training* is the training time measured "
        "against the failure-free run; the components should add up to about it.", "",
        "| recovery | policy | modes used | failures | PLS | AUC change | overhead total | save | load | lost computation | rescheduling | tracking | save in background (not a stall) | extra training |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for recovery in ("partial", "full", "auto"):
        for policy in ("full", "mfu", "ssu"):
            rs = [r for r in rows if r["recovery"] == recovery and r["policy"] == policy]
            if not rs:
                continue
            modes = sorted({m for r in rs for m in r["modes_used"]})
            lines.append(
                f"| {recovery} | {policy} | {', '.join(modes)} | {_mm(rs, lambda r: r['failures'])} | "
                f"{_mm(rs, lambda r: r['pls'], '.4f')} | "
                f"{_mm4(rs, lambda r: r['auc_change'])} | {_mm(rs, lambda r: r['overhead_total_pct'])} | "
                + " | ".join(_mm(rs, lambda r, k=k: r["overhead_pct"][k]) for k in COMPONENTS)
                + f" | {_mm(rs, lambda r: r['save_background_pct'])} | {_mm(rs, lambda r: r['extra_training_pct'])} |"
            )
    return lines


def write_emulation(args, res: dict, header: str) -> list[str]:
    fit = res["fit"]
    ecfg = load_config(args.emulation_config)
    p = ecfg.emulation
    total_steps = res.get("total_steps") or args.rows // (args.microbatch_rows * ecfg.training.microbatches_per_step)
    step_h = p.duration_h / total_steps
    lines = [
        "# CPR trade-off in the production-scale emulation", "", header, "",
        f"Config `{Path(args.emulation_config).name}` (2 trainers, 4 shards) on {args.rows:,} synthetic rows, "
        f"microbatches of {args.microbatch_rows}; seeds {args.seeds}. Emulated: {p.duration_h:g} h of training on "
        f"{p.nodes} hosts with a host MTBF of {p.node_mtbf_h:g} h (job MTBF {p.node_mtbf_h / p.nodes:.1f} h), save "
        f"{p.save_s:g} s, load {p.load_s:g} s, reschedule {p.reschedule_s:g} s. Overheads in % of the failure-free "
        "time; mean (min–max) over seeds; AUC change against the seed's failure-free run.", "",
        "## AUC change against PLS (partial recovery, full saves, a sweep of PLS targets = checkpoint intervals)", "",
        "| PLS target | interval (h) | failures | PLS | AUC change |", "|---:|---:|---:|---:|---:|",
    ]
    for t in sorted({r["pls_target"] for r in res["sweep"]}):
        rs = [r for r in res["sweep"] if r["pls_target"] == t]
        lines.append(f"| {t} | {rs[0]['interval_h']:.1f} | {_mm(rs, lambda r: r['failures'])} | "
                     + ", ".join(f"{r['pls']:.4f}" for r in rs) + " | " + ", ".join(f"{r['auc_change']:+.4f}" for r in rs) + " |")
    lines += [
        "",
        f"Fitted through the origin: **AUC change = {fit['slope']:.4f} × PLS** (rmse {fit['rmse']:.4f}, {fit['n']} runs). "
        f"An AUC budget of {fit['auc_budget']} implies a **PLS target of {fit['implied_pls_target']:.4f}**"
        + (f" (used: {fit['pls_target_used']:.4f}, clamped to [0.005, 0.5])" if abs(fit['pls_target_used'] - fit['implied_pls_target']) > 1e-9 else "")
        + ".", "",
        "## Full recovery (Young/Daly) against CPR (PLS-target interval)", "",
        "| recovery | policy | interval: policy's (h) / used (steps, h) | failures | overhead total | save | load | lost computation | rescheduling | tracking | first-order model | PLS | AUC change |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for recovery, policy in (("full", "full"), ("partial", "full"), ("partial", "mfu"), ("partial", "ssu")):
        rs = [r for r in res["rows"] if r["recovery"] == recovery and r["policy"] == policy]
        if not rs:
            continue
        lines.append(
            f"| {recovery} | {policy} | {rs[0]['interval_h']:.1f} / {rs[0]['every_steps']}, "
            f"{rs[0]['every_steps'] * step_h:.1f} | {_mm(rs, lambda r: r['failures'])} | "
            f"{_mm(rs, lambda r: r['overhead_total_pct'])} | "
            + " | ".join(_mm(rs, lambda r, k=k: r["overhead_pct"][k]) for k in COMPONENTS)
            + f" | {_mm(rs, lambda r: r['expected_overhead_pct'])} | "
            f"{summarize([r['pls'] for r in rs])['mean']:.4f} | {_mm4(rs, lambda r: r['auc_change'])} |"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("real", "emulation"), required=True)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--config", default=str(ROOT / "configs/local.yaml"))
    parser.add_argument("--emulation-config", default=str(ROOT / "configs/emulate.yaml"))
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--microbatch-rows", type=int, default=256, help="emulation: smaller microbatches, more steps")
    parser.add_argument("--every-steps", type=int, default=20, help="real: full-save interval; MFU/SSU save r of the rows r times it")
    parser.add_argument("--r", type=float, default=0.25)
    parser.add_argument("--full-every", type=int, default=4)
    parser.add_argument("--mtbf-steps", type=float, default=30.0)
    parser.add_argument("--sweep", type=float, nargs="+", default=[0.05, 0.3], help="emulation: PLS targets of the sweep")
    parser.add_argument("--auc-budget", type=float, default=0.001)
    parser.add_argument("--policies", nargs="+", default=["full", "mfu", "ssu"], choices=["full", "mfu", "ssu"])
    parser.add_argument("--recoveries", nargs="+", default=["partial", "full", "auto"], choices=["partial", "full", "auto"])
    parser.add_argument("--render-only", action="store_true", help="rewrite the .md from the part's .json")
    args = parser.parse_args()
    out = RESULTS / f"cpr_tradeoff_{args.part}"
    if args.render_only:
        saved = json.loads(out.with_suffix(".json").read_text())
        args = argparse.Namespace(**saved.pop("args"))
        command, machine = saved.pop("command"), saved.pop("machine")
        saved["clean"] = {int(k): v for k, v in saved.get("clean", {}).items()}
        lines = (write_real if args.part == "real" else write_emulation)(args, saved, f"`{command}` on {machine}.")
        out.with_suffix(".md").write_text("\n".join(lines) + "\n")
        print("\n".join(lines))
        return

    import ray

    from app.rayenv import connect_ray

    root = Path(tempfile.mkdtemp(prefix=f"cpr-bench-{args.part}-"))
    RESULTS.mkdir(parents=True, exist_ok=True)
    # Ray sized for the part's config (its shards, spare and trainers each hold a CPU).
    connect_ray(load_config(args.config if args.part == "real" else args.emulation_config))
    try:
        res = part_real(args, root) if args.part == "real" else part_emulation(args, root)
    finally:
        ray.shutdown()
    command = "python benchmarks/cpr_tradeoff.py " + " ".join(sys.argv[1:])
    machine = f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}"
    header = f"`{command}` on {machine}."
    lines = (write_real if args.part == "real" else write_emulation)(args, res, header)
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    out.with_suffix(".json").write_text(json.dumps({"command": command, "machine": machine, "args": vars(args), **res}, indent=2))
    print("\n".join(lines))
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
