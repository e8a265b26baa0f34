"""The soak on several hosts: a namespace cluster of this machine (``scripts/local_cluster.sh``,
a head and worker hosts, each with its own network and PID namespaces), a run on it under
SIGKILLs and stalls (the run's own ``faults:``) and host kills and partitions (``faults.hosts``,
carried out from outside the hosts), then the check: what is left on each host, from inside it,
and the whole run by ``cpr verify`` and its replay (``cpr verify --replay``) once the cluster is
gone.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import numpy as np
import yaml

from app.host_chaos import Cluster, run_host_faults
from app.soak import replay_soak_run, soak_result, written_report
from app.soak_plan import scheduled_faults, soak_config
from core.config import load_config
from verify import verify_run

__all__ = ["host_fault_plan", "run_soak_on_hosts", "check_hosts"]

logger = logging.getLogger(__name__)


def host_fault_plan(seed: int, hosts: int, count: int, first_step: int, last_step: int) -> list[dict]:
    """``count`` host faults, host kills and partitions in turn (the first drawn from ``seed``),
    of random worker hosts, at steps spread over ``first_step..last_step``: a killed host is
    gone 3-10 s, a link cut 2-8 s."""
    rng = np.random.default_rng([seed, 25])
    span = (last_step - first_step) / max(count, 1)
    first_kind = int(rng.integers(2))
    out = []
    for i in range(count):
        kind = ("host_kill", "partition")[(first_kind + i) % 2]
        seconds = rng.uniform(3, 10) if kind == "host_kill" else rng.uniform(2, 8)
        out.append({"kind": kind, "host": int(rng.integers(1, hosts)), "seconds": round(float(seconds), 1),
                    "after_step": int(first_step + span * i + rng.uniform(0, span / 2))})
    return out


def _config(base_path: str, run_dir: Path, seed: int, kills: int, mtbf_s: float, host_faults: int, hosts: int,
            overrides: dict | None = None):
    base = load_config(base_path, overrides or {})
    cfg = soak_config(base, str(run_dir), seed, kills, mtbf_s).model_dump()
    last = base.training.max_steps or 1000
    cfg["faults"]["hosts"] = host_fault_plan(seed, hosts, host_faults, 30, int(last * 0.7))
    # A host is never killed for good, so the soak's fault kinds aimed at the run's own
    # processes stay as they are; the SIGKILLs are fewer, the host faults take their place.
    path = run_dir.parent / f"{run_dir.name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def check_hosts(cluster: Cluster, hosts: int, run_dir: Path, log: Path) -> list[str]:
    """What the run left on each host that is up (its init runs, with or without Ray), checked
    from inside it by ``cpr verify --host``; a check that did not report is a violation."""
    out = []
    for n in range(hosts):
        if not cluster.up(n):
            continue
        argv = [sys.executable, "-m", "app", "verify", str(run_dir), "--host", cluster.ip(n), "--wait", "30"]
        with open(log, "ab") as f:
            done = subprocess.run([str(cluster.script), "exec", str(n), "--", *argv,
                                   *(["--named-actors"] if n == 0 else [])],
                                  env=cluster.env, stdout=subprocess.PIPE, stderr=f, text=True, timeout=180)
        found = [line[len("violation: "):] for line in done.stdout.splitlines() if line.startswith("violation: ")]
        try:
            said = json.loads(done.stdout.strip().splitlines()[-1])
        except (IndexError, json.JSONDecodeError):
            said = None
        if said is None or said.get("left") != len(found) or done.returncode != (1 if found else 0):
            out.append(f"the check of host {n} did not report ({done.returncode}); see {log}")
        out += found
    return out


def _faults_thread(cluster: Cluster, run_path: Path, faults, stop: threading.Event, errors: list[str]) -> None:
    try:
        run_host_faults(cluster, run_path, faults, stop)
    except Exception as err:  # noqa: BLE001 - a fault that could not be carried out is the soak's violation
        errors.append(f"the host faults stopped: {err!r}")


def run_soak_on_hosts(config_path: str, run_dir: str, seed: int, kills: int, mtbf_s: float, host_faults: int,
                      hosts: int = 3, timeout_s: float = 1500.0, overrides: dict | None = None,
                      kept_root: str | None = None, keep_all: bool = False) -> dict:
    """One soak run on a fresh ``hosts``-host namespace cluster (``overrides`` as ``--set``). A
    run that does not finish within ``timeout_s`` counts as wedged. A run with a finding is
    moved whole, with the driver's log and its config, to ``kept_root`` (default: ``kept``
    beside the run)."""
    run_path = Path(run_dir).resolve()
    if run_path.exists():  # a run dir left from an earlier soak: the checker must not read it
        shutil.rmtree(run_path)
    run_path.parent.mkdir(parents=True, exist_ok=True)
    cluster_dir = tempfile.mkdtemp(prefix="cprs-", dir="/tmp")  # short: Ray's socket paths
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "GLOO_SOCKET_IFNAME")}
    env |= {"CPR_CLUSTER_HOSTS": str(hosts), "CPR_WORKER_CPUS": "8", "CPR_CLUSTER_OWNER": str(os.getpid()),
            "CPR_PYTHON": sys.executable}
    cluster = Cluster(cluster_dir, env)
    cfg_path = _config(config_path, run_path, seed, kills, mtbf_s, host_faults, hosts, overrides)
    log = run_path.parent / f"{run_path.name}.log"
    violations, wedged, driver = [], False, None
    stop = threading.Event()
    try:
        cluster("up", timeout_s=600)
        run_path.mkdir(parents=True, exist_ok=True)
        (run_path / "cluster.json").write_text(json.dumps({
            "dir": cluster_dir, "hosts": {cluster.ip(n): n for n in range(hosts)},
            "netns": cluster("netns").stdout.split()}))
        with open(log, "wb") as out:
            driver = subprocess.Popen(
                [str(cluster.script), "exec", "0", "--", sys.executable, "-m", "app", "train", "--config",
                 str(cfg_path)], env=cluster.env, start_new_session=True, stdout=out, stderr=subprocess.STDOUT)
        faults = load_config(str(cfg_path)).faults.hosts
        chaos = threading.Thread(target=_faults_thread, args=(cluster, run_path, faults, stop, violations),
                                 daemon=True)
        chaos.start()
        try:
            code = driver.wait(timeout=timeout_s)
            if code != 0:
                violations.append(f"the driver exited with {code}; see {log}")
        except subprocess.TimeoutExpired:
            wedged = True
            violations.append(f"wedged: not finished within {timeout_s:.0f}s")
        stop.set()
        chaos.join()  # bounded: every step of a host fault is a script call with its own limit
        violations += check_hosts(cluster, hosts, run_path, log)
    finally:
        stop.set()
        if driver is not None and driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
            driver.wait(timeout=30)
        cluster("down", timeout_s=300, check=False)
    verdict = verify_run(run_path, wait_s=10.0)
    # The model recomputed from the run's files: its checkpoints where its config says (the run
    # directory, seen from here as from every host), before a sound run loses them.
    replayed = replay_soak_run(run_path)
    report = written_report(run_path) or {}
    # The run keeps every incremental for the recount (keep_last): about 20-30 GB a run. A sound
    # run loses them once checked; one with a finding is kept whole.
    result = soak_result(seed, str(run_path), verdict, report, violations, wedged,
                         scheduled_faults(load_config(str(cfg_path)).faults),
                         kept_root or str(run_path.parent / "kept"), keep_all, str(run_path / "checkpoints"),
                         extra=(cfg_path, log), replay=replayed)
    return {"hosts": hosts, "hosts_lost": len(report.get("hosts_lost") or []), **result}
