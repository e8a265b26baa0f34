"""Soak: train under random SIGKILLs of shards, trainers, every trainer and the supervisor,
kills aimed at a save, a recovery and a rollback, stalls (SIGSTOP/SIGCONT) of a shard and a
trainer, and damaged checkpoint files met by a recovery and a rollback; then check each run
with ``cpr verify`` (the fault injector's own log, the audit logs, the data cache and the
checkpoint files, never the supervisor's books). Writes benchmarks/results/soak.json and
soak.md, the table rendered from the JSON (``--render`` renders it again).

    .venv/bin/python benchmarks/soak.py --seeds 0 1 2 3 4 5 6 7 8 9 --kills 20 --mtbf 6

With ``--hosts 3`` (as root: it makes network and PID namespaces), each run is on a fresh
namespace cluster of this machine (``scripts/local_cluster.sh``) with ``--host-faults`` host
kills and partitions among the faults, and what each host was left with is checked from inside
it; the results go to soak-hosts.json and soak-hosts.md:

    .venv/bin/python benchmarks/soak.py --hosts 3 --seeds 0 1 2 --kills 4 --host-faults 4 --mtbf 15
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
    hosts = max((r.get("hosts", 1) for r in rows), default=1)
    faults = sum(r["faults"] for r in rows)
    where = "one host" if hosts == 1 else f"a {hosts}-host namespace cluster"
    lines = [
        f"# Soak: faults of every kind on {where}, each run checked by `cpr verify`", "",
        f"Rendered from `{doc.get('file', 'soak.json')}`: {describe(doc['meta'])}.", "",
        f"{len(rows)} run{'s' if len(rows) != 1 else ''}, {faults} faults that landed (from the injector's own log; "
        f"{min((r['faults'] for r in rows), default=0)}-{max((r['faults'] for r in rows), default=0)} a run): "
        + _totals(rows) + f". **{sum(bool(r['finished']) for r in rows)} of {len(rows)} finished, "
        f"{sum(r['wedged'] for r in rows)} wedged, {sum(len(r['violations']) for r in rows)} violations**; "
        f"{min((r['wall_s'] for r in rows), default=0):.0f}-{max((r['wall_s'] for r in rows), default=0):.0f} s a run.", "",
        *_commits(rows),
        "| seed | faults | kills: shard / trainer / supervisor | stalls | damaged files "
        + ("| host kills | partitions | hosts lost " if hosts > 1 else "")
        + "| shard recoveries | supervisor restarts | every-trainer fallbacks | finished | wedged | violations "
        "| lost samples | AUC | wall s |",
        "|---|---|---|---|---|" + ("---|---|---|" if hosts > 1 else "") + "---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        k, o = r["kills_by_kind"], r["other_faults"]
        damaged = o.get("corrupt_checkpoint", 0) + o.get("truncate_checkpoint", 0)
        auc = "-" if r["auc"] is None else f"{r['auc']:.4f}"
        lost = "-" if r["lost_samples"] is None else f"{r['lost_samples']:,.0f}"
        host_cols = (f"| {o.get('host_kill', 0)} | {o.get('partition', 0)} | {r.get('hosts_lost', 0)} "
                     if hosts > 1 else "")
        lines.append(
            f"| {r['seed']} | {r['faults']} | {k.get('shard', 0)} / {k.get('trainer', 0)} / {k.get('supervisor', 0)}"
            + (f" / {k['mirror']} mirror" if k.get("mirror") else "") + " "
            f"| {o.get('stall', 0)} | {damaged} {host_cols}| {r['shard_recoveries']} | {r['supervisor_restarts']} "
            f"| {r['fallbacks']} | {r['finished']} | {r['wedged']} | {len(r['violations'])} | {lost} | {auc} "
            f"| {r['wall_s']} |"
        )
    bad = [(r["seed"], v) for r in rows for v in r["violations"]]
    if bad:
        lines += ["", "Violations:", ""] + [f"- seed {s}: {v}" for s, v in bad]
    return "\n".join(lines) + "\n"


def _totals(rows: list[dict]) -> str:
    """The faults of all runs by kind, in words."""
    def total(key: str, *kinds: str) -> int:
        return sum(r[key].get(k, 0) for r in rows for k in kinds)

    kinds = ("shard", "trainer", "supervisor") + (("mirror",) if total("kills_by_kind", "mirror") else ())
    parts = [f"{total('kills_by_kind', k)} {k}" for k in kinds]
    parts = [", ".join(parts) + " SIGKILLs", f"{total('other_faults', 'stall')} stalls",
             f"{total('other_faults', 'corrupt_checkpoint', 'truncate_checkpoint')} damaged checkpoint files"]
    if any(r.get("hosts", 1) > 1 for r in rows):
        parts += [f"{total('other_faults', 'host_kill')} host kills", f"{total('other_faults', 'partition')} partitions",
                  f"{sum(r.get('hosts_lost', 0) for r in rows)} hosts lost"]
    return "; ".join(parts)


def _commits(rows: list[dict]) -> list[str]:
    """A line naming each run's commit, where the runs were not all made at one."""
    at: dict[str, list[str]] = {}
    for r in rows:
        at.setdefault(r.get("commit") or "?", []).append(str(r["seed"]))
    if len(at) < 2:
        return []
    return ["Runs made at different commits: " + "; ".join(f"seeds {', '.join(s)} at `{c}`" for c, s in at.items())
            + ".", ""]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/soak.yaml")
    p.add_argument("--seeds", type=int, nargs="+", default=list(range(10)))
    p.add_argument("--kills", type=int, default=20)
    p.add_argument("--mtbf", type=float, default=6.0)
    p.add_argument("--hosts", type=int, default=1, help="1: this host; 2-9: a namespace cluster of that many hosts.")
    p.add_argument("--host-faults", type=int, default=4, help="Host kills and partitions per run (--hosts > 1).")
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--recovery", choices=["replica"], help="soak-replica: every shard with a mirror, mirrors killed too")
    p.add_argument("--render", action="store_true", help="Render the table again from its JSON, run nothing.")
    p.add_argument("--append", action="store_true",
                   help="Add these seeds' runs to the JSON's (each run names its own commit).")
    args = p.parse_args()
    out = Path(args.out)
    name = ("soak" if args.hosts == 1 else "soak-hosts") + (f"-{args.recovery}" if args.recovery else "")
    overrides = {"recovery": args.recovery} if args.recovery else {}
    if args.render:
        (out / f"{name}.md").write_text(render(json.loads((out / f"{name}.json").read_text())))
        return
    from app.soak import run_soak  # import cost: Ray and torch, not needed to render
    from app.soak_hosts import run_soak_on_hosts  # import cost: as above

    meta = run_metadata()
    doc = {"meta": meta, "file": f"{name}.json", "runs": []}
    if args.append and (out / f"{name}.json").exists():
        doc["runs"] = json.loads((out / f"{name}.json").read_text())["runs"]
        doc["meta"]["command"] += " (appended to the runs before)"
    out.mkdir(parents=True, exist_ok=True)
    for seed in args.seeds:
        t0 = time.time()
        if args.hosts == 1:
            result = run_soak(args.config, f"runs/{name}-{seed}", seed, args.kills, args.mtbf, overrides=overrides)
        else:
            result = run_soak_on_hosts(args.config, f"runs/soak-hosts-{seed}", seed, args.kills, args.mtbf,
                                       args.host_faults, args.hosts)
        result["wall_s"], result["commit"] = round(time.time() - t0, 1), meta["commit"]
        doc["runs"].append(result)
        print(json.dumps({k: v for k, v in result.items() if k != "violations"}), result["violations"][:5], flush=True)
        # Written after every run: a soak cut short still has the data behind its table.
        (out / f"{name}.json").write_text(json.dumps(doc, indent=1))
        (out / f"{name}.md").write_text(render(doc))
    print(render(doc))


if __name__ == "__main__":
    main()
