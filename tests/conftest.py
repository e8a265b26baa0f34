"""Shared fixtures. Integration tests share one real local Ray, bound to 127.0.0.1 with
token authentication; unit tests never start Ray."""

from __future__ import annotations

import os

import pytest

from tests.s3_server import CREDENTIALS, S3Server

os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
os.environ.setdefault("RAY_AUTH_MODE", "token")
# moto's credentials, before Ray starts: the run's workers get the driver's AWS variables.
for _k, _v in CREDENTIALS.items():
    os.environ.setdefault(_k, _v)


@pytest.fixture(scope="session")
def ray_local():
    import ray

    from app.rayenv import embedded_system_config, keep_ray_on_loopback, ray_system_config, worker_env

    keep_ray_on_loopback()
    os.environ.update(worker_env())  # as cpr's embedded Ray: the workers inherit them (app.rayenv)
    ray.init(
        _node_ip_address="127.0.0.1",
        num_cpus=8,
        namespace="cpr",
        include_dashboard=False,
        # Metrics reach Ray's export every 2 s instead of 10 (test_metrics reads them).
        _system_config={**ray_system_config(), **embedded_system_config(8), "metrics_report_interval_ms": 2000},
    )
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def small_data(tmp_path_factory):
    """Synthetic Criteo data shared by integration tests: 120k train rows, 8k held out.

    One epoch of it at 128-row microbatches, M=4, is 234 steps and reaches a held-out AUC
    of about 0.75 (ceiling 0.80); more epochs overfit the rare ids of this generator.
    """
    from core.data import generate

    out = tmp_path_factory.mktemp("data")
    summary = generate(str(out), 120_000, 8_000, fmt="tsv", seed=1, vocab_rows=5_000)
    return summary


@pytest.fixture(scope="session")
def s3(tmp_path_factory):
    """A real S3 API server (moto) on 127.0.0.1 for the session, with a bucket ``cpr``."""
    server = S3Server(tmp_path_factory.mktemp("s3") / "moto.log")
    try:
        server.bucket("cpr")
        yield server
    finally:
        server.stop()
