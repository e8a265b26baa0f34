"""Soak: train under random SIGKILLs of shards, trainers, every trainer and the supervisor,
kills aimed at a save, a recovery and a rollback, stalls (SIGSTOP/SIGCONT) of a shard and a
trainer, and damaged checkpoint files met by a recovery and a rollback; then check each run
with ``cpr verify`` (the fault injector's own log, the audit logs, the data cache and the
checkpoint files, never the supervisor's books) and replay it (``cpr verify --replay``: the
model recomputed in one process and compared with every checkpoint, bit for bit). Writes
OUT/soak.json (the commit, the machine, the date, the command; each run's faults met, each
scheduled fault and what happened, its replay beside its training time) and soak.md, the table
rendered from the JSON (``--render`` renders it again). A run with a violation (a replay's
finding among them), or unfinished, is moved whole to KEPT (default RUNS/kept) for ``cpr
verify`` again; a sound one keeps its logs and audit in RUNS and loses its checkpoints. The soak
stops before a run when less than --min-free-gib is free under RUNS.

    .venv/bin/python benchmarks/soak.py                      # 10 seeds, 20 random kills each
    .venv/bin/python benchmarks/soak.py --recovery replica   # soak-replica.json

With ``--recovery replica`` every shard has a mirror; mirrors are killed too, and each seed
also meets a promoted shard killed again before its new mirror exists, a stall of each mirror
and slow checkpoint storage (``app.soak_plan.replica_scenario``).

With ``--hosts 3`` (as root: it makes network and PID namespaces), each run is on a fresh
namespace cluster of this machine (``scripts/local_cluster.sh``) with ``--host-faults`` host
kills and partitions among the faults, and what each host was left with is checked from inside
it; the results go to soak-hosts.json and soak-hosts.md (seeds 3-7 unless named):

    .venv/bin/python benchmarks/soak.py --hosts 3

A short trial: ``--seeds 0 1 --kills 4 --set training.max_steps=600 --out /tmp/x --runs /tmp/x/runs``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.meta import describe, run_metadata  # noqa: E402


def render(doc: dict) -> str:
    rows = doc["runs"]
    hosts = max((r.get("hosts", 1) for r in rows), default=1)
    faults = sum(r["faults"] for r in rows)
    wanted = doc.get("min_faults") or 0
    where = "one host" if hosts == 1 else f"a {hosts}-host namespace cluster"
    short = [r["seed"] for r in rows if r["faults"] < wanted]
    lines = [
        f"# Soak: faults of every kind on {where}, each run checked by `cpr verify`", "",
        f"Rendered from `{doc.get('file', 'soak.json')}`: {describe(doc['meta'])}.", "",
        f"{len(rows)} run{'s' if len(rows) != 1 else ''}, {faults} faults that landed (from the injector's own log; "
        f"{min((r['faults'] for r in rows), default=0)}-{max((r['faults'] for r in rows), default=0)} a run"
        + (f"; {len(rows) - len(short)} of {len(rows)} met at least {wanted}" if wanted else "") + "): "
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
            f"| {r['seed']} | {r['faults']}{f' (< {wanted})' if r['faults'] < wanted else ''} "
            f"| {k.get('shard', 0)} / {k.get('trainer', 0)} / {k.get('supervisor', 0)}"
            + (f" / {k['mirror']} mirror" if k.get("mirror") else "") + " "
            f"| {o.get('stall', 0)} | {damaged} {host_cols}| {r['shard_recoveries']} | {r['supervisor_restarts']} "
            f"| {r['fallbacks']} | {r['finished']} | {r['wedged']} | {len(r['violations'])} | {lost} | {auc} "
            f"| {r['wall_s']} |"
        )
    lines += _replays(rows)
    lines += _scheduled(rows)
    bad = [(r["seed"], v) for r in rows for v in r["violations"]]
    if bad:
        lines += ["", "Violations:", ""] + [f"- seed {s}: {v}" for s, v in bad]
    if doc.get("stopped"):
        lines += ["", f"**The soak {doc['stopped']}.**"]
    kept = [(r["seed"], r["kept"]) for r in rows if r.get("kept")]
    if kept:
        lines += ["", "Kept whole, checkpoints included, for `cpr verify DIR` again:", ""]
        lines += [f"- seed {s}: `{path}`" for s, path in kept]
    return "\n".join(lines) + "\n"


def _replays(rows: list[dict]) -> list[str]:
    """Each run's replay (``cpr verify --replay``, ``app.soak.replay_entry``) beside its
    training time. Nothing when no run was replayed (results from before the soak replayed);
    a run without a replay has blank cells."""
    if not any(r.get("replay") for r in rows):
        return []
    return ["", _replay_words(rows), "",
            "| seed | steps replayed | checkpoints matched | bit for bit | findings | not replayed "
            "| loads: shard / dense | replay s (recompute) | training s | final model = failure-free run's |",
            "|---|---|---|---|---|---|---|---|---|---|",
            *("| " + " | ".join([str(r["seed"]), *_replay_cells(r)]) + " |" for r in rows)]


def _replay_words(rows: list[dict]) -> str:
    """The replays in a sentence: how many were sound, their time beside the training's, and
    how many final models equal the failure-free run's."""
    replays = [r["replay"] for r in rows if r.get("replay")]
    done = [e for e in replays if "error" not in e]
    raised = len(replays) - len(done)
    words = [f"{sum(1 for e in done if not e['findings'] and not e['gaps'])} of {len(replays)} sound and complete, "
             f"{sum(1 for e in done if e['exact'])} bit for bit" + (f", **{raised} raised**" if raised else "")]
    timed = [(r["seed"], e["wall_s"] / e["train_seconds"]) for r in rows
             if (e := r.get("replay")) and "error" not in e and e.get("train_seconds") and e.get("wall_s") is not None]
    if timed:
        slower = [str(seed) for seed, ratio in timed if ratio > 1]
        words.append(f"replay time {min(x for _, x in timed):.0%}-{max(x for _, x in timed):.0%} of the training time"
                     + (f", **longer than training for seed{'s' if len(slower) > 1 else ''} {', '.join(slower)}**"
                        if slower else ""))
    equal = [r["failure_free_equal"] for r in rows if r.get("failure_free_equal") is not None]
    if equal:
        words.append(f"the final model equals the failure-free run's bit for bit in {sum(equal)} of the "
                     f"{len(equal)} runs with no partial recovery (promotions and full rollbacks only)")
    return ("Each run replayed (`cpr verify --replay`: the model recomputed in one process, step by committed step, "
            "and compared with every checkpoint the run left; a finding, a checkpoint it could not replay and a "
            "replay that raised are violations): " + "; ".join(words) + ".")


def _replay_cells(r: dict) -> list[str]:
    """A run's cells of the replay table; blank where the run has no replay."""
    e = r.get("replay")
    if not e:
        return [""] * 9

    def num(x, fmt: str = "") -> str:
        return "" if x is None else format(x, fmt)

    times = [num(e.get("wall_s"), ".0f") + (f" ({e['seconds']:.0f})" if e.get("seconds") is not None else ""),
             num(e.get("train_seconds"), ".0f")]
    if "error" in e:
        return [f"raised {e['error']}", "", "", "", "", "", *times, ""]
    equal = r.get("failure_free_equal")
    return [num(e["steps"], ","), str(e["checkpoints"]), "yes" if e["exact"] else "**no**", str(e["findings"]),
            num(e.get("gaps")), f"{num(e.get('shard_loads'))} / {num(e.get('dense_loads'))}", *times,
            "- (partial recovery)" if equal is None else "yes" if equal else "**no**"]


def _scheduled(rows: list[dict]) -> list[str]:
    """The scheduled (not random) faults of each run: how many landed, and with mirrors what the
    scenario met. Runs from before the soak recorded them have none."""
    rows = [r for r in rows if r.get("scheduled")]
    if not rows:
        return []
    replica = any("promoted_shard_killed_before_new_mirror" in r for r in rows)
    lines = ["", "Scheduled faults (at steps and points; each one, and what happened, is in the JSON's `scheduled`):", "",
             "| seed | landed | not landed |" + (" promoted shard killed again before its new mirror | mirror stalls "
                                                  "| slow storage |" if replica else ""),
             "|---|---|---|" + ("---|---|---|" if replica else "")]
    for r in rows:
        sched = r["scheduled"]
        missed = [f"{o['fault']} {o['target']} {o['trigger']}" for o in sched if not o["landed"]]
        cells = [str(r["seed"]), f"{len(sched) - len(missed)} of {len(sched)}", "; ".join(missed) or "-"]
        if replica:
            pair = r.get("promoted_shard_killed_before_new_mirror") or {}
            cells.append(f"{'met' if pair.get('met') else '**not met**'}: {pair.get('shard')} at steps "
                         f"{pair.get('steps')}, then {pair.get('first_recovery')}, then {pair.get('second_recovery')}")
            cells.append("; ".join(f"{o['target']}: {o['what_happened']}" for o in sched
                                   if o["fault"] == "stall" and o["target"].startswith("mirror:")) or "-")
            cells.append("; ".join(o["what_happened"] for o in sched if o["fault"] == "slow_storage") or "-")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _totals(rows: list[dict]) -> str:
    """The faults of all runs by kind, in words."""
    def total(key: str, *kinds: str) -> int:
        return sum(r[key].get(k, 0) for r in rows for k in kinds)

    kinds = ("shard", "trainer", "supervisor") + (("mirror",) if total("kills_by_kind", "mirror") else ())
    parts = [f"{total('kills_by_kind', k)} {k}" for k in kinds]
    parts = [", ".join(parts) + " SIGKILLs", f"{total('other_faults', 'stall')} stalls",
             f"{total('other_faults', 'corrupt_checkpoint', 'truncate_checkpoint')} damaged checkpoint files"]
    if total("other_faults", "slow_storage"):
        parts.append(f"{total('other_faults', 'slow_storage')} spells of slow storage")
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


# What a soak runs when the command line names nothing (issue 39's final soaks): on one host 10
# seeds of at least 20 faults each; on the cluster 5 seeds, 7 among them (its host loss once ended
# the run for good).
ONE_HOST = {"seeds": list(range(10)), "kills": 20, "mtbf": 6.0, "min_faults": 20}
CLUSTER = {"seeds": [3, 4, 5, 6, 7], "kills": 4, "mtbf": 15.0, "min_faults": 0}


def _args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/soak.yaml")
    p.add_argument("--seeds", type=int, nargs="+", help="One run per seed (default: 0-9; 3-7 with --hosts).")
    p.add_argument("--kills", type=int, help="Random kills per run (default 20; 4 with --hosts).")
    p.add_argument("--mtbf", type=float, help="Mean seconds between random kills (default 6; 15 with --hosts).")
    p.add_argument("--min-faults", type=int,
                   help="Faults a run should meet (default 20 on one host): a run that met fewer says so.")
    p.add_argument("--hosts", type=int, default=1, help="1: this host; 2-9: a namespace cluster of that many hosts.")
    p.add_argument("--host-faults", type=int, default=4, help="Host kills and partitions per run (--hosts > 1).")
    p.add_argument("--out", default="benchmarks/results", help="Where the results JSON and its table go.")
    p.add_argument("--runs", default="runs", help="Where the run directories go.")
    p.add_argument("--kept", help="Where a run with a violation (or unfinished) is moved whole (default RUNS/kept).")
    p.add_argument("--keep-all", action="store_true", help="Keep every run whole, sound ones too.")
    p.add_argument("--min-free-gib", type=float, default=40.0,
                   help="Stop before a run when less disk than this is free under RUNS (a run keeps every "
                        "checkpoint until checked: 15-35 GB for a one-host run of 2,340 steps; a kept run "
                        "keeps them).")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="Override a field of the config, as cpr train --set (a short trial: training.max_steps=600).")
    p.add_argument("--recovery", choices=["replica"],
                   help="soak-replica: every shard with a mirror; mirrors killed and stalled, a promoted shard "
                        "killed again before its new mirror, slow storage")
    p.add_argument("--render", action="store_true", help="Render the table again from its JSON, run nothing.")
    p.add_argument("--append", action="store_true",
                   help="Add these seeds' runs to the JSON's (each run names its own commit).")
    args = p.parse_args(argv)
    for key, value in (ONE_HOST if args.hosts == 1 else CLUSTER).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.kept = args.kept or str(Path(args.runs) / "kept")
    return args


def _overrides(args: argparse.Namespace) -> dict:
    out = {"recovery": args.recovery} if args.recovery else {}
    for item in args.sets:
        key, eq, raw = item.partition("=")
        if not eq:
            raise SystemExit(f"--set: expected KEY=VALUE, got {item!r}")
        out[key] = yaml.safe_load(raw)
    return out


def _short_of_disk(runs: Path, min_free_gib: float, seed: int) -> str | None:
    """Why the soak stops before ``seed``'s run (the disk under ``runs`` is short), or None."""
    runs.mkdir(parents=True, exist_ok=True)
    free_gib = shutil.disk_usage(runs).free / 2**30
    if free_gib >= min_free_gib:
        return None
    return (f"stopped before seed {seed}: {free_gib:.1f} GiB free under {runs}, below --min-free-gib {min_free_gib:g} "
            "(kept runs hold their checkpoints: move them elsewhere, or lower the limit)")


def main(argv: list[str] | None = None) -> None:
    args = _args(argv)
    out = Path(args.out)
    name = ("soak" if args.hosts == 1 else "soak-hosts") + (f"-{args.recovery}" if args.recovery else "")
    if args.render:
        (out / f"{name}.md").write_text(render(json.loads((out / f"{name}.json").read_text())))
        return
    from app.soak import run_soak  # import cost: Ray and torch, not needed to render
    from app.soak_hosts import run_soak_on_hosts  # import cost: as above

    overrides = _overrides(args)
    doc = {"meta": run_metadata(), "file": f"{name}.json", "runs": [], "min_faults": args.min_faults,
           "kept_runs": str(Path(args.kept).resolve()), "overrides": overrides}
    if args.append and (out / f"{name}.json").exists():
        doc["runs"] = json.loads((out / f"{name}.json").read_text())["runs"]
        doc["meta"]["command"] += " (appended to the runs before)"
    out.mkdir(parents=True, exist_ok=True)
    for seed in args.seeds:
        if (stopped := _short_of_disk(Path(args.runs), args.min_free_gib, seed)) is not None:
            doc["stopped"] = stopped
            print(stopped, flush=True)
            (out / f"{name}.json").write_text(json.dumps(doc, indent=1))
            (out / f"{name}.md").write_text(render(doc))
            break
        t0 = time.time()
        run_dir = str(Path(args.runs) / f"{name}-{seed}")
        if args.hosts == 1:
            result = run_soak(args.config, run_dir, seed, args.kills, args.mtbf, overrides=overrides,
                              kept_root=args.kept, keep_all=args.keep_all)
        else:
            result = run_soak_on_hosts(args.config, run_dir, seed, args.kills, args.mtbf, args.host_faults,
                                       args.hosts, overrides=overrides, kept_root=args.kept, keep_all=args.keep_all)
        result["wall_s"], result["commit"] = round(time.time() - t0, 1), doc["meta"]["commit"]
        doc["runs"].append(result)
        brief = {k: v for k, v in result.items() if k not in ("violations", "scheduled")}
        print(json.dumps(brief), result["violations"][:5], flush=True)
        # Written after every run: a soak cut short still has the data behind its table.
        (out / f"{name}.json").write_text(json.dumps(doc, indent=1))
        (out / f"{name}.md").write_text(render(doc))
    print(render(doc))


if __name__ == "__main__":
    main()
