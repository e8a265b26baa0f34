"""A mirror's audit log from its start (issue 41, gap 1): with ``audit_log`` a mirror writes its
base and every step it applies, with the try of the commit it applies (gap 2), to a log of its
own, and promoted it names that log in its generation's "replica" load, so that ``cpr verify``
walks its rows from its base to the count the load claims. Without Ray: the feed is called by
hand, as in test_shard_mirror."""

import json
import os
import time

import numpy as np
import pytest

from core.plan import make_plan
from actors.shard import EmbeddingShard
from actors.shard_chunks import merge_chunks
from verify.files import load_run
from verify.timeline import walk_shard

pytestmark = pytest.mark.timeout(120)

DIM, M = 4, 2
PLAN = make_plan("table_wise", [60] * 26, 2)


@pytest.fixture(autouse=True)
def _no_ray(monkeypatch):
    monkeypatch.setattr("ray.get_runtime_context", lambda: type("C", (), {"get_node_id": lambda self: "n"})())


def _step(shard, step, mirror=None):
    """One step of two one-microbatch chunks; the mirror gets it (try (0, step)) as the feed would."""
    rng = np.random.default_rng(step)
    for mb in (0, 1):
        sb = PLAN.route(rng.integers(0, 60, size=(8, 26)), 0)
        shard.lookup(step, (step * M + mb,), sb.lengths, sb.indices)
    for mb in (1, 0):
        shard.push_grads(step, (step * M + mb,), rng.standard_normal((8, len(PLAN.shards[0]) * DIM)).astype(np.float32))
    if mirror is not None:
        mirror.replicate(step, *merge_chunks(shard._pending.ordered(step)), (0, step))


def _records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_mirror_logs_its_base_and_applies_from_its_start_and_its_promotion_names_that_log(tmp_path):
    audit = tmp_path / "audit"
    (tmp_path / "config.yaml").write_text("run_dir: run\n")
    args = dict(dim=DIM, learning_rate=0.1, eps=1e-8, seed=3, microbatches_per_step=M, audit_dir=str(audit))
    primary = EmbeddingShard(0, list(PLAN.shards[0]), **args)
    _step(primary, 0)
    _step(primary, 1)  # step 0 applied, step 1 complete: the mirror starts here
    mirror = EmbeddingShard(None, None, spare="cpr-shard-r-mirror0", **args)
    mirror.become_mirror(0, list(PLAN.shards[0]))
    weights, states = primary.tbe.split_embedding_weights(), primary.tbe.split_optimizer_states()
    mirror.sync_base(0, primary.applied_step, [w.numpy() for w in weights], [s[0].numpy() for s in states], 0)
    mirror.replicate(1, *merge_chunks(primary._pending.ordered(1)), (0, 1))
    for step in range(2, 6):
        _step(primary, step, mirror)
    deadline = time.monotonic() + 5
    while mirror.applied_step < 4 and time.monotonic() < deadline:
        time.sleep(0.01)  # the mirror applies committed steps on its own thread
    assert mirror.applied_step == 4
    mirror.adopt(0, list(PLAN.shards[0]), 1, committed=5)  # the primary died after step 5 completed
    _step(mirror, 6)
    mirror.applied_log()  # the run's end commits step 6

    name = f"mirror-0-mirror0-{os.getpid()}.jsonl"
    assert sorted(p.name for p in audit.iterdir()) == [name, "shard-0-g0.jsonl", "shard-0-g1.jsonl"]
    log = _records(audit / name)
    assert [r["event"] for r in log] == ["open", "base", "apply", "apply", "apply", "apply", "promoted"]
    assert all(r["mirror_of"] == 0 and "gen" not in r for r in log)
    assert log[0]["spare"] == "cpr-shard-r-mirror0" and log[0]["pid"] == os.getpid()
    assert (log[1]["step"], log[1]["primary_gen"]) == (1, 0)
    assert [(r["step"], r["try"], r["microbatches"]) for r in log[2:6]] == [
        (s, [0, s], [s * M, s * M + 1]) for s in range(1, 5)]
    assert (log[-1]["generation"], log[-1]["step"]) == (1, 5)
    [load] = [r for r in _records(audit / "shard-0-g1.jsonl") if r["event"] == "load"]
    assert (load["why"], load["step"], load["mirror_log"]) == ("replica", 5, name)

    run = load_run(tmp_path)
    assert [f.kind for f in run.shards[0]] == ["shard", "shard", "mirror"]
    assert walk_shard(0, run.shards[0], M, 7) == ([], [])
    mirror_file = run.shards[0][2]
    del mirror_file.records[3]  # the mirror's apply of step 2 missing from its log
    v, _ = walk_shard(0, run.shards[0], M, 7)
    assert len(v) == 1 and "the mirror of shard 0" in v[0] and "skipped steps 2..2" in v[0], v
