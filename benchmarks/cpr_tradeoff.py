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
rows) at the PLS target the fit implies for an AUC budget (``--auc-budget``). Every run setting
comes from ``configs/emulate.yaml`` (its data generated into a temporary directory from its
``data.generate``); the benchmark overrides only the seed, the recovery mode, the row policy and
the PLS target. A replica row (``recovery: replica``: every shard's mirror takes its place when
it dies) runs at the interval its decision picks (Young/Daly), on the same seeds and failures. The
PLS, AUC, tracking share, mirror feed share, promotion times and step times are measured; the
save, load, rescheduling and lost-computation overheads are charged at the production constants
of the config's ``emulation`` section (docs/EMULATION.md): the JSON and the table keep them apart.
``--only-rows replica`` (any of full, cpr, mfu, ssu, replica) runs only those rows, each seed's
failure-free run again for their AUC reference, and merges them into the existing JSON (its
``meta`` stays the first runs'; each row added carries its ``commit``, and ``appended`` the runs).

Writes benchmarks/results/cpr_tradeoff_{real,emulation}.json (with ``benchmarks.meta.run_metadata()``)
and the .md rendered from it by ``render_real`` / ``render_emulation`` (the functions
benchmarks/render_docs.py uses for docs pages); ``benchmarks/tradeoff_plots.py`` draws the pictures.

    .venv/bin/python benchmarks/cpr_tradeoff.py --part real --seeds 0 1 2
    .venv/bin/python benchmarks/cpr_tradeoff.py --part emulation --seeds 0 1 2
    .venv/bin/python benchmarks/cpr_tradeoff.py --part emulation --seeds 0 1 2 --only-rows replica
    .venv/bin/python benchmarks/cpr_tradeoff.py --part emulation --render-only   # .md from the .json
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.meta import run_metadata  # noqa: E402
from core.config import load_config  # noqa: E402
from benchmarks.cpr_tradeoff_render import EMULATION_ROWS, REAL_COMPONENTS as COMPONENTS, ROW_KEYS, _rel, write_md  # noqa: E402

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


def _data(root: Path, rows: int):
    from core.data import generate

    return generate(str(root / "data"), rows, rows // 10, seed=0)


def _config_data(base, root: Path):
    """The config's own synthetic data (its ``data.generate``), written under ``root``."""
    from core.data import generate

    g = base.data.generate
    if g is None:
        raise SystemExit("the emulation config must generate its data (data.generate) for the benchmark to reproduce it")
    return generate(str(root / "data"), g.train_rows, g.eval_rows, fmt=g.format, seed=g.seed, vocab_rows=g.vocab_rows)


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


def _emulation_row(report: dict, ref_auc: float, seed: int, recovery: str, policy: str, pls_target: float) -> dict:
    """One emulated run's row: what it measured, what it charged, and (replica) its mirrors."""
    e = report["emulation"]
    m, c = e["measured"], e["charged"]
    row = {
        "seed": seed, "recovery": recovery, "policy": policy, "pls_target": pls_target,
        "every_steps": e["every_steps"], "interval_h": e["interval_s"] / 3600, "failures": len(e["kills"]),
        # measured on the real run
        "auc": report["auc"], "auc_change": report["auc"] - ref_auc, "pls": report["pls"],
        "step_s_real": m["step_s_real"], "tracking_share_of_step_pct": m["tracking_share_of_step_pct"],
        "saves": m["saves"], "rows_saved_share_mean": m["rows_saved_share_mean"],
        "rows_reloaded_share_mean": m["rows_reloaded_share_mean"], "steps_redone": m["steps_redone"],
        "measured_overhead_pct": m["overhead_pct"],
        # charged at the production constants
        "charged_overhead_pct": c["overhead_pct"], "charged_total_pct": c["overhead_total_pct"],
        "overhead_pct": e["overhead_pct"], "overhead_total_pct": e["overhead_total_pct"],
        "expected_pls": e["expected_pls"], "expected_overhead_pct": e["expected_overhead_pct"],
    }
    if recovery == "replica":
        mirrors, kills = m.get("mirrors") or {}, e["kills"]
        waits = [k.get("waited_for_mirror_s") or 0.0 for k in kills]
        row.update({
            "modes_used": sorted({f["recovery"] for f in report["failures"]}),
            "mirror_feed_share_of_step_pct": m["mirror_feed_share_of_step_pct"],
            "mirror_feed_s_per_step": mirrors.get("feed_s_per_step"), "mirror_memory_bytes": mirrors.get("memory_bytes"),
            "mirrors_built": mirrors.get("built"), "mirrors_lost": mirrors.get("lost"),
            "promotions": m["promotions"], "fallbacks": m["fallbacks"], "promotion_s": m["promotion_s"],
            "promotion_s_mean": sum(m["promotion_s"]) / len(m["promotion_s"]) if m["promotion_s"] else None,
            "kills_waited_for_mirror": sum(w > 0 for w in waits), "waited_for_mirror_s_max": max(waits, default=0.0),
            "kill_delay_h_max": max((k["emulated_s"] - k["scheduled_s"] for k in kills), default=0.0) / 3600,
        })
    return row


def _clean_run(base, root: Path, data, seed: int) -> dict:
    clean = run(_with(base, root, data, f"e{seed}-clean", seed=seed, emulation=None,
                      checkpoint={"every_steps": None, "final": False}))
    return {"auc": clean["auc"], "step_s": clean["wall_time_s"]["training_s"] / clean["steps"]}


def _emulation_rows(base, root: Path, data, seeds: list[int], keys, ref: dict, target: float) -> list[dict]:
    """The rows ``keys`` ((recovery, policy)) of every seed, at PLS target ``target``; ``ref``: seed -> its
    failure-free AUC."""
    rows = []
    for seed in seeds:
        for recovery, policy in keys:
            timeline = RESULTS / "timeline_emulation.png" if (seed, recovery, policy) == (seeds[0], "partial", "mfu") else None
            cfg = _with(base, root, data, f"e{seed}-{recovery}-{policy}", seed=seed, recovery=recovery,
                        checkpoint={"policy": policy, "pls_target": target}, emulation={"seed": seed})
            t0 = time.monotonic()
            r = _emulation_row(run(cfg, timeline), ref[seed], seed, recovery, policy, target)
            r["wall_s"] = round(time.monotonic() - t0, 1)
            rows.append(r)
            print(f"  seed {seed} {recovery}/{policy}: every {r['every_steps']} steps ({r['interval_h']:.1f} h), "
                  f"{r['failures']} failures, overhead {r['overhead_total_pct']:.2f}% (charged {r['charged_total_pct']:.2f}%, "
                  f"model {r['expected_overhead_pct']:.2f}%), PLS {r['pls']:.4f}, AUC {r['auc']:.4f} ({r['auc_change']:+.4f}) "
                  f"({r['wall_s']:.0f} s wall)" + (f"; {r['promotions']} promoted, {r['fallbacks']} from a checkpoint, mirror "
                                                   f"feed {r['mirror_feed_share_of_step_pct']:.2f}% of a step"
                                                   if recovery == "replica" else ""), flush=True)
    return rows


def part_emulation(args, root: Path) -> dict:
    """Runs configs/emulate.yaml as it is, overriding only the seed, the recovery mode, the row
    policy and the PLS target (each run in a run_dir of its own under ``root``)."""
    base = load_config(args.emulation_config)
    data = _config_data(base, root)
    out: dict = {"config_file": _rel(args.emulation_config), "config": base.model_dump(mode="json", exclude={"run_dir"}),
                 "sweep": [], "rows": [], "clean": {}, "clean_step_s": {}}
    tr = base.training
    out["total_steps"] = data.train_rows // (tr.microbatch_rows * tr.microbatches_per_step)
    for seed in args.seeds:
        t0 = time.monotonic()
        clean = _clean_run(base, root, data, seed)
        out["clean"][seed], out["clean_step_s"][seed] = clean["auc"], clean["step_s"]
        print(f"seed {seed}: failure-free AUC {clean['auc']:.4f}, {clean['step_s']:.3f} s a step "
              f"({time.monotonic() - t0:.0f} s wall)", flush=True)
        for target in args.sweep:
            t0 = time.monotonic()
            cfg = _with(base, root, data, f"e{seed}-sweep-{target}", seed=seed, recovery="partial",
                        checkpoint={"policy": "full", "pls_target": target}, emulation={"seed": seed})
            r = _emulation_row(run(cfg), clean["auc"], seed, "partial", "full", target)
            r["wall_s"] = round(time.monotonic() - t0, 1)
            out["sweep"].append(r)
            print(f"  sweep target {target}: every {r['every_steps']} steps, {r['failures']} failures, PLS {r['pls']:.4f}, "
                  f"AUC change {r['auc_change']:+.4f} ({r['wall_s']:.0f} s wall)", flush=True)
    fit = fit_line([(r["pls"], r["auc_change"]) for r in out["sweep"]])
    implied = args.auc_budget / -fit["slope"] if fit["slope"] < 0 else max(args.sweep)
    target = float(min(max(implied, 0.005), 0.5))
    out["fit"] = {**fit, "auc_budget": args.auc_budget, "implied_pls_target": implied, "pls_target_used": target}
    print(f"fit: AUC change = {fit['slope']:.4f} x PLS (rmse {fit['rmse']:.4f}); budget {args.auc_budget} -> "
          f"PLS target {implied:.4f} (used {target:.4f})", flush=True)
    out["rows"] = _emulation_rows(base, root, data, args.seeds, EMULATION_ROWS, out["clean"], target)
    return out


def part_emulation_rows(args, root: Path, published: dict, meta: dict) -> dict:
    """``--only-rows``: those rows of ``args.seeds`` at the published PLS target, against each
    seed's failure-free run rerun here (its AUC compared with the published one), merged into
    ``published``: rows of the same seed and kind replaced, each new row with its ``commit``."""
    base = load_config(args.emulation_config)
    data = _config_data(base, root)
    keys = [ROW_KEYS[name] for name in args.only_rows]
    clean = {seed: _clean_run(base, root, data, seed) for seed in args.seeds}
    same = all(published["clean"].get(str(s)) == c["auc"] for s, c in clean.items())
    print(f"failure-free AUCs rerun: {({s: round(c['auc'], 6) for s, c in clean.items()})} "
          f"({'the same as' if same else 'NOT the same as'} the published {published['clean']})", flush=True)
    target = published["fit"]["pls_target_used"]
    new = _emulation_rows(base, root, data, args.seeds, keys, {s: c["auc"] for s, c in clean.items()}, target)
    entry = {"rows": args.only_rows, "seeds": args.seeds, **{k: meta[k] for k in ("commit", "date", "command")},
             "clean_auc": {str(s): c["auc"] for s, c in clean.items()},
             "clean_step_s": {str(s): c["step_s"] for s, c in clean.items()}, "clean_auc_same": same}
    return merge_rows(published, new, entry)


def merge_rows(published: dict, new: list[dict], entry: dict) -> dict:
    """``published`` with ``new`` rows in the place of any of the same seed and kind, each marked
    with ``entry``'s commit and date, in seed then row order; ``entry`` (what ran them) goes in
    ``appended``, where an earlier run none of whose rows is left is dropped. ``meta`` is left alone."""
    new = [{**r, "commit": entry["commit"], "date": entry["date"]} for r in new]
    order = {k: i for i, k in enumerate(EMULATION_ROWS)}
    fresh = {(r["seed"], r["recovery"], r["policy"]) for r in new}
    kept = [r for r in published["rows"] if (r["seed"], r["recovery"], r["policy"]) not in fresh]
    rows = sorted(kept + new, key=lambda r: (r["seed"], order[(r["recovery"], r["policy"])]))
    left = {r.get("commit") for r in kept}
    appended = [a for a in published.get("appended", []) if a.get("commit") in left and a.get("commit") != entry["commit"]]
    return {**published, "rows": rows, "appended": [*appended, entry]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("real", "emulation"), required=True)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--config", default=str(ROOT / "configs/local.yaml"), help="real: the config")
    parser.add_argument("--emulation-config", default=str(ROOT / "configs/emulate.yaml"),
                        help="emulation: the config, run as it is but for seed, recovery, policy and PLS target")
    parser.add_argument("--rows", type=int, default=200_000, help="real: synthetic training rows")
    parser.add_argument("--every-steps", type=int, default=20, help="real: full-save interval; MFU/SSU save r of the rows r times it")
    parser.add_argument("--r", type=float, default=0.25, help="real")
    parser.add_argument("--full-every", type=int, default=4, help="real")
    parser.add_argument("--mtbf-steps", type=float, default=30.0, help="real")
    parser.add_argument("--sweep", type=float, nargs="+", default=[0.05, 0.3], help="emulation: PLS targets of the sweep")
    parser.add_argument("--auc-budget", type=float, default=0.001, help="emulation")
    parser.add_argument("--policies", nargs="+", default=["full", "mfu", "ssu"], choices=["full", "mfu", "ssu"], help="real")
    parser.add_argument("--recoveries", nargs="+", default=["partial", "full", "auto"], choices=["partial", "full", "auto"],
                        help="real")
    parser.add_argument("--only-rows", nargs="+", choices=list(ROW_KEYS), default=None,
                        help="emulation: run only these rows (and each seed's failure-free run) and merge them into "
                             "the existing results file, which keeps its meta; each new row records its commit")
    parser.add_argument("--render-only", action="store_true", help="rewrite the .md from the part's .json")
    args = parser.parse_args()
    out = RESULTS / f"cpr_tradeoff_{args.part}"
    if args.render_only:
        print(write_md(args.part, json.loads(out.with_suffix(".json").read_text()), out.with_suffix(".md")))
        return
    if args.only_rows and args.part != "emulation":
        parser.error("--only-rows is for --part emulation")

    import ray

    from app.rayenv import connect_ray

    meta = run_metadata()
    root = Path(tempfile.mkdtemp(prefix=f"cpr-bench-{args.part}-"))
    RESULTS.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    # Ray sized for the part's config (its shards, spare and trainers each hold a CPU; replica: its mirrors too).
    ray_cfg = load_config(args.config if args.part == "real" else args.emulation_config)
    if args.part == "emulation" and "replica" in (args.only_rows or ["replica"]):
        ray_cfg = ray_cfg.model_copy(update={"recovery": "replica"})
    connect_ray(ray_cfg)
    try:
        if args.only_rows:
            res = part_emulation_rows(args, root, json.loads(out.with_suffix(".json").read_text()), meta)
        else:
            res = part_real(args, root) if args.part == "real" else part_emulation(args, root)
    finally:
        ray.shutdown()
    meta["wall_s"] = round(time.monotonic() - t0, 1)
    if args.only_rows:  # the file's meta stays the first runs'; this run is in its ``appended``
        res["appended"][-1]["wall_s"] = meta["wall_s"]
        out.with_suffix(".json").write_text(json.dumps(res, indent=2) + "\n")
        print(write_md(args.part, json.loads(out.with_suffix(".json").read_text()), out.with_suffix(".md")))
        shutil.rmtree(root, ignore_errors=True)
        return
    args_out = {k: v for k, v in vars(args).items() if k != "render_only"}
    if args.part == "emulation":  # the real part's settings do not apply
        args_out = {k: args_out[k] for k in ("part", "seeds", "emulation_config", "sweep", "auc_budget")}
        args_out["emulation_config"] = _rel(args_out["emulation_config"])
    else:
        args_out["config"] = _rel(args_out["config"])
    result = {"meta": meta, "args": args_out, **res}
    out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    print(write_md(args.part, json.loads(out.with_suffix(".json").read_text()), out.with_suffix(".md")))
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
