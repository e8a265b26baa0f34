"""Pictures of the CPR trade-off benchmark, from its JSON results in benchmarks/results/:

* ``overhead_by_component.png``: real runs, each row's overhead split by component (mean over
  seeds; the whisker spans the seeds' totals);
* ``auc_vs_pls.png``: AUC change against PLS, the emulation's sweep and rows with the line fitted
  through the origin, the AUC budget and the PLS target it implies;
* ``emulation_overhead.png``: the emulation's full recovery against CPR and replica recovery, by
  component, beside the paper's reported ranges; the components charged at the production
  constants (save, load, lost computation, rescheduling) plain, the measured ones (tracking, the
  mirrors' feed, promotions) hatched.

(The timelines of one run each, ``timeline_real.png`` and ``timeline_emulation.png``, are the
runs' own ``timeline.png`` copied by ``cpr_tradeoff.py``.)

    .venv/bin/python benchmarks/tradeoff_plots.py
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from app.emulation import MEASURED, OVERHEADS as COMPONENTS  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
COLOURS = {"save": "tab:green", "load": "tab:blue", "lost_computation": "tab:red", "rescheduling": "tab:orange",
           "tracking": "tab:purple", "mirror_feed": "tab:brown", "promotion": "tab:pink"}


def _save(fig: Figure, name: str) -> Path:
    FigureCanvasAgg(fig)
    path = RESULTS / name
    fig.savefig(path, dpi=110)
    return path


def _stacked(ax, labels: list[str], groups: list[list[dict]], split: bool = False) -> None:
    """Stacked mean overheads by component; ``split``: the emulation's, charged ones plain and
    measured ones hatched, each labelled as such. A component no row has (the real part has no
    mirrors; older emulation rows neither) is left out; a row without it counts 0."""
    bottoms = [0.0] * len(groups)
    for k in [k for k in COMPONENTS if any(k in r["overhead_pct"] for g in groups for r in g)]:
        means = [statistics.fmean(r["overhead_pct"].get(k, 0.0) for r in g) for g in groups]
        name = k.replace("_", " ")
        if split:
            name += " (measured)" if k in MEASURED else " (charged)"
        ax.bar(labels, means, bottom=bottoms, color=COLOURS[k], label=name,
               hatch="//" if split and k in MEASURED else None, edgecolor="white" if split and k in MEASURED else None)
        bottoms = [b + m for b, m in zip(bottoms, means)]
    totals = [[r["overhead_total_pct"] for r in g] for g in groups]
    ax.errorbar(labels, bottoms, yerr=[[b - min(t) for b, t in zip(bottoms, totals)], [max(t) - b for b, t in zip(bottoms, totals)]],
                fmt="none", ecolor="black", capsize=3, label="min–max over seeds")
    ax.tick_params(axis="x", labelrotation=30)
    ax.set_ylabel("% of failure-free training time")


def overhead_by_component(real: dict) -> Path:
    rows = real["rows"]
    keys = [(rec, pol) for rec in ("partial", "full", "auto") for pol in ("full", "mfu", "ssu")]
    groups = [[r for r in rows if (r["recovery"], r["policy"]) == k] for k in keys]
    keys, groups = [k for k, g in zip(keys, groups) if g], [g for g in groups if g]
    fig = Figure(figsize=(10, 5))
    ax = fig.add_subplot()
    _stacked(ax, [f"{rec}\n{pol}" for rec, pol in keys], groups)
    seeds = sorted({r["seed"] for r in rows})
    ax.set_title(f"Real runs: overhead by component (seeds {seeds}, same kill schedule per seed)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return _save(fig, "overhead_by_component.png")


def auc_vs_pls(emu: dict) -> Path:
    fit = emu["fit"]
    fig = Figure(figsize=(7, 5))
    ax = fig.add_subplot()
    ax.scatter([r["pls"] for r in emu["sweep"]], [r["auc_change"] for r in emu["sweep"]], label="sweep of PLS targets", color="tab:blue")
    cpr = [r for r in emu["rows"] if r["recovery"] == "partial"]
    ax.scatter([r["pls"] for r in cpr], [r["auc_change"] for r in cpr], marker="^", color="tab:green", label="CPR rows (full/MFU/SSU)")
    full = [r for r in emu["rows"] if r["recovery"] == "full"]
    ax.scatter([r["pls"] for r in full], [r["auc_change"] for r in full], marker="s", color="tab:gray", label="full recovery")
    replica = [r for r in emu["rows"] if r["recovery"] == "replica"]
    if replica:
        ax.scatter([r["pls"] for r in replica], [r["auc_change"] for r in replica], marker="D", facecolors="none",
                   edgecolors="tab:purple", label="replica recovery (mirrors)")
    xs = [0.0, max([r["pls"] for r in emu["sweep"] + emu["rows"]] + [fit["implied_pls_target"]]) * 1.05]
    ax.plot(xs, [fit["slope"] * x for x in xs], color="tab:red", label=f"fit: {fit['slope']:.4f} × PLS")
    ax.axhline(-fit["auc_budget"], color="tab:orange", linestyle="--", label=f"AUC budget −{fit['auc_budget']}")
    ax.axvline(fit["implied_pls_target"], color="tab:orange", linestyle=":", label=f"implied PLS target {fit['implied_pls_target']:.3f}")
    ax.axhline(0.0, color="black", linewidth=0.5)
    ax.set_xlabel("portion of lost samples (PLS)")
    ax.set_ylabel("AUC change against the failure-free run")
    ax.set_title("Emulation: AUC change against PLS")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return _save(fig, "auc_vs_pls.png")


def emulation_overhead(emu: dict) -> Path:
    keys = [("full", "full"), ("partial", "full"), ("partial", "mfu"), ("partial", "ssu"), ("replica", "full")]
    names = {("full", "full"): "full recovery\n(Young/Daly)", ("partial", "full"): "CPR-vanilla\n(PLS interval)",
             ("partial", "mfu"): "CPR-MFU", ("partial", "ssu"): "CPR-SSU", ("replica", "full"): "replica\n(mirrors, Young/Daly)"}
    groups = [[r for r in emu["rows"] if (r["recovery"], r["policy"]) == k] for k in keys]
    keys, groups = [k for k, g in zip(keys, groups) if g], [g for g in groups if g]
    fig = Figure(figsize=(8, 5))
    ax = fig.add_subplot()
    _stacked(ax, [names[k] for k in keys], groups, split=True)
    ax.axhspan(8.2, 8.5, color="tab:gray", alpha=0.3, label="CPR paper (abstract): full 8.2–8.5%")
    ax.axhspan(0.53, 0.68, color="tab:green", alpha=0.3, label="CPR paper (abstract): CPR-MFU/SSU 0.53–0.68%")
    seeds = sorted({r["seed"] for r in emu["rows"]})
    ax.set_title(f"Emulated production overhead (seeds {seeds}): charged at production constants (plain) "
                 "+ measured (hatched)", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return _save(fig, "emulation_overhead.png")


def main() -> None:
    written = []
    real = RESULTS / "cpr_tradeoff_real.json"
    emu = RESULTS / "cpr_tradeoff_emulation.json"
    if real.exists():
        written.append(overhead_by_component(json.loads(real.read_text())))
    if emu.exists():
        e = json.loads(emu.read_text())
        written += [auc_vs_pls(e), emulation_overhead(e)]
    print("\n".join(str(p) for p in written))


if __name__ == "__main__":
    main()
