"""Nothing of a finished run may be left: no process it started (the pids its processes wrote
into their audit and log files), no shared-memory file, no named actor, no network namespace
it made. A run on a namespace cluster (``cluster.json`` in the run directory, written by whoever
made the cluster) has its hosts' processes in PID namespaces of their own: each host is checked
from inside it (``cpr verify RUN_DIR --host IP``), the rest from outside."""

from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path

from verify.files import RunFiles

__all__ = ["run_processes", "leftovers", "cluster_hosts"]

_LOG_PID = re.compile(r"^(.+?)(?:-(\d+\.\d+\.\d+\.\d+))?-(\d+)\.log$")
SHM_DIR = Path("/dev/shm")
NETNS_DIR = Path("/var/run/netns")


def _cluster(run: RunFiles) -> dict:
    """The run's ``cluster.json``: the namespace cluster it ran on ({} for a run on this host)."""
    path = run.run_dir / "cluster.json"
    return json.loads(path.read_text()) if path.exists() else {}


def cluster_hosts(run: RunFiles) -> dict[str, int]:
    """IP -> host number of the namespace cluster the run ran on (none for a run on this host)."""
    return _cluster(run).get("hosts", {})


def run_processes(run: RunFiles, host: str | None = None) -> dict[int, tuple[str, float]]:
    """pid -> (what it was, a time it was alive at) for every process of the run that wrote
    a file: shards and trainers (their audit), every actor (its log file). ``host``: only those
    of that cluster host (pids of its PID namespace); None: those of no cluster host."""
    cluster = cluster_hosts(run)

    def mine(ip: str | None) -> bool:
        return ip == host if host is not None else ip not in cluster

    out: dict[int, tuple[str, float]] = {}
    for f in [f for files in run.shards.values() for f in files] + run.trainers:
        for r in f.records:
            if r.get("event") == "open" and "pid" in r and mine(r.get("ip")):
                out[int(r["pid"])] = (f"{f.kind} {f.key} (audit {f.path.name})", float(r["t"]))
    logs = run.run_dir / "logs"
    for p in logs.glob("*.log") if logs.is_dir() else []:
        m = _LOG_PID.match(p.name)
        if m and mine(m.group(2)):
            out.setdefault(int(m.group(3)), (f"{m.group(1)} (log {p.name})", p.stat().st_mtime))
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


def _started_by(pid: int, seen_at: float) -> bool:
    """Process ``pid`` runs and is the one seen at ``seen_at`` (a later process that reused the
    pid is not the run's)."""
    started = _alive_since(pid)
    return started is not None and started <= seen_at + 1.0


def _named_actors(run_id: str, namespace: str) -> list[str]:
    ray = sys.modules.get("ray")  # only when the caller is connected to the run's cluster
    if ray is None or not ray.is_initialized() or not run_id:
        return []
    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["namespace"] == namespace and run_id in a["name"]]


def _once(run: RunFiles, procs: dict[int, tuple[str, float]], shm: bool, netns: list[str]) -> list[str]:
    """What is still there: the run's processes and named actors, with ``shm`` its shared-memory
    files, and which of the network namespaces ``netns`` exist."""
    out = [f"process {pid}: {what}" for pid, (what, seen_at) in sorted(procs.items()) if _started_by(pid, seen_at)]
    run_id = run.run_info.get("run_id") or (run.report or {}).get("run_id") or ""
    if shm and run_id and SHM_DIR.is_dir():
        out += [f"shared-memory file {p}" for p in sorted(SHM_DIR.glob(f"cpr-{run_id}-*"))]
    out += [f"named actor {n}" for n in _named_actors(run_id, run.run_info.get("namespace", ""))]
    return out + [f"network namespace {n}" for n in netns if (NETNS_DIR / n).exists()]


def leftovers(run: RunFiles, wait_s: float = 10.0, host: str | None = None) -> list[str]:
    """What the run left behind, after waiting up to ``wait_s`` for it to go (on cluster host
    ``host`` only: its processes and named actors)."""
    procs = run_processes(run, host)
    # A host checked from inside has no shared-memory file or namespace of the run's to answer for.
    whole_run = host is None
    netns = run.run_info.get("netns", []) + _cluster(run).get("netns", []) if whole_run else []
    deadline = time.monotonic() + wait_s
    while (left := _once(run, procs, whole_run, netns)) and time.monotonic() < deadline:
        time.sleep(0.5)
    where = f" on host {host}" if host is not None else ""
    return [f"left behind{where} after the run: {x}" for x in left]
