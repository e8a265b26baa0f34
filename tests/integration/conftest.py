"""Fixtures shared by integration tests (the Ray and data fixtures are in tests/conftest.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from .test_shard_recovery import _config, _run


# When the clean run trained (seconds since the epoch, start and end): the actors it started
# are those that started in between (the session's cluster also holds other tests' runs).
CLEAN_RUN_SPAN: dict[str, float] = {}


@pytest.fixture(scope="session")
def clean_run(ray_local, small_data, tmp_path_factory):
    """One failure-free run of the full-recovery config, trained once for the suite: the
    full-recovery test compares a failed run against it, the end-to-end test checks its
    training. Returns the config and what ``_run`` returns."""
    cfg = _config(tmp_path_factory.mktemp("clean"), small_data, "full", "clean")
    start = time.time()
    result = _run(ray_local, cfg)
    CLEAN_RUN_SPAN.update(start=start, end=time.time())
    return cfg, result


class LocalCluster:
    """A Ray cluster of ``hosts`` hosts on this machine (``scripts/local_cluster.sh``): host
    0 is the head (no CPUs for actors: driver, supervisor, controllers), the others are
    worker hosts, each in its own network and PID namespaces."""

    SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "local_cluster.sh"

    def __init__(self, directory: str, env: dict, hosts: int):
        self.dir = Path(directory)
        self.env = env
        self.hosts = hosts
        self.shared = self.dir / "shared"  # every host sees it: the storage the runs use
        self.local = self.dir / "local"  # a private tmpfs on every host

    def ip(self, n: int) -> str:
        return f"10.77.0.{10 + n}"

    def script(self, *args: str, timeout: float = 180) -> str:
        done = subprocess.run([str(self.SCRIPT), *args], env=self.env, capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            pytest.fail(f"local_cluster.sh {' '.join(args)} failed ({done.returncode}): {done.stderr[-2000:]}")
        return done.stdout

    def popen(self, host: int, argv: list[str], log: Path) -> subprocess.Popen:
        """Runs ``argv`` on host ``host`` (its own session, so that it can be stopped alone)."""
        return subprocess.Popen(
            [str(self.SCRIPT), "exec", str(host), "--", *argv], env=self.env, start_new_session=True,
            stdout=open(log, "wb"), stderr=subprocess.STDOUT,
        )

    def kill_host(self, n: int) -> float:
        t = time.time()
        self.script("kill-host", str(n))
        return t


@pytest.fixture(scope="module")
def local_cluster():
    """Head + 2 worker hosts, torn down at the end whatever happens (an interrupted run is
    torn down by the next ``up``, which reaps clusters whose owner process is gone). Fails,
    never skips, where network namespaces cannot be made."""
    directory = tempfile.mkdtemp(prefix="cprc-", dir="/tmp")  # short: Ray's socket paths
    # The script scrubs the loopback-only variables that the suite's own local Ray set in this
    # process (app.job.keep_ray_on_loopback) from everything it starts on the hosts.
    env = {**os.environ, "CPR_CLUSTER_DIR": directory, "CPR_CLUSTER_OWNER": str(os.getpid()),
           "CPR_PYTHON": sys.executable, "CPR_CLUSTER_HOSTS": "3", "CPR_WORKER_CPUS": "8"}
    cluster = LocalCluster(directory, env, 3)
    try:
        cluster.script("up")
        cluster.shared.mkdir()
        yield cluster
    finally:
        # `down` fails if it leaves a network namespace of this cluster behind.
        down = subprocess.run([str(LocalCluster.SCRIPT), "down"], env=env, capture_output=True, text=True, timeout=180)
        shutil.rmtree(directory, ignore_errors=True)
        assert down.returncode == 0, f"local_cluster.sh down failed: {down.stderr[-2000:]}"
