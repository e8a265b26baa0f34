"""Faults of whole hosts (``faults.hosts``) on a namespace cluster (``scripts/local_cluster.sh``):
a host killed and started again later, a host's link cut for a while. They are carried out from
the machine's root namespace, outside every host (``cpr chaos --run RUN_DIR hosts``): no process
of the run can kill or cut off its own host. Each step is written to the run's fault log
(``core.faultlog``) before and after it is done, as every other injected fault.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import threading
import time
from pathlib import Path

from core.config_failures import HostFault
from core.faultlog import FaultLog, fault_log_dir
from core.journal import PROGRESS_FILE

__all__ = ["Cluster", "run_host_faults", "last_step", "inject", "kill_host", "restart_host", "partition_host"]

logger = logging.getLogger(__name__)

_SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "local_cluster.sh"


class Cluster:
    """``scripts/local_cluster.sh`` of the cluster at ``directory``."""

    script = _SCRIPT

    def __init__(self, directory: str | os.PathLike, env: dict | None = None):
        self.directory = str(directory)
        self.env = {**(env or os.environ), "CPR_CLUSTER_DIR": self.directory}

    def __call__(self, *args: str, timeout_s: float = 240.0, check: bool = True) -> subprocess.CompletedProcess:
        done = subprocess.run([str(self.script), *args], env=self.env, capture_output=True, text=True, timeout=timeout_s)
        if check and done.returncode != 0:
            raise RuntimeError(f"local_cluster.sh {' '.join(args)} failed ({done.returncode}): {done.stderr[-1500:]}")
        return done

    @staticmethod
    def ip(n: int) -> str:
        return f"10.77.0.{10 + n}"

    def ray_alive(self, n: int) -> bool:
        return self("ray-alive", str(n), check=False).returncode == 0

    def up(self, n: int) -> bool:
        """Whether host ``n``'s init (its PID namespace) runs, with or without Ray."""
        return f"host {n} {self.ip(n)} init=down" not in self("status").stdout


def last_step(run_dir: str | os.PathLike) -> int:
    """The newest committed step the run's progress file names (-1: none yet)."""
    path = Path(run_dir) / PROGRESS_FILE
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return -1
    for line in reversed(lines):
        try:
            return int(json.loads(line).get("step", -1))
        except (json.JSONDecodeError, TypeError, ValueError):
            continue  # a line being written
    return -1


def _act(log: FaultLog, fault: str, n: int, trigger: str, action, **extra) -> float:
    """``action`` between a "sending" and a "sent" line (an "aborted" one if it raised);
    returns when it began."""
    target = f"host:{n}"
    t = log.write("sending", fault, target, None, trigger, ip=Cluster.ip(n), **extra)["t"]
    try:
        action()
    except BaseException as err:
        log.write("aborted", fault, target, None, trigger, ip=Cluster.ip(n), error=repr(err))
        raise
    log.write("sent", fault, target, None, trigger, ip=Cluster.ip(n), began=t, **extra)
    return t


def kill_host(cluster: Cluster, log: FaultLog, n: int, trigger: str, seconds: float | None = None) -> float:
    """SIGKILLs every process of host ``n`` at once; returns when."""
    return _act(log, "host_kill", n, trigger, lambda: cluster("kill-host", str(n)), seconds=seconds)


def restart_host(cluster: Cluster, log: FaultLog, n: int, trigger: str) -> float:
    """Starts host ``n`` again: what is left of it goes first (its init, so every process of
    its PID namespace), then a fresh host joins."""
    if cluster.up(n):
        cluster("kill-host", str(n))
    return _act(log, "host_add", n, trigger, lambda: cluster("add-host", str(n)))


def partition_host(cluster: Cluster, log: FaultLog, n: int, seconds: float, trigger: str,
                   stop: threading.Event | None = None) -> float:
    """Cuts host ``n``'s link for ``seconds`` and restores it; a host whose Ray node was
    declared dead meanwhile is started again. Returns when the link went down."""
    t = _act(log, "partition", n, trigger, lambda: cluster("link", str(n), "down"), seconds=seconds)
    (stop or threading.Event()).wait(seconds)
    _act(log, "heal", n, trigger, lambda: cluster("link", str(n), "up"))
    # Ray declares a host dead after about 1.5 s without an answer, and its raylet, back on the
    # network, learns so and exits: such a host is a lost one, and joins again as a new host.
    # A raylet still running 30 s after the link came back rode the cut out.
    deadline = time.monotonic() + 30.0
    while time.monotonic() < deadline:
        if not cluster.ray_alive(n):
            restart_host(cluster, log, n, trigger)
            break
        time.sleep(0.5)
    return t


def inject(cluster: Cluster, log: FaultLog, fault: HostFault, trigger: str, stop: threading.Event) -> None:
    """One host fault, whole: the host comes back (or its link does) even if ``stop`` is set
    meanwhile, so the cluster is whole again when this returns."""
    if fault.kind == "host_kill":
        kill_host(cluster, log, fault.host, trigger, fault.seconds)
        stop.wait(fault.seconds)
        restart_host(cluster, log, fault.host, trigger)
    else:
        partition_host(cluster, log, fault.host, fault.seconds, trigger, stop)


def run_host_faults(cluster: Cluster, run_dir: str | os.PathLike, faults: list[HostFault], stop: threading.Event,
                    poll_s: float = 0.2) -> list[HostFault]:
    """Injects each of ``faults`` once its step committed (in step order) until ``stop`` is set
    (the run is over). Returns the faults injected."""
    log = FaultLog(fault_log_dir(run_dir))
    done = []
    for fault in sorted(faults, key=lambda f: f.after_step):
        while last_step(run_dir) < fault.after_step:
            if stop.wait(poll_s):
                return done
        logger.warning("injecting %s of host %d (after step %d, %.1f s)", fault.kind, fault.host, fault.after_step,
                       fault.seconds)
        inject(cluster, log, fault, f"at step {fault.after_step}", stop)
        done.append(fault)
    return done
