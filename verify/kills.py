"""The fault injector's log against the report: the same kills on both sides."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from verify.files import AuditFile, RunFiles
from verify.store import files_read

__all__ = ["Kill", "Damage", "HostFault", "landed_kills", "check_kills", "counts_by_kind", "planted_damage",
           "stalled_pids", "check_damage_unused", "host_faults", "check_hosts", "host_victims"]


@dataclass(frozen=True)
class Kill:
    target: str
    pid: int
    time: float

    def key(self) -> tuple[str, int, float]:
        return self.target, self.pid, round(self.time, 3)


def landed_kills(run: RunFiles) -> tuple[list[Kill], list[str]]:
    """Kills whose signal went, from the injector's own log: a "sent" line, or a "sending"
    line of a process that killed itself (it cannot write after). Also the problems of the
    log itself."""
    problems = [f"the fault log has a torn line ({t}): every line is fsynced before its fault" for t in run.fault_torn]
    steps: dict[tuple, list[dict]] = {}
    for r in run.faults:
        if r.get("fault") != "kill":
            continue
        # The "sending" line's t and the "sent" line's kill_time are the very float the killer
        # took, as is the report's: matched as they are, rounded once (never twice) to compare.
        t = r.get("kill_time", r["t"])
        steps.setdefault((r["target"], r["pid"], t), []).append(r)
    kills = []
    for (target, pid, t), records in steps.items():
        events = {r["event"] for r in records}
        sending = next((r for r in records if r["event"] == "sending"), None)
        if "sent" in events or ("aborted" not in events and sending is not None and sending["sender"] == pid):
            kills.append(Kill(target, pid, t))
            if sending is None:
                problems.append(f"the kill of {target} (pid {pid}) at {t:.3f} has no line written before it")
        elif "aborted" not in events:
            problems.append(f"the kill of {target} (pid {pid}) at {t:.3f} was being sent and its sender never "
                            "said whether it went")
    return sorted(kills, key=lambda k: k.time), problems


def check_kills(run: RunFiles, kills: list[Kill]) -> list[str]:
    """Every landed kill is in the report, and the report names no other."""
    reported = Counter((k["target"], int(k["pid"]), round(float(k["time"]), 3))
                       for k in (run.report or {}).get("faults_injected", []))
    logged = Counter(k.key() for k in kills)
    v = [f"the kill of {t} (pid {p}) at {s:.3f} is in the fault log but not in the report"
         for (t, p, s), n in sorted((logged - reported).items()) for _ in range(n)]
    v += [f"the report names a kill of {t} (pid {p}) at {s:.3f} that the fault log lacks"
          for (t, p, s), n in sorted((reported - logged).items()) for _ in range(n)]
    return v


@dataclass(frozen=True)
class Damage:
    """A checkpoint file the injector damaged on purpose (and when)."""

    step: int
    shard: int
    file: str
    time: float


def planted_damage(run: RunFiles) -> list[Damage]:
    return [Damage(int(r["step"]), int(r["target"].split(":")[1]), r["file"], float(r["t"]))
            for r in run.faults if r["event"] == "sent" and r.get("fault") in ("corrupt_checkpoint", "truncate_checkpoint")]


def stalled_pids(run: RunFiles) -> set[int]:
    return {int(r["pid"]) for r in run.faults if r["event"] == "sent" and r.get("fault") == "stall"}


def crashed_attempt_pids(run: RunFiles, report: dict) -> set[int]:
    """The writers of an attempt that did not finish (its driver killed, the job stopped): the
    next attempt (``cpr train --resume``) began after them, so each ended where it was, as if
    killed. Writers of an attempt that finished are not among them."""
    starts = sorted((float(e["time"]), e.get("previous_state")) for e in report.get("events", [])
                    if e.get("kind") == "attempt_started" and e.get("time") is not None)
    spans, begun = [], float("-inf")
    for t, previous in starts:
        if previous != "finished":
            spans.append((begun, t))  # the attempt that ran from ``begun`` until the next began at ``t``
        begun = t
    if not spans:
        return set()
    files = [f for fs in run.shards.values() for f in fs] + run.trainers
    return {int(r["pid"]) for f in files for r in f.records[:1]
            if r.get("event") == "open" and r.get("pid") is not None and any(a <= r["t"] < b for a, b in spans)}


def check_damage_unused(run: RunFiles, damage: list[Damage], commit_time: Callable[[int], float | None],
                        plan_of: Callable[[int], list | None] = lambda step: None) -> list[str]:
    """No shard loads a checkpoint file after the injector damaged it: the product must refuse
    it and use the previous valid one. A checkpoint whose manifest was written after the damage
    (the step fenced by a rollback and saved again) is a new one from then on. ``plan_of(step)``:
    the rows each shard file of a checkpoint holds (its manifest's plan; None: not recorded),
    for a shard of another plan, which reads the files that hold its rows."""
    v = []
    for d in damage:
        saved_again = commit_time(d.step)
        until = saved_again if saved_again is not None and saved_again > d.time else float("inf")
        written = plan_of(d.step)
        for k, files in sorted(run.shards.items()):
            for f in files:
                if not _reads(k, f, d.shard, written):
                    continue
                for r in f.records:
                    if r.get("event") == "load" and d.time < r["t"] < until and d.step in r.get("chain", []):
                        v.append(f"shard {k} (generation {f.gen}) loaded checkpoint {d.step} at {r['t']:.3f}, after "
                                 f"its file {d.file} was damaged at {d.time:.3f}")
    return v


def _reads(k: int, f: AuditFile, j: int, written: list | None) -> bool:
    """Whether shard ``k``'s log ``f`` loads read shard ``j``'s file of a checkpoint whose plan
    gave each file ``written``'s rows: its own file under the same plan (or none recorded),
    else every file holding some of its rows."""
    mine = next((r.get("slices") for r in f.records if r.get("event") == "open"), None)
    if written is None or mine is None or f.kind == "mirror" or j >= len(written):
        return k == j
    return j in files_read(k, mine, written)


def counts_by_kind(run: RunFiles, kills: list[Kill]) -> tuple[Counter, Counter]:
    """(kills that landed by kind of target, other faults that went by kind), from the log."""
    others = Counter(r["fault"] for r in run.faults
                     if r["event"] == "sent" and r["fault"] not in ("kill", "resume", "free_storage", "heal", "host_add"))
    return Counter(k.target.split(":")[0] for k in kills), others


@dataclass(frozen=True)
class HostFault:
    """A whole host killed or cut off (``faults.hosts``), from the injector's log."""

    kind: str
    ip: str
    time: float


_HOST_FAULTS = ("host_kill", "partition")


def host_faults(run: RunFiles) -> list[HostFault]:
    return sorted((HostFault(r["fault"], r["ip"], float(r.get("began", r["t"]))) for r in run.faults
                   if r["event"] == "sent" and r.get("fault") in _HOST_FAULTS), key=lambda h: h.time)


def check_hosts(run: RunFiles, faults: list[HostFault]) -> list[str]:
    """Every host killed is in the report's lost hosts, and the report names no lost host that
    no host fault explains (a kill, or a partition Ray took for a loss). The report's times are
    Ray's and the supervisor's: a loss is declared after the fault, never before."""
    lost = sorted((run.report or {}).get("hosts_lost") or [], key=lambda h: h.get("declared_dead_at") or 0.0)
    v, used = [], set()
    for h in lost:
        at = float(h.get("declared_dead_at") or 0.0)
        cause = next((i for i, f in reversed(list(enumerate(faults)))
                      if f.ip == h.get("node_ip") and f.time <= at and i not in used), None)
        if cause is None:
            v.append(f"the report names the loss of host {h.get('node_ip')} at {at:.3f}, which no host fault in the "
                     "fault log explains")
        else:
            used.add(cause)
    for i, f in enumerate(faults):
        if f.kind == "host_kill" and i not in used:
            v.append(f"host {f.ip} was killed at {f.time:.3f} (fault log) but the report names no loss of it after that")
    return v


def host_victims(run: RunFiles, faults: list[HostFault]) -> set[int]:
    """pids of the shards and trainers that ran on a host when it was killed or cut off: they
    may die there mid-line, as a killed process does."""
    out = set()
    for f in [f for files in run.shards.values() for f in files] + run.trainers:
        for r in f.records:
            if r.get("event") == "open" and any(h.ip == r.get("ip") and r["t"] <= h.time for h in faults):
                out.add(int(r["pid"]))
    return out
