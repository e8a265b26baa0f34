"""Nothing of a finished run may be left: no process it started (on this host: the pids its
processes wrote into their audit and log files), no shared-memory file, no named actor, no
network namespace it made."""

from __future__ import annotations

import os
import re
import sys
import time
from pathlib import Path

from verify.files import RunFiles

__all__ = ["run_processes", "leftovers"]

_LOG_PID = re.compile(r"^(.+)-(\d+)\.log$")
SHM_DIR = Path("/dev/shm")
NETNS_DIR = Path("/var/run/netns")


def run_processes(run: RunFiles) -> dict[int, tuple[str, float]]:
    """pid -> (what it was, a time it was alive at) for every process of the run that wrote
    a file: shards and trainers (their audit), every actor (its log file)."""
    out: dict[int, tuple[str, float]] = {}
    for f in [f for files in run.shards.values() for f in files] + run.trainers:
        for r in f.records:
            if r.get("event") == "open" and "pid" in r:
                out[int(r["pid"])] = (f"{f.kind} {f.key} (audit {f.path.name})", float(r["t"]))
    logs = run.run_dir / "logs"
    for p in logs.glob("*.log") if logs.is_dir() else []:
        m = _LOG_PID.match(p.name)
        if m:
            out.setdefault(int(m.group(2)), (f"{m.group(1)} (log {p.name})", p.stat().st_mtime))
    out.pop(os.getpid(), None)  # the checker's own process (the soak's driver)
    return out


def _boot_time() -> float:
    for line in Path("/proc/stat").read_text().splitlines():
        if line.startswith("btime "):
            return float(line.split()[1])
    return 0.0


def _alive_since(pid: int) -> float | None:
    """When process ``pid`` started (epoch seconds); None if there is none, or a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()
    if fields[0] in ("Z", "X"):
        return None
    return _boot_time() + int(fields[19]) / os.sysconf("SC_CLK_TCK")


def _named_actors(run_id: str, namespace: str) -> list[str]:
    ray = sys.modules.get("ray")  # only when the caller is connected to the run's cluster
    if ray is None or not ray.is_initialized() or not run_id:
        return []
    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["namespace"] == namespace and run_id in a["name"]]


def _once(run: RunFiles, procs: dict[int, tuple[str, float]]) -> list[str]:
    out = []
    for pid, (what, seen_at) in sorted(procs.items()):
        started = _alive_since(pid)
        if started is not None and started <= seen_at + 1.0:  # a later process with a reused pid is not the run's
            out.append(f"process {pid}: {what}")
    run_id = run.run_info.get("run_id") or (run.report or {}).get("run_id") or ""
    if run_id and SHM_DIR.is_dir():
        out += [f"shared-memory file {p}" for p in sorted(SHM_DIR.glob(f"cpr-{run_id}-*"))]
    out += [f"named actor {n}" for n in _named_actors(run_id, run.run_info.get("namespace", ""))]
    out += [f"network namespace {n}" for n in run.run_info.get("netns", []) if (NETNS_DIR / n).exists()]
    return out


def leftovers(run: RunFiles, wait_s: float = 10.0) -> list[str]:
    """What the run left behind, after waiting up to ``wait_s`` for it to go."""
    procs = run_processes(run)
    deadline = time.monotonic() + wait_s
    while True:
        left = _once(run, procs)
        if not left or time.monotonic() >= deadline:
            return [f"left behind after the run: {x}" for x in left]
        time.sleep(0.5)
