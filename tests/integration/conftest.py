"""Fixtures shared by integration tests (the Ray and data fixtures are in tests/conftest.py)."""

from __future__ import annotations

import pytest

from .test_shard_recovery import _config, _run


@pytest.fixture(scope="session")
def clean_run(ray_local, small_data, tmp_path_factory):
    """One failure-free run of the full-recovery config, trained once for the suite: the
    full-recovery test compares a failed run against it, the end-to-end test checks its
    training. Returns the config and what ``_run`` returns."""
    cfg = _config(tmp_path_factory.mktemp("clean"), small_data, "full", "clean")
    return cfg, _run(ray_local, cfg)
