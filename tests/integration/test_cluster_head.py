"""A Ray head as a cluster starts it (`ray start --head --num-cpus=0`, its health checks set in
its own environment, as cluster.yaml does), joined by drivers whose environment says otherwise:
the lease check reads the head's node-death timeout, and a worker group started again gets its
torchft lighthouse on a head without CPUs."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from benchmarks.throughput_runs import stop_head
from tests.integration.test_cluster_job import _free_port
from tests.integration.test_front_door import plain_env

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

BIN = Path(sys.executable).parent
# The head declares a silent node dead after 700 ms x 4 = 2.8 s; the drivers' own environment
# says 500 ms x 8 = 4 s, which the cluster never uses.
HEAD_HEALTH = {"RAY_health_check_period_ms": "700", "RAY_health_check_failure_threshold": "4"}
DRIVER_HEALTH = {"RAY_health_check_period_ms": "500", "RAY_health_check_failure_threshold": "8"}


@pytest.fixture(scope="module")
def cpu_less_head(tmp_path_factory):
    """``ray start --head --block`` on 127.0.0.1 with no CPUs; yields the GCS address and the
    drivers' environment. Stopped by its own process group, never ``ray stop``."""
    env = {**plain_env(), "RAY_AUTH_MODE": "token", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    subprocess.run([str(BIN / "ray"), "get-auth-token", "--generate"], env=env, check=True, capture_output=True,
                   timeout=60)
    temp_dir = tempfile.mkdtemp(prefix="cpr-ray-", dir="/tmp")  # short: Ray's socket paths
    port, log = _free_port(), tmp_path_factory.mktemp("head") / "head.log"
    head = subprocess.Popen(
        [str(BIN / "ray"), "start", "--head", "--block", "--node-ip-address=127.0.0.1", f"--port={port}",
         "--num-cpus=0", "--include-dashboard=false", "--disable-usage-stats", f"--temp-dir={temp_dir}"],
        env={**env, **HEAD_HEALTH}, start_new_session=True, stdout=open(log, "wb"), stderr=subprocess.STDOUT)
    try:
        yield f"127.0.0.1:{port}", {**env, **DRIVER_HEALTH, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    finally:
        stop_head(head)
        shutil.rmtree(temp_dir, ignore_errors=True)


def _driver(address: str, env: dict, code: str) -> subprocess.CompletedProcess:
    """``code`` in a driver joined to the head (``ray.init`` retries until the head is up)."""
    prelude = f"import ray\nray.init(address={address!r}, namespace='head-test', log_to_driver=False)\n"
    return subprocess.run([sys.executable, "-c", prelude + code], env=env, capture_output=True, text=True,
                          timeout=180, cwd=env["PYTHONPATH"])


def test_the_lease_check_reads_the_heads_node_death_timeout_not_the_drivers(cpu_less_head, small_data, tmp_path):
    """ray.lease_s = 3 s outlasts the head's 2.8 s: refused before anything starts, naming the
    head's timeout, although the driver's own settings (4 s) would allow it."""
    address, env = cpu_less_head
    _driver(address, env, "")  # the head is up
    told = subprocess.run(
        [str(BIN / "cpr"), "train", "--no-progress", "--config", "configs/local.yaml",
         "--set", f"ray.address={address}", "--set", "ray.lease_s=3", "--set", f"run_dir={tmp_path / 'run'}",
         "--set", f"data.train=[{small_data.train_path}]", "--set", f"data.eval=[{small_data.eval_path}]",
         "--set", f"data.cache_dir={tmp_path / 'cache'}"],
        env=env, capture_output=True, text=True, timeout=180, cwd=env["PYTHONPATH"])
    errors = [line for line in told.stderr.splitlines() if line.startswith("error:")]
    assert told.returncode == 2 and len(errors) == 1, told.stderr[-3000:]
    assert errors[0].startswith("error: ray.lease_s=3 must be below the 2.8 s this cluster takes"), errors[0]


def test_a_worker_group_started_again_gets_its_lighthouse_on_a_head_without_cpus(cpu_less_head):
    """The torchft config of the group ``fit_with_restarts`` starts after Ray Train's controller
    gave up: its backend's lighthouse must be placed on the controller's node, which is the
    driver's, here a head without CPUs."""
    address, env = cpu_less_head
    done = _driver(address, env, (
        "from app.raytrain import TrainerGroup, make_torch_trainer\n"
        "from core.config import config_from_dict\n"
        "cfg = config_from_dict({'data': {'train': ['t.tsv'], 'eval': ['e.tsv']}})\n"
        "kwargs = {'bind': '127.0.0.1:0', 'min_replicas': 1}\n"
        "group = TrainerGroup(cfg, 'headtest', __import__('pathlib').Path('/tmp'), 'no-such-lighthouse', kwargs)\n"
        "config = make_torch_trainer(group, attempt=1).backend_config\n"
        "print('lighthouse at', config.backend_cls()._maybe_create_lighthouse_actor(config))\n"))
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert "lighthouse at http://" in done.stdout, done.stdout
