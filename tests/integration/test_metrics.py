"""The run's Prometheus metrics, read where Prometheus reads them: Ray's metrics export on
127.0.0.1, after a run with a trainer kill and a shard kill. Each value is checked against
the run's own report."""

from __future__ import annotations

import re
import time
import urllib.request

import pytest

from core.config import config_from_dict
from app.job import TrainingJob
from app.rayenv import metrics_url

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

_SAMPLE = re.compile(r'^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>.*)\})?\s+(?P<value>\S+)$')
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def _scrape(url: str, run_id: str) -> list[tuple[str, dict, float]]:
    """The cpr samples of run ``run_id``: (name, labels, value)."""
    body = urllib.request.urlopen(url, timeout=10).read().decode()
    out = []
    for line in body.splitlines():
        m = _SAMPLE.match(line)
        if not m or not m["name"].startswith("ray_cpr_"):
            continue
        labels = dict(_LABEL.findall(m["labels"] or ""))
        if labels.get("run_id") == run_id:
            out.append((m["name"], labels, float(m["value"])))
    return out


def _total(samples, name: str, **match) -> float | None:
    """Sum of ``name`` over the series whose labels include ``match`` (a restarted process
    is a series of its own); None when there is none."""
    values = [v for n, labels, v in samples if n == name and all(labels.get(k) == w for k, w in match.items())]
    return sum(values) if values else None


def test_metrics_exported_with_run_id(ray_local, small_data, tmp_path):
    cfg = config_from_dict(
        {
            "run_dir": str(tmp_path / "run"),
            "seed": 5,
            "data": {"train": [small_data.train_path], "eval": [small_data.eval_path], "cache_dir": str(tmp_path / "cache")},
            "model": {"embedding_dim": 8, "table_rows": 20_000, "dense_arch": [32, 8], "over_arch": [32, 1]},
            "embeddings": {"num_shards": 2, "call_timeout_s": 30},
            "training": {"num_trainers": 2, "microbatch_rows": 128, "microbatches_per_step": 4, "max_steps": 160,
                         "progress_every_steps": 1},
            "checkpoint": {"every_steps": 10, "policy": "mfu", "r": 0.25},
            "recovery": "partial",
            "faults": {"max_failures": 0, "at_steps": {"trainer": [15], "shard": [55]}, "seed": 1},
        }
    )
    job = TrainingJob(cfg, show_progress=False)
    try:
        job.start()
        job.fit()
        report = job.finish()
        url = metrics_url()
        assert url is not None and url.startswith("http://127.0.0.1:")
        saves = [e for e in report["events"] if e["kind"] == "checkpoint_saved"]

        def exported() -> list | None:
            samples = _scrape(url, report["run_id"])
            # Ray's agent exports every few seconds: wait until the last values are in.
            # A kill fired at a step lands a moment later, sometimes right after a save: then the
            # recovery loses nothing and the counter, which Ray exports from its first increment, is absent.
            lost = _total(samples, "ray_cpr_lost_samples_total")
            done = _total(samples, "ray_cpr_step") == report["steps"] and _total(
                samples, "ray_cpr_checkpoints_total") == len(saves) and (lost is not None or report["lost_samples"] == 0)
            return samples if done else None

        deadline = time.monotonic() + 90
        samples = exported()
        while samples is None and time.monotonic() < deadline:
            time.sleep(1)
            samples = exported()
        assert samples is not None, sorted({n for n, _, _ in _scrape(url, report["run_id"])})
    finally:
        job.close()

    assert _total(samples, "ray_cpr_total_steps") == report["steps"] == 160
    # The replacement trainer takes seconds to start: 145 steps leave it time to rejoin.
    (trainer,) = report["trainer_failures"]
    assert trainer["rejoined_s"] is not None, trainer
    assert _total(samples, "ray_cpr_samples_per_second") > 0
    assert 0 < _total(samples, "ray_cpr_loss") < 1.0
    assert _total(samples, "ray_cpr_failures_total", kind="shard", recovery="partial") == 1
    assert _total(samples, "ray_cpr_failures_total", kind="trainer") == 1
    for kind in ("shard", "trainer"):
        assert _total(samples, "ray_cpr_detection_seconds_count", kind=kind) == 1, kind
        assert _total(samples, "ray_cpr_recovery_seconds_count", kind=kind) == 1, kind
    shard = report["failures"][0]
    # The shard's recovery time falls in the histogram's bucket that holds the report's figure.
    buckets = sorted(
        (float(labels["le"]), v) for n, labels, v in samples
        if n == "ray_cpr_recovery_seconds_bucket" and labels.get("kind") == "shard"
    )
    assert [v for le, v in buckets] == [float(le >= shard["recovery_s"]) for le, _ in buckets], (buckets, shard["recovery_s"])
    assert (_total(samples, "ray_cpr_lost_samples_total") or 0.0) == pytest.approx(report["lost_samples"])
    assert _total(samples, "ray_cpr_pls") == pytest.approx(report["pls"], rel=1e-6)
    assert _total(samples, "ray_cpr_checkpoint_bytes_total") == sum(e["bytes"] for e in saves)
    assert _total(samples, "ray_cpr_checkpoint_seconds_count") == len(saves)
    incremental = [e for e in saves if e["checkpoint_kind"] == "incremental"]
    assert incremental and _total(samples, "ray_cpr_checkpoints_total", kind="incremental") == len(incremental)
    # MFU's candidates at each shard's last save (the final one, full, leaves them as they were).
    last = saves[-1]
    for k, rows in enumerate(last["tracked_rows"]):
        assert _total(samples, "ray_cpr_tracked_rows", shard=str(k)) == rows
    assert sum(last["tracked_rows"]) > 0
