"""The data benchmark's cluster section: the same Ray Data preprocessing on a 3-host cluster of
this machine (``scripts/local_cluster.sh``: a head with no CPUs for tasks, where the driver
runs, and two worker hosts of one CPU each, in their own network and PID namespaces), with
each host's share of the work (chunks, rows, task seconds, peak worker RSS). The hosts share
this machine's cores and files: the section shows the work spread over the hosts, not a
speed-up from more machines."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "local_cluster.sh"
HOSTS, WORKER_CPUS = 3, 1


def cluster_child(spec: dict, build) -> dict:
    """On the head: joins the cluster (RAY_ADDRESS from the harness) and builds the stores."""
    import ray

    t0 = time.perf_counter()
    ray.init(namespace="cpr-data-bench", log_to_driver=False)
    joined_s = time.perf_counter() - t0
    try:
        out = build(spec, local=False)
    finally:
        ray.shutdown()
    return {**out, "join_s": round(joined_s, 3), "driver_peak_rss_mb": out["peak_rss_mb"]}


def run_cluster(spec: dict, child_cmd: list[str], log: Path) -> dict:
    """Brings the cluster up, runs ``child_cmd`` on the head, tears the cluster down."""
    directory = tempfile.mkdtemp(prefix="cprb-", dir="/tmp")  # short: Ray's socket paths
    env = {**os.environ, "CPR_CLUSTER_DIR": directory, "CPR_CLUSTER_OWNER": str(os.getpid()),
           "CPR_PYTHON": sys.executable, "CPR_CLUSTER_HOSTS": str(HOSTS), "CPR_WORKER_CPUS": str(WORKER_CPUS)}
    env.pop("RAY_ADDRESS", None)

    def script(*args: str, **kw) -> subprocess.CompletedProcess:
        return subprocess.run([str(SCRIPT), *args], env=env, cwd=ROOT, **kw)

    try:
        up = script("up", capture_output=True, text=True, timeout=300)
        if up.returncode != 0:
            return {"error": f"local_cluster.sh up failed: {up.stderr[-2000:]}"}
        with open(log, "w") as f:
            rc = script("exec", "0", "--", *child_cmd, stdout=f, stderr=subprocess.STDOUT).returncode
        if rc != 0:
            return {"error": f"exit status {rc}; log {log}: ...{log.read_text(errors='replace')[-2000:]}"}
        return {}
    finally:
        down = script("down", capture_output=True, text=True, timeout=300)
        shutil.rmtree(directory, ignore_errors=True)
        if down.returncode != 0:
            print(f"local_cluster.sh down failed: {down.stderr[-2000:]}", file=sys.stderr)


def cluster_section(spec: dict, script_path: Path) -> dict:
    """The cluster's build of a fresh store, as a section of data.json."""
    workdir = Path(spec["workdir"])
    cache = workdir / "cache-cluster"
    shutil.rmtree(cache, ignore_errors=True)
    spec = {**spec, "cache_dir": str(cache)}
    out, log = workdir / "cluster.result.json", workdir / "logs" / "cluster.log"
    out.unlink(missing_ok=True)
    log.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, str(script_path), "--child", "ray_cluster", "--spec", json.dumps(spec), "--result", str(out)]
    print(f"cluster: {HOSTS} hosts (log {log})", flush=True)
    failed = run_cluster(spec, cmd, log)
    shutil.rmtree(cache, ignore_errors=True)
    if failed or not out.exists():
        return failed or {"error": f"no result; log {log}"}
    result = json.loads(out.read_text())
    total = sum(h["rows"] for h in result["hosts"].values()) or 1
    result["host_share"] = {ip: round(h["rows"] / total, 3) for ip, h in result["hosts"].items()}
    result.update(hosts_total=HOSTS, worker_cpus=WORKER_CPUS,
                  worker_peak_rss_mb=max((h["peak_rss_mb"] for h in result["hosts"].values()), default=None))
    print(f"cluster: {result['rows_per_s']:,} rows/s; share by host {result['host_share']}", flush=True)
    return result
