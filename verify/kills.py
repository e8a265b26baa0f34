"""The fault injector's log against the report: the same kills on both sides."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from verify.files import RunFiles

__all__ = ["Kill", "Damage", "landed_kills", "check_kills", "counts_by_kind", "planted_damage", "stalled_pids",
           "check_damage_unused"]


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
        t = r.get("kill_time", r["t"])
        steps.setdefault((r["target"], r["pid"], round(t, 6)), []).append(r)
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


def check_damage_unused(run: RunFiles, damage: list[Damage]) -> list[str]:
    """No shard loads a checkpoint file after the injector damaged it: the product must refuse
    it and use the previous valid one."""
    v = []
    for d in damage:
        for f in run.shards.get(d.shard, []):
            for r in f.records:
                if r.get("event") == "load" and r["t"] > d.time and d.step in r.get("chain", []):
                    v.append(f"shard {d.shard} (generation {f.gen}) loaded checkpoint {d.step} at {r['t']:.3f}, after "
                             f"its file {d.file} was damaged at {d.time:.3f}")
    return v


def counts_by_kind(run: RunFiles, kills: list[Kill]) -> tuple[Counter, Counter]:
    """(kills that landed by kind of target, other faults that went by kind), from the log."""
    others = Counter(r["fault"] for r in run.faults
                     if r["event"] == "sent" and r["fault"] not in ("kill", "resume", "free_storage"))
    return Counter(k.target.split(":")[0] for k in kills), others
