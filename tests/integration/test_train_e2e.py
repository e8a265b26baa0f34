"""End to end on a real local Ray: 2 embedding shards, 2 trainers (Ray Train + torchft),
234 steps; the loss falls, the held-out AUC clears a bound, every shard's rows changed
exactly where their ids were looked up, and nothing of the run stays behind.

The run is the failure-free run that the full-recovery test compares against
(``clean_run`` in conftest.py), so the suite trains it once."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from ray._common.test_utils import wait_for_condition

from actors.shard import EmbeddingShard

from .conftest import CLEAN_RUN_SPAN
from .test_shard_recovery import _local, _looked_up, _run

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]


def test_two_shards_two_trainers(ray_local, clean_run):
    cfg, (report, final_rows, _, _, _, plan, job) = clean_run
    assert cfg.embeddings.sharding == "table_wise"  # row_wise: the partial-recovery test

    # Nothing of the run stays behind on the cluster: shards, supervisor, and Ray Train's
    # controller with its torchft lighthouse (kept alive by Ray Train's SIGINT handler
    # unless fit() restores the previous one; the run's fit() ran on the main thread).
    # Only this run's actors: those started while it trained (the session's cluster also
    # runs other tests' jobs, whose drivers may have been killed moments ago).
    span = CLEAN_RUN_SPAN

    def leftovers():
        run = {"EmbeddingShard", "Supervisor", "TrainController", "LighthouseServerActor", "RayTrainWorker"}
        return [(a["ActorClassName"], a.get("Name"), a.get("Pid")) for a in ray_local._private.state.actors().values()
                if a["State"] == "ALIVE" and a["ActorClassName"] in run
                and span["start"] <= a.get("StartTime", 0) / 1000 <= span["end"]]

    try:
        wait_for_condition(lambda: not leftovers(), timeout=60, retry_interval_ms=500)
    except RuntimeError:
        raise AssertionError(f"left alive 60 s after the run: {leftovers()}") from None

    # Loss went down: mean training loss of the first 20 steps vs the last 20.
    on_disk = json.loads((Path(cfg.run_dir) / "report.json").read_text())
    assert report["steps"] == 234, report["steps"]
    losses = [p["loss"] for p in report["progress"]]
    assert np.mean(losses[-20:]) < np.mean(losses[:20]) - 0.02, (losses[:20], losses[-20:])
    # Held-out AUC: chance is 0.5; the hidden model's own ceiling is the upper bound.
    assert report["auc"] > 0.72, report["auc"]
    assert report["auc"] <= report["ceiling_auc"] + 0.01
    assert on_disk["samples_trained"] == report["steps"] * 4 * 128

    # Rows changed exactly where ids were looked up by training steps.
    looked_up = _looked_up(job, cfg, plan, range(report["steps"]))
    emb = cfg.embeddings
    for k, rows_k in enumerate(final_rows):
        initial = EmbeddingShard(
            k, list(plan.shards[k]), cfg.model.embedding_dim, emb.learning_rate, emb.eps, cfg.seed,
            microbatches_per_step=4,
        ).get_rows()
        for s, (w0, _), (w1, m1) in zip(plan.shards[k], initial, rows_k):
            changed = np.flatnonzero((w0 != w1).any(axis=1))
            expected = _local(looked_up[s.table], s)
            assert np.array_equal(changed, expected), (k, s, len(changed), len(expected))
            assert (m1[expected] > 0).all()


def test_shared_memory_transport_trains_exactly_as_ray_calls(ray_local, clean_run, tmp_path):
    """The default transport (shared memory between a trainer and the shards on its node)
    changes how arrays travel, not what is computed: the same run with every array in the
    Ray calls (the path before shared memory) ends with the same embedding rows, Adagrad
    state and dense parameters."""
    import io

    import torch

    from core.checkpoint import DENSE_FILE, CheckpointStore

    cfg, (report, final_rows, states, _, _, _, _) = clean_run
    assert all(s.shm_reads > 0 for s in states), states  # the default run did use shared memory
    via_ray = cfg.model_copy(
        update={
            "run_dir": str(tmp_path / "via-ray"),
            "embeddings": cfg.embeddings.model_copy(update={"transport": "ray"}),
        }
    )
    report_ray, rows_ray, states_ray, _, _, _, _ = _run(ray_local, via_ray)
    assert all(s.shm_reads == 0 for s in states_ray), states_ray
    assert report_ray["steps"] == report["steps"]
    for k, (ours, theirs) in enumerate(zip(final_rows, rows_ray)):
        for (w0, m0), (w1, m1) in zip(ours, theirs):
            np.testing.assert_allclose(w0, w1, rtol=1e-5, atol=1e-6, err_msg=f"shard {k} weights")
            np.testing.assert_allclose(m0, m1, rtol=1e-5, atol=1e-6, err_msg=f"shard {k} momentum")

    def dense(c):
        store = CheckpointStore(c.checkpoint_uri)
        step = max(store.list_committed())
        assert step == report["steps"]
        return torch.load(io.BytesIO(store.read_blob(step, DENSE_FILE)), weights_only=True)["model"]

    a, b = dense(cfg), dense(via_ray)
    assert list(a) == list(b)
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
