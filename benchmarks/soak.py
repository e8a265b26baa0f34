"""Soak: train under random SIGKILLs of shards, trainers, every trainer and the supervisor,
kills aimed at a save, a recovery and a rollback, stalls (SIGSTOP/SIGCONT) of a shard and a
trainer, and damaged checkpoint files met by a recovery and a rollback; then check each run
with ``cpr verify`` (the fault injector's own log, the audit logs, the data cache and the
checkpoint files, never the supervisor's books). Writes benchmarks/results/soak.json and
soak.md, the table rendered from the JSON (``--render`` renders it again).

    .venv/bin/python benchmarks/soak.py --seeds 0 1 2 3 4 5 6 7 8 9 --kills 20 --mtbf 6
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.meta import describe, run_metadata  # noqa: E402


def render(doc: dict) -> str:
    rows = doc["runs"]
    faults = sum(r["faults"] for r in rows)
    lines = [
        "# Soak: faults of every kind on one host, each run checked by `cpr verify`", "",
        f"Rendered from `soak.json`: {describe(doc['meta'])}.", "",
        f"{len(rows)} runs, {faults} faults that landed (from the injector's own log), "
        f"{sum(r['wedged'] for r in rows)} wedged, {sum(len(r['violations']) for r in rows)} violations.", "",
        "| seed | faults | kills: shard / trainer / supervisor | stalls | damaged files | shard recoveries "
        "| supervisor restarts | every-trainer fallbacks | finished | wedged | violations | lost samples | AUC "
        "| wall s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        k, o = r["kills_by_kind"], r["other_faults"]
        damaged = o.get("corrupt_checkpoint", 0) + o.get("truncate_checkpoint", 0)
        auc = "-" if r["auc"] is None else f"{r['auc']:.4f}"
        lost = "-" if r["lost_samples"] is None else f"{r['lost_samples']:,.0f}"
        lines.append(
            f"| {r['seed']} | {r['faults']} | {k.get('shard', 0)} / {k.get('trainer', 0)} / {k.get('supervisor', 0)} "
            f"| {o.get('stall', 0)} | {damaged} | {r['shard_recoveries']} | {r['supervisor_restarts']} "
            f"| {r['fallbacks']} | {r['finished']} | {r['wedged']} | {len(r['violations'])} | {lost} | {auc} "
            f"| {r['wall_s']} |"
        )
    bad = [(r["seed"], v) for r in rows for v in r["violations"]]
    if bad:
        lines += ["", "Violations:", ""] + [f"- seed {s}: {v}" for s, v in bad]
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/soak.yaml")
    p.add_argument("--seeds", type=int, nargs="+", default=list(range(10)))
    p.add_argument("--kills", type=int, default=20)
    p.add_argument("--mtbf", type=float, default=6.0)
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--render", action="store_true", help="Render soak.md again from soak.json, run nothing.")
    args = p.parse_args()
    out = Path(args.out)
    if args.render:
        (out / "soak.md").write_text(render(json.loads((out / "soak.json").read_text())))
        return
    from app.soak import run_soak  # import cost: Ray and torch, not needed to render

    doc = {"meta": run_metadata(), "runs": []}
    out.mkdir(parents=True, exist_ok=True)
    for seed in args.seeds:
        t0 = time.time()
        result = run_soak(args.config, f"runs/soak-{seed}", seed, args.kills, args.mtbf)
        result["wall_s"] = round(time.time() - t0, 1)
        doc["runs"].append(result)
        print(json.dumps({k: v for k, v in result.items() if k != "violations"}), result["violations"][:5], flush=True)
        # Written after every run: a soak cut short still has the data behind its table.
        (out / "soak.json").write_text(json.dumps(doc, indent=1))
        (out / "soak.md").write_text(render(doc))
    print(render(doc))


if __name__ == "__main__":
    main()
