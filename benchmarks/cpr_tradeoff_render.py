"""The tables of ``benchmarks/cpr_tradeoff.py``'s results, rendered from its JSON (the .md files
beside it and the blocks of docs/RESULTS.md and docs/EMULATION.md, through
``benchmarks/render_docs.py``). Imports no Ray session and runs no training."""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from benchmarks.meta import describe
from app.emulation import CHARGED, MEASURED

ROOT = Path(__file__).resolve().parents[1]


def summarize(values: list[float]) -> dict:
    return {"mean": statistics.fmean(values), "min": min(values), "max": max(values), "n": len(values)}


EMULATION_ROWS = (("full", "full"), ("partial", "full"), ("partial", "mfu"), ("partial", "ssu"), ("replica", "full"))
# ``cpr_tradeoff.py --only-rows NAME``: the emulation's rows by name (recovery, policy).
ROW_KEYS = {"full": ("full", "full"), "cpr": ("partial", "full"), "mfu": ("partial", "mfu"), "ssu": ("partial", "ssu"),
            "replica": ("replica", "full")}
# The real part's components (the emulation's OVERHEADS add the mirrors' feed and promotions).
REAL_COMPONENTS = ("save", "load", "lost_computation", "rescheduling", "tracking")


def _rel(path: str) -> str:
    p = Path(path).resolve()
    return str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else str(p)


def _mm(rows: list[dict], key, spec: str = ".2f") -> str:
    """Mean (min–max) of ``key`` over ``rows``."""
    s = summarize([key(r) for r in rows])
    return f"{s['mean']:{spec}} ({s['min']:{spec}}–{s['max']:{spec}})"


def _mm4(rows: list[dict], key) -> str:
    return _mm(rows, key, "+.4f")


TITLES = {"real": "CPR trade-off on real runs: overhead vs PLS vs AUC",
          "emulation": "CPR trade-off in the production-scale emulation"}


def _header(res: dict) -> str:
    """``benchmarks.meta.describe`` of the result's metadata (older files: their command and machine)."""
    if "meta" in res:
        return describe(res["meta"]) + "."
    return f"`{res.get('command', '?')}` on {res.get('machine', '?')} (no commit or date recorded)."


def render_real(res: dict) -> str:
    """The real part's tables, from its JSON (``cpr_tradeoff_real.json``)."""
    a = argparse.Namespace(**res["args"])
    rows = res["rows"]
    lines = [
        _header(res), "",
        f"Config `{Path(a.config).name}` (2 trainers, 2 shards, table_wise) on {a.rows:,} synthetic rows "
        f"({res['total_steps']} steps), seeds {a.seeds}. Checkpoints every {a.every_steps} steps with full saves; "
        f"MFU/SSU save r={a.r} of a shard's rows every {max(1, round(a.every_steps * a.r))} steps, every "
        f"{a.full_every}th save full. Failures: shards SIGKILLed at steps drawn with exponential gaps of mean "
        f"{a.mtbf_steps} steps, the same for every row of a seed. Everything here is measured on this machine. "
        "Overheads in % of the seed's failure-free training time (no saves, no failures); mean (min–max) over seeds. "
        "*Extra training* is the training time measured against the failure-free run; the components should add up "
        "to about it.", "",
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
                + " | ".join(_mm(rs, lambda r, k=k: r["overhead_pct"][k]) for k in REAL_COMPONENTS)
                + f" | {_mm(rs, lambda r: r['save_background_pct'])} | {_mm(rs, lambda r: r['extra_training_pct'])} |"
            )
    return "\n".join(lines) + "\n"


_ROW_NAMES = {("full", "full"): "full recovery, Young/Daly interval", ("partial", "full"): "CPR-vanilla (partial, full saves)",
              ("partial", "mfu"): "CPR-MFU", ("partial", "ssu"): "CPR-SSU",
              ("replica", "full"): "replica (mirrors), Young/Daly interval"}


def _provenance(res: dict) -> list[str]:
    """Which rows came from a later commit than the file's ``meta`` (``--only-rows``), and from which."""
    later: dict[tuple, list[int]] = {}
    for r in res["rows"]:
        if r.get("commit"):
            later.setdefault((r["commit"], r["recovery"], r["policy"]), []).append(r["seed"])
    if not later:
        return []
    runs = {a["commit"]: a for a in res.get("appended", [])}
    parts = []
    for (commit, recovery, policy), seeds in later.items():
        a = runs.get(commit, {})
        same = a.get("clean_auc_same")
        parts.append(
            f"**{_ROW_NAMES[(recovery, policy)]}**, seeds {sorted(seeds)}: `{a.get('command', '?')}` at commit `{commit}`, "
            f"date {a.get('date', '?')}; its AUC change is against the seed's failure-free run rerun at that commit"
            + ("" if same is None else (" (the same AUCs as the first runs')" if same else " (AUCs differ from the first runs')")))
    return ["Rows added later (`--only-rows`; every other row and the sweep are the runs above): " + "; ".join(parts) + ".", ""]


def _mm_opt(rows: list[dict], key: str, scale: float = 1.0, spec: str = ".2f") -> str:
    """``_mm`` of ``key`` over the rows that have it (older rows lack the replica fields): '—' if none."""
    have = [r for r in rows if r.get(key) is not None]
    return _mm(have, lambda r: scale * r[key], spec) if have else "—"


def _intro(res: dict, step_h: float) -> list[str]:
    cfg, seeds, total_steps = res["config"], res["args"]["seeds"], res["total_steps"]
    p, tr, g = cfg["emulation"], cfg["training"], cfg["data"]["generate"]
    return [
        _header(res), "", *_provenance(res),
        f"Config `{res['config_file']}` as it is ({tr['num_trainers']} trainers, {cfg['embeddings']['num_shards']} "
        f"shards, {g['train_rows']:,} synthetic training rows in microbatches of {tr['microbatch_rows']}, "
        f"{tr['microbatches_per_step']} a step: {total_steps} steps); the benchmark sets only the seed, the recovery "
        f"mode, the row policy and the PLS target. Seeds {seeds}. Emulated: {p['duration_h']:g} h of failure-free "
        f"training on {p['nodes']} hosts (one step = {step_h:.2f} h), host MTBF {p['node_mtbf_h']:g} h (job MTBF "
        f"{p['node_mtbf_h'] / p['nodes']:.1f} h); failures drawn on the emulated clock from the seed, the same for "
        "every row of a seed. Mean (min–max) over seeds; AUC change against the seed's failure-free run.", "",
        f"**Measured** on the real runs: PLS, AUC, the rows each save wrote, the steps a full recovery redid, the "
        f"real step time and the share of it MFU/SSU access tracking took; for replica recovery, the share of it the "
        f"trainers waited for the mirrors to hold each step (mirror feed) and each promotion's time from the kill to "
        f"serving again. **Charged at production constants**, "
        f"not timed: save {p['save_s']:g} s per full save (a partial save its share of the rows), load "
        f"{p['load_s']:g} s per full load (a partial recovery its shard's share), rescheduling {p['reschedule_s']:g} s "
        f"per recovery from a checkpoint (a promotion waits for no new host), lost computation = redone steps × "
        f"{step_h:.2f} h. For one interval and one failure schedule "
        "these are the same on any machine; with full saves the save charge is the same for every seed. The constants and their "
        "sources: docs/EMULATION.md.", "",
    ]


def _sweep(res: dict) -> list[str]:
    fit = res["fit"]
    lines = [
        "**AUC change against PLS** (partial recovery, full saves, a sweep of PLS targets = checkpoint intervals; "
        "PLS and AUC change measured, per seed):", "",
        "| PLS target | interval (h) | failures | PLS (measured) | AUC change (measured) |", "|---:|---:|---:|---:|---:|",
    ]
    for t in sorted({r["pls_target"] for r in res["sweep"]}):
        rs = [r for r in res["sweep"] if r["pls_target"] == t]
        lines.append(f"| {t} | {rs[0]['interval_h']:.1f} | {_mm(rs, lambda r: r['failures'])} | "
                     + ", ".join(f"{r['pls']:.4f}" for r in rs) + " | " + ", ".join(f"{r['auc_change']:+.4f}" for r in rs) + " |")
    return lines + [
        "",
        f"Fitted through the origin: **AUC change = {fit['slope']:.4f} × PLS** (rmse {fit['rmse']:.4f}, {fit['n']} runs). "
        f"An AUC budget of {fit['auc_budget']} implies a **PLS target of {fit['implied_pls_target']:.4f}**"
        + (f" (used: {fit['pls_target_used']:.4f}, clamped to [0.005, 0.5])" if abs(fit['pls_target_used'] - fit['implied_pls_target']) > 1e-9 else "")
        + ", used for the CPR rows below.", "",
    ]


def _measured(res: dict, groups: list) -> list[str]:
    lines = [
        "**Measured** on the real runs (full recovery, replica recovery and CPR at that PLS target):", "",
        "| run | failures | PLS | AUC change | steps redone | rows per save (share of the model) | real step time (ms; wall training time / steps, recoveries included) | tracking (% of the real step) | mirror feed (% of the real step) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for k, rs in groups:
        lines.append(
            f"| {_ROW_NAMES[k]} | {_mm(rs, lambda r: r['failures'])} | {_mm(rs, lambda r: r['pls'], '.4f')} | "
            f"{_mm4(rs, lambda r: r['auc_change'])} | {_mm(rs, lambda r: r['steps_redone'], '.1f')} | "
            f"{_mm(rs, lambda r: r['rows_saved_share_mean'] or 0.0, '.3f')} | "
            f"{_mm(rs, lambda r: 1000 * r['step_s_real'], '.0f')} | {_mm(rs, lambda r: r['tracking_share_of_step_pct'])} | "
            f"{_mm_opt(rs, 'mirror_feed_share_of_step_pct')} |"
        )
    clean_ms = [1000 * v for v in res.get("clean_step_s", {}).values()]
    if clean_ms:
        lines += ["", f"Failure-free runs (no saves, no failures): {statistics.fmean(clean_ms):.0f} ms a step "
                      f"({min(clean_ms):.0f}–{max(clean_ms):.0f})."]
    return lines


def _replica(groups: list) -> list[str]:
    rs = dict(groups).get(("replica", "full"))
    if not rs:
        return []
    return [
        "", "**Replica recovery**, measured (per run, mean (min–max) over seeds): recoveries by a promoted mirror and "
        "from a checkpoint (a shard that died with no mirror in sync: a partial recovery, charged as one); "
        "a promotion's time from the kill to serving again; the trainers' wait for the mirrors per step and shard; "
        "the kills that waited, in real time, for a mirror to be rebuilt (the emulation kills no shard then), and the "
        "delay that put on the emulated clock:", "",
        "| promoted | from a checkpoint | promotion, kill to serving (s) | mirror feed (ms a step, per shard) | "
        "mirrors built / lost | mirrors' memory (MiB) | kills that waited for a mirror | longest wait (real s) | "
        "kill delay on the emulated clock (h, longest) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        f"| {_mm_opt(rs, 'promotions')} | {_mm_opt(rs, 'fallbacks')} | {_mm_opt(rs, 'promotion_s_mean')} | "
        f"{_mm_opt(rs, 'mirror_feed_s_per_step', 1000.0)} | {_mm_opt(rs, 'mirrors_built', spec='.1f')} / "
        f"{_mm_opt(rs, 'mirrors_lost', spec='.1f')} | {_mm_opt(rs, 'mirror_memory_bytes', 2.0**-20, '.1f')} | "
        f"{_mm_opt(rs, 'kills_waited_for_mirror')} | {_mm_opt(rs, 'waited_for_mirror_s_max')} | "
        f"{_mm_opt(rs, 'kill_delay_h_max')} |",
    ]


def render_emulation(res: dict) -> str:
    """The emulation's tables, from its JSON (``cpr_tradeoff_emulation.json``): the measured
    numbers and the overheads charged at the production constants in separate tables. Rows
    appended later (``--only-rows``) carry their commit, and the text says which."""
    step_h = res["config"]["emulation"]["duration_h"] / res["total_steps"]
    groups = [(k, [r for r in res["rows"] if (r["recovery"], r["policy"]) == k]) for k in EMULATION_ROWS]
    groups = [(k, rs) for k, rs in groups if rs]
    lines = [*_intro(res, step_h), *_sweep(res), *_measured(res, groups), *_replica(groups)]
    lines += [
        "",
        "**Overhead**, % of the failure-free production time: the components **charged at production constants**, "
        "then the **measured** ones (tracking and the mirrors' feed: their shares of the step time, applied to the "
        "production time; promotions: their kill-to-serving seconds), then the total:", "",
        "| run | interval: policy's (h) / used (steps, h) | saves | save | load | lost computation | rescheduling | "
        "charged total | tracking (measured) | mirror feed (measured) | promotion (measured) | overhead total | first-order model |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for k, rs in groups:
        lines.append(
            f"| {_ROW_NAMES[k]} | {rs[0]['interval_h']:.1f} / {rs[0]['every_steps']}, {rs[0]['every_steps'] * step_h:.1f} | "
            f"{_mm(rs, lambda r: r['saves'], '.0f')} | "
            + " | ".join(_mm(rs, lambda r, c=c: r["charged_overhead_pct"][c]) for c in CHARGED)
            + f" | {_mm(rs, lambda r: r['charged_total_pct'])} | "
            + " | ".join(_mm(rs, lambda r, c=c: r["measured_overhead_pct"].get(c, 0.0), ".3f" if c == "promotion" else ".2f")
                         for c in MEASURED)
            + f" | **{_mm(rs, lambda r: r['overhead_total_pct'])}** | {_mm(rs, lambda r: r['expected_overhead_pct'])} |"
        )
    lines += ["", "*First-order model*: the policy's expected overhead for these constants (policies.decide_recovery), "
                  "with the interval it picks, before any run; for replica it takes the mirrors at "
                  "`checkpoint.replica_step_frac` of every step and a promotion at its `promote_cost_s`, where the row "
                  "measures both."]
    return "\n".join(lines) + "\n"


RENDER = {"real": render_real, "emulation": render_emulation}


def write_md(part: str, res: dict, path: Path) -> str:
    text = f"# {TITLES[part]}\n\n" + RENDER[part](res)
    path.write_text(text)
    return text
