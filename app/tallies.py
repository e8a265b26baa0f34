"""The numbers a run's report derives from its records in the same way whether the run
finished (``app.report.build_report``) or crashed and is rebuilt from its files
(``app.rebuild``): the hosts it lost, the seconds each fault-tolerance cost took, the saves' split and
failures, the mirrors.
"""

from __future__ import annotations

from core.memory import memory_estimate

__all__ = ["hosts_lost", "mirrors_section", "overhead_seconds", "save_split", "save_failures"]


def mirrors_section(cfg, summary: dict) -> dict | None:
    """Replica recovery's mirrors: their memory (``core.memory``), how many were built, lost or
    failed to build, how many took a shard's place, and the time trainers waited for them."""
    if cfg.recovery != "replica":
        return None
    events = summary.get("events", [])
    states = [st for st in summary.get("shards") or [] if "mirror_steps" in st]
    steps = sum(st["mirror_steps"] for st in states)
    return {
        "memory_bytes": memory_estimate(cfg, mirrors=True).mirror_bytes,
        "built": sum(e["kind"] == "mirror_ready" for e in events),
        "lost": sum(e["kind"] == "mirror_lost" for e in events),
        "failed_to_build": sum(e["kind"] == "mirror_failed" for e in events),
        "promoted": sum(f.get("recovery") == "replica" for f in summary.get("failures", [])),
        # Shards that had no mirror in sync when training started (recovered from a checkpoint
        # until one was built).
        "unprotected_at_start": next((e["shards"] for e in events if e["kind"] == "mirrors_missing"), []),
        "feed_steps": steps,
        "feed_s_per_step": sum(st["mirror_send_s"] for st in states) / steps if steps else None,
    }


def hosts_lost(events: list[dict]) -> list[dict]:
    """Each host (Ray node) of the run that Ray declared dead: its address, the run's actors
    it took, Ray's reason, and ``declared_dead_s``: from the first failed probe of its raylet
    (``actors.nodes.HostWatch``) to Ray's verdict, None when no probe failed before it."""
    out = []
    for e in events:
        if e.get("kind") != "host_lost":
            continue
        since = e.get("unreachable_since")
        out.append({
            "node_ip": e.get("node_ip"), "node_id": e.get("node_id"), "actors": e.get("actors", []),
            "reason": e.get("reason"), "declared_dead_at": e.get("declared_dead_at"), "unreachable_since": since,
            "declared_dead_s": round(e["declared_dead_at"] - since, 3) if since is not None else None,
        })
    return out


def overhead_seconds(saves: list[dict], failures: list[dict], step_time_s: float, tracking_s: float | None) -> dict:
    """Seconds of wall time each fault-tolerance cost took (None where it was not measured)."""
    return {
        "save": sum(e.get("duration_s") or 0.0 for e in saves),
        "tracking": tracking_s,
        "load": sum(f.get("load_s") or 0.0 for f in failures),
        "lost_computation": sum(f.get("lost_steps_recomputed") or 0 for f in failures) * step_time_s,
        "rescheduling": sum(f.get("reschedule_s") or 0.0 for f in failures),
    }


def save_split(saves: list[dict]) -> dict:
    """Seconds the saves held the training path (the snapshot) and ran in the background
    (write, hash, sync, commit): only the first is an overhead of training."""
    return {
        "training_path": round(sum(e.get("hold_s", e.get("duration_s")) or 0.0 for e in saves), 3),
        "background": round(sum(e.get("background_s") or 0.0 for e in saves), 3),
    }


def save_failures(events: list[dict]) -> dict:
    """Failed checkpoint saves from the events, for a run rebuilt without the supervisor's
    journal (which counts them itself): each ``checkpoint_failed`` that counted against
    ``budgets.max_failed_saves`` carries its count in a row (one a rollback abandoned does not)."""
    counted = [e["failed_in_a_row"] for e in events if e.get("kind") == "checkpoint_failed" and "failed_in_a_row" in e]
    return {"failed": len(counted), "longest_in_a_row": max(counted, default=0)}
