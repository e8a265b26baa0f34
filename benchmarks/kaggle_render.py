"""The tables and the plot of ``benchmarks/kaggle.py``'s results (``kaggle*.json``): where a step
goes per run, failures and saves, memory per process against the plan's estimate, a shard's
kill to serving. Imports neither Ray nor torch (``benchmarks/render_docs.py`` renders with it)."""

from __future__ import annotations

from pathlib import Path

from benchmarks.meta import describe

__all__ = ["plot", "render"]


def plot(result: dict, path: Path) -> None:
    """Three panels: ms a step by phase per run, peak RSS per kind of process against the
    estimate, and kill to serving per failure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["runs"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    ax = axes[0]
    names = list(runs)
    phases = ["data", "lookup", "dense", "dense+update", "push", "quorum", "allreduce", "commit", "checkpoint"]
    bottom = [0.0] * len(names)
    for ph in phases:
        vals = [(runs[n].get("phase_ms") or {}).get(ph, 0.0) for n in names]
        if any(vals):
            ax.bar(names, vals, bottom=bottom, label=ph)
            bottom = [b + v for b, v in zip(bottom, vals)]
    ax.plot(names, [runs[n]["step_ms"] for n in names], "k_", markersize=30, label="ms a step (wall)")
    ax.set(ylabel="ms a step (8,192 samples)", title="Where a step goes",
           ylim=(0, 1.6 * max(runs[n]["step_ms"] for n in names)))
    ax.legend(fontsize=7, ncol=3, loc="upper center")
    ax = axes[1]
    kinds = [("EmbeddingShard", "shard"), ("RayTrainWorker", "trainer"), ("Supervisor", "supervisor"), ("driver", "driver")]
    width = 0.8 / max(1, len(names))
    for i, n in enumerate(names):
        rss = runs[n].get("rss") or {}
        vals = [rss.get(k, {}).get("max_mb", 0.0) for k, _ in kinds]
        if n == "single":
            vals = [0.0, 0.0, 0.0, runs[n].get("peak_rss_mb", 0.0)]
        ax.bar([j + i * width for j in range(len(kinds))], vals, width, label=n)
    est = max(result["estimate"]["shards_at_save_mb"])
    ax.axhline(est, color="k", linestyle="--", linewidth=1, label="estimate: largest shard at a save")
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(kinds))], [label for _, label in kinds])
    ax.set(ylabel="peak RSS (MB), the largest of its kind", title="Memory per process")
    ax.legend(fontsize=7)
    ax = axes[2]
    bars = [(f"{n}: {f['actor']}", f) for n in names for f in runs[n].get("failures") or [] if f.get("serving_s")]
    parts = [("detection_s", "detection"), ("adoption_s", "adoption"), ("load_s", "load")]
    left = [0.0] * len(bars)
    for key, label in parts:
        vals = [f.get(key) or 0.0 for _, f in bars]
        ax.barh([b for b, _ in bars], vals, left=left, label=label)
        left = [a + v for a, v in zip(left, vals)]
    ax.plot([f["serving_s"] for _, f in bars], [b for b, _ in bars], "k|", markersize=20, label="serving again")
    ax.set(xlabel="seconds from the kill", title="A shard's kill to serving")
    ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)


def render(result: dict) -> str:
    """The docs' section: per run, throughput, memory, checkpoints, recoveries, AUC."""
    runs = result["runs"]
    est = result["estimate"]
    model = ("with the DLRM reference's arches (13-512-256-64-16, 512-256-1) and no cap"
             if result.get("reference") else "as shipped")
    lines = [f"Rendered from `{result.get('file', 'kaggle.json')}`: {describe(result['meta'])}. Model: `{result['config']}` "
             f"{model} ({est['rows']:,} rows of D=16 in 2 table-wise shards, {est['dense_params']:,} dense parameters, "
             f"{result['samples_per_step']:,} samples a step); synthetic data of {result['data']['train_rows']:,} "
             f"rows drawn over the 26 Kaggle cardinalities (generator's ceiling AUC "
             f"{result['data']['ceiling_auc']:.4f} on {result['data']['eval_rows']:,} held-out rows). cpr runs "
             + ("on this host (embedded Ray)." if result.get("hosts", 1) <= 1 else
                f"on a {result['hosts']}-host namespace cluster of this machine (`scripts/local_cluster.sh`: the "
                "driver and the supervisor on host 0, shards and trainers on the others, each mirror on "
                "another host than its primary)."), "",
             "| run | steps | samples/s | ms a step | quorum | lookup | dense | push | all-reduce | commit | checkpoint | "
             "AUC | kill to serving |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for name, r in runs.items():
        ph = r.get("phase_ms") or {}
        cell = (lambda k: f"{ph[k]:.1f}" if k in ph else "")
        kills = "; ".join(f"{f['actor']} ({f['recovery']}) {f['serving_s']:.2f} s" for f in r.get("failures") or []
                          if f.get("serving_s") is not None)
        heals = "; ".join(f"{t['actor']} replaced, healed {t['rejoined_s']:.1f} s after its kill"
                          for t in r.get("trainer_failures") or [] if t.get("rejoined_s") is not None)
        auc = f"{r['auc']:.4f}" if r.get("auc") is not None else ""
        lines.append(f"| {name} | {r.get('steps', '')} | {r['samples_per_s']:,.0f} | {r['step_ms']:.1f} | {cell('quorum')} | "
                     f"{cell('lookup')} | {cell('dense') or cell('dense+update')} | {cell('push')} | {cell('allreduce')} | "
                     f"{cell('commit')} | "
                     f"{cell('checkpoint')} | {auc} | {'; '.join(x for x in (kills, heals) if x)} |")
    if "ratio_steady_to_single" in result:
        lines += ["", f"cpr (steady) to the single process: **{result['ratio_steady_to_single']:.2f}**."]
    faulty = {n: r for n, r in runs.items() if r.get("failures") or r.get("trainer_failures")}
    if faulty:
        lines += ["", f"Failures and saves (a full checkpoint every {result.get('save_every', 500)} steps, the last 2 "
                  "kept; the saving trainer waits for the snapshot, the files are written behind training):", "",
                  "| run | saves | on the training path | written behind | lost samples (PLS) | shard killed: "
                  "detection, adoption, load, serving | trainer killed: detection, steps with one fewer, back in |",
                  "|---|---:|---:|---:|---:|---|---|"]
        for name, r in faulty.items():
            shard = "; ".join(f"{f['actor']} ({f['recovery']}, from step {f['restored_step']}): {f['detection_s']:.2f} + "
                              f"{f['adoption_s']:.2f} + {f['load_s']:.2f} s, serving at {f['serving_s']:.2f} s"
                              for f in r["failures"])
            trainer = "; ".join(f"{t['actor']}: {t['detection_s']:.2f} s, {t['steps_with_fewer_trainers']} steps, "
                                f"{t['rejoined_s']:.1f} s (at step {t['replacement_joined_at_step']})"
                                for t in r["trainer_failures"] if t.get("rejoined_s") is not None)
            lines.append(f"| {name} | {r['checkpoints_saved']} | {r['save_split_s']['training_path']:.2f} s "
                         f"({r['overhead_pct_of_wall']['save']:.2f} % of the run) | {r['save_split_s']['background']:.1f} s | "
                         f"{r['lost_samples']:,.0f} ({r['pls']:.3f}) | {shard} | {trainer} |")
    lines += ["", "Peak RSS (MB; the largest process of each kind, and how many) beside the plan's estimate of the "
              "model state (weights and Adagrad state a shard, and with a full save's copy):", "",
              "| run | driver | shard | trainer | supervisor | estimate: shard (at a save) | checkpoint size |",
              "|---|---:|---:|---:|---:|---|---:|"]
    for name, r in runs.items():
        rss = r.get("rss") or {}
        cell = (lambda role: f"{rss[role]['max_mb']:,.0f} (x{rss[role]['processes']})" if role in rss else "")
        e = result["estimate_replica"] if name == "replica" else est
        shards = ", ".join(f"{a:,.0f} ({b:,.0f})" for a, b in zip(e["shards_mb"], e["shards_at_save_mb"]))
        ck = r.get("checkpoints") or []
        size = f"{max(c['bytes'] for c in ck) / 1e9:.2f} GB" if ck else ""
        rss_single = f"{r['peak_rss_mb']:,.0f}" if "peak_rss_mb" in r else cell("driver")
        lines.append(f"| {name} | {rss_single} | {cell('EmbeddingShard')} | {cell('RayTrainWorker')} | "
                     f"{cell('Supervisor')} | {shards if name != 'single' else ''} | {size} |")
    return "\n".join(lines) + "\n"
