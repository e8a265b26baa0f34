"""After a soak run: what each of its scheduled faults met (``scheduled_outcomes``, from the
injector's own log, the shards' audit logs and the run's events) and what is kept of the run
(``keep_or_clean``: a run with a finding is kept whole, so that ``cpr verify`` can be run on it
again; a sound one loses its checkpoints). No Ray: it reads files only.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Sequence
from pathlib import Path

from verify.files import RunFiles, load_run

__all__ = ["must_keep", "keep_or_clean", "scheduled_outcomes", "promoted_then_killed"]

# How long after a stall or slow storage ends its consequences (a declaration of death, a
# recovery) are still counted as its own: the soak's call timeouts are 10 s.
_AFTERMATH_S = 30.0
# The loads that put a new process in a shard's place (a rollback reloads every shard in place).
_REPLACED = ("recovery", "replica")


def must_keep(violations: Sequence[str], finished: bool, wedged: bool) -> bool:
    """A run is kept whole when ``cpr verify`` found something, or it did not finish."""
    return bool(violations) or not finished or wedged


def keep_or_clean(run_dir: str | Path, kept_root: str | Path, keep: bool, checkpoints: str | Path | None,
                  extra: Sequence[str | Path] = ()) -> str | None:
    """``keep``: moves ``run_dir`` whole (checkpoints included) to a folder of its own under
    ``kept_root``, with the ``extra`` files (the driver's log, the config it ran); returns that
    folder. Otherwise deletes ``checkpoints`` (every incremental was kept for the recount:
    gigabytes) and leaves the rest where it is; returns None."""
    run_dir = Path(run_dir)
    if not keep:
        if checkpoints is not None:
            shutil.rmtree(checkpoints, ignore_errors=True)
        return None
    kept_root = Path(kept_root)
    kept_root.mkdir(parents=True, exist_ok=True)
    # A stamp, not just the name: the next soak of the same seed starts by removing run_dir.
    dest = kept_root / f"{run_dir.name}-{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}"
    shutil.move(str(run_dir), str(dest))
    for path in map(Path, extra):
        if path.exists():
            shutil.move(str(path), str(dest / path.name))
    return str(dest)


def _events(run_dir: Path, run: RunFiles) -> list[dict]:
    path = run_dir / "events.jsonl"
    if path.exists():
        lines = path.read_text().splitlines()
        return [json.loads(line) for line in lines if line.strip().startswith("{")]
    return list((run.report or {}).get("events") or [])


def _matches(scheduled: dict, record: dict) -> bool:
    """Whether a line of the injector's log is this scheduled fault's (``shard``/``trainer``:
    whichever one the seed picked; ``all_trainers``: each trainer)."""
    if record.get("fault") != scheduled["fault"] or record.get("trigger") != scheduled["trigger"]:
        return False
    want, got = scheduled["target"], str(record.get("target"))
    if want in ("shard", "trainer"):
        return got.startswith(f"{want}:")
    if want == "all_trainers":
        return got.startswith("trainer:")
    return got == want


def _next_load(run: RunFiles, shard: int, after: float, before: float = float("inf"),
               why: tuple[str, ...] | None = None) -> dict | None:
    """Shard ``shard``'s first load (a promotion, a restore, a rollback; only those of ``why``
    if given) after ``after``."""
    loads = sorted((r for f in run.shards.get(shard, []) for r in f.records
                    if r.get("event") == "load" and after < r.get("t", 0.0) < before
                    and (why is None or r.get("why") in why)), key=lambda r: r["t"])
    if not loads:
        return None
    r = loads[0]
    return {"why": r.get("why"), "chain": r.get("chain"), "gen": r.get("gen"), "after_s": round(r["t"] - after, 2)}


def _kills_of(run: RunFiles, target: str, start: float, end: float) -> int:
    return sum(1 for r in run.faults if r.get("fault") == "kill" and r.get("event") == "sent"
               and r.get("target") == target and start <= r.get("kill_time", r.get("t", 0.0)) <= end)


def _aftermath(entry: dict, run: RunFiles, events: list[dict], t: float) -> dict:
    """What a stall or slow storage was followed by, within its length and ``_AFTERMATH_S``."""
    end = t + float(entry.get("seconds", 0.0)) + _AFTERMATH_S
    target = entry["target"]
    out: dict = {}
    if target.startswith(("shard:", "mirror:")):
        k = int(target.split(":")[1])
        out["mirror_lost"] = any(e.get("kind") == "mirror_lost" and e.get("shard") == k and t <= e.get("time", 0) <= end
                                 for e in events)
        # A stalled mirror must not cost its healthy primary its place (the slow party is the mirror).
        out["shard_replaced"] = _next_load(run, k, t, end, _REPLACED)
        out["shard_killed_by_injector"] = _kills_of(run, f"shard:{k}", t, end)
    if entry["fault"] == "slow_storage":
        kinds = [e.get("kind") for e in events if t <= e.get("time", 0) <= end]
        out["saves_committed"], out["saves_failed"] = kinds.count("checkpoint_saved"), kinds.count("checkpoint_failed")
        out["shards_replaced"] = {k: load for k in run.shards if (load := _next_load(run, k, t, end, _REPLACED))}
    return out


def _outcome(entry: dict, run: RunFiles, events: list[dict]) -> dict:
    lines = sorted((r for r in run.faults if _matches(entry, r)), key=lambda r: r.get("t", 0.0))
    sent = [r for r in lines if r.get("event") == "sent"]
    # The supervisor killing itself writes only its "sending" line.
    sent = sent or [r for r in lines if r.get("event") == "sending" and entry["target"] == "supervisor"]
    aborted = [r for r in lines if r.get("event") == "aborted"]
    out = {**entry, "landed": bool(sent)}
    if not sent:
        out["what_happened"] = f"aborted: {aborted[0].get('error')}" if aborted else "not met (the run never got there)"
        return out
    first = sent[0]
    t = float(first.get("kill_time", first.get("stall_time", first.get("began", first.get("t", 0.0)))))
    out["t"] = round(t, 3)
    out["target_hit"] = first.get("target")
    if entry["fault"] == "kill" and str(first.get("target")).startswith("shard:"):
        load = _next_load(run, int(first["target"].split(":")[1]), t)
        out["then"] = load
        out["what_happened"] = ("its mirror was promoted" if load and load["why"] == "replica" else
                                f"{load['why']} from checkpoint chain {load['chain']}" if load else "never loaded again")
    elif entry["fault"] in ("stall", "slow_storage"):
        out |= _aftermath(entry, run, events, t)
        resumed = any(r.get("fault") == "resume" and r.get("event") == "sent" and r.get("pid") == first.get("pid")
                      for r in run.faults)
        out["what_happened"] = _stall_words(out, resumed) if entry["fault"] == "stall" else _slow_words(out)
    else:
        out["what_happened"] = f"landed ({first.get('target')}" + (f", step {first['step']})" if "step" in first else ")")
    return out


def _stall_words(out: dict, resumed: bool) -> str:
    words = ["resumed" if resumed else "killed while stopped"]
    if out.get("mirror_lost"):
        words.append("the mirror was declared lost")
    load = out.get("shard_replaced")
    if load is not None:
        how = "its mirror promoted" if load["why"] == "replica" else f"{load['why']} from {load['chain']}"
        killed = " after an injected kill" if out.get("shard_killed_by_injector") else " with no injected kill"
        words.append(f"the shard was replaced{killed} ({how}, {load['after_s']} s later)")
    elif "shard_replaced" in out:
        words.append("the shard kept serving")
    return "; ".join(words)


def _slow_words(out: dict) -> str:
    replaced = out.get("shards_replaced") or {}
    return (f"{out['saves_committed']} saves committed, {out['saves_failed']} failed meanwhile; "
            + (f"shards replaced meanwhile: {sorted(replaced)}" if replaced else "no shard replaced"))


def scheduled_outcomes(run_dir: str | Path, scheduled: Sequence[dict]) -> list[dict]:
    """Each scheduled fault (``app.soak_plan.scheduled_faults``) with whether it landed and
    what happened: how a killed shard came back, whether a stalled mirror's primary kept
    serving, the saves meanwhile of slow storage."""
    run_dir = Path(run_dir)
    try:
        run = load_run(run_dir)
    except FileNotFoundError:
        return [{**e, "landed": False, "what_happened": "no run directory to read"} for e in scheduled]
    events = _events(run_dir, run)
    return [_outcome(entry, run, events) for entry in scheduled]


def promoted_then_killed(outcomes: Sequence[dict]) -> dict | None:
    """The replica scenario, as it went: a shard killed twice at steps, whose first kill
    promoted its mirror and whose second came before a new mirror existed (it was then
    restored from a checkpoint). None when the schedule has no such pair."""
    kills = [o for o in outcomes if o["fault"] == "kill" and o["trigger"].startswith("at step ")
             and o["target"].startswith("shard:")]
    for a, b in zip(kills, kills[1:]):
        if a["target"] != b["target"]:
            continue
        first, second = (a.get("then") or {}).get("why"), (b.get("then") or {}).get("why")
        return {"shard": a["target"], "steps": [a["after_step"], b["after_step"]],
                "met": a["landed"] and b["landed"] and first == "replica" and second not in (None, "replica"),
                "first_recovery": first, "second_recovery": second}
    return None
