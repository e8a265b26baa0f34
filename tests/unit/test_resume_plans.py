"""What ``cpr train --resume RUN_DIR --set ...`` accepts: a new sharding plan (the number of
shards, the sharding), checked like any --set value, and nothing else; a run whose checkpoints
do not record their plan (an older version wrote them) keeps its own. From a plain shell,
each refusal is one line and writes nothing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from app.resume import resume_config
from core.checkpoint import FULL, CheckpointStore, ShardRows, write_shard_file
from core.config import config_from_dict
from core.errors import ConfigError
from core.plan import make_plan, plan_to_json

pytestmark = pytest.mark.timeout(120)


def _run_dir(tmp_path: Path, record_plan: bool) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    cfg = config_from_dict({"run_dir": str(run), "data": {"train": ["t.tsv"], "eval": ["e.tsv"]},
                            "model": {"embedding_dim": 4, "table_rows": 10, "dense_arch": [8, 4], "over_arch": [8, 1]}, "checkpoint": {"every_steps": 5}})
    (run / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump(), sort_keys=False))
    plan = make_plan("table_wise", [10] * 26, 2)
    entries = []
    for k in range(2):
        slices = plan.shards[k]
        tables = np.concatenate([np.full(10, s.table, np.int32) for s in slices])
        rows = np.concatenate([np.arange(10, dtype=np.int64) for _ in slices])
        data = ShardRows(tables, rows, np.zeros((len(rows), 4), np.float32), np.zeros(len(rows), np.float32))
        entries.append(write_shard_file(cfg.checkpoint_uri, 5, k, data))
    CheckpointStore(cfg.checkpoint_uri).commit(5, entries, kind=FULL, meta={"plan": plan_to_json(plan)} if record_plan else {})
    return run


def test_a_resume_takes_a_new_plan_and_nothing_else(tmp_path):
    run = _run_dir(tmp_path, record_plan=True)
    cfg = resume_config(str(run), plan={"embeddings.num_shards": 3, "embeddings.sharding": "row_wise"})
    assert (cfg.embeddings.num_shards, cfg.embeddings.sharding) == (3, "row_wise")
    assert resume_config(str(run)).embeddings.num_shards == 2  # the run's own, without --set
    with pytest.raises(ConfigError, match="--set training.epochs is not allowed"):
        resume_config(str(run), plan={"training.epochs": 2})
    with pytest.raises(ConfigError, match="embeddings.num_shards"):
        resume_config(str(run), plan={"embeddings.num_shards": 0})


def test_checkpoints_that_record_no_plan_keep_the_runs_own(tmp_path):
    run = _run_dir(tmp_path, record_plan=False)
    with pytest.raises(ConfigError, match="checkpoint step 5 does not record its sharding plan"):
        resume_config(str(run), plan={"embeddings.num_shards": 3})
    assert resume_config(str(run)).embeddings.num_shards == 2


@pytest.mark.parametrize("value,said", [
    ("training.epochs=2", "--set training.epochs is not allowed (only embeddings.num_shards and embeddings.sharding"),
    ("embeddings.num_shards=x", "embeddings.num_shards"),
])
def test_a_refused_resume_says_so_in_one_line_and_writes_nothing(tmp_path, value, said):
    run = _run_dir(tmp_path, record_plan=True)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    done = subprocess.run([sys.executable, "-m", "app", "train", "--resume", str(run), "--set", value],
                          capture_output=True, text=True, timeout=60, cwd=tmp_path)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2 and len(lines) == 1 and said in lines[0], done.stderr
    assert "Traceback" not in done.stderr + done.stdout
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


def test_a_resume_on_fewer_shards_then_more_never_reuses_a_generation():
    """3 shards, then 2, then 4: shard 2 comes back after the generations it had, so no audit log
    or actor name holds two actors' records (found in review)."""
    import threading

    from actors.supervisor.serving import ServingFleet

    def name(k, g):
        return f"shard-{k}-g{g}"

    three = ServingFleet(3, name, threading.RLock())
    three.reserve({0: 4, 1: 2, 2: 6})
    two = ServingFleet(2, name, threading.RLock())
    two.continue_from(three.doc(), name)
    assert two.gens == [5, 3]
    four = ServingFleet(4, name, threading.RLock())
    four.continue_from(two.doc(), name)
    assert four.gens == [5, 3, 7, 0] and four.names[2] == "shard-2-g7"


def test_a_failure_of_an_earlier_plan_is_counted_over_the_rows_its_shard_held():
    """A partial recovery of shard 2 of three, counted after a resume on two shards: over the
    rows shard 2 held then, not the plan now's (which has no shard 2, or other rows for it)."""
    from core.accounting import plan_held

    three, two = make_plan("row_wise", [30] * 26, 3), make_plan("row_wise", [30] * 26, 2)
    held = tuple((s.table, s.row_start, s.row_end) for s in three.shards[2])
    assert plan_held(two, 2, held).shards[2] == three.shards[2]
    assert plan_held(two, 1, tuple((s.table, s.row_start, s.row_end) for s in three.shards[1])).shards[1] == \
        three.shards[1]
    assert plan_held(two, 1, None) is two and plan_held(three, 2, held) is three


def test_a_plan_whose_largest_shard_does_not_fit_a_node_says_so_before_anything_is_placed():
    from core.memory import memory_estimate, memory_shortfall

    cfg = config_from_dict({"run_dir": "r", "data": {"train": ["t"], "eval": ["e"]},
                            "model": {"embedding_dim": 16, "table_rows": 100_000},
                            "embeddings": {"num_shards": 4, "sharding": "row_wise"}})
    gib = float(1 << 30)
    one = cfg.model_copy(update={"embeddings": cfg.embeddings.model_copy(update={"num_shards": 1})})
    assert memory_shortfall(memory_estimate(cfg), [0.3 * gib] * 4) is None  # 4 shards of 0.11 GiB at a save
    said = memory_shortfall(memory_estimate(one), [0.3 * gib] * 4)  # the same model on 1 shard: 0.45 GiB
    assert said is not None and said.startswith("the cluster's memory is too small for this config: shard 0 holds ")
    assert "Raise embeddings.num_shards" in said
    assert memory_shortfall(memory_estimate(cfg), [0.3 * gib]) is not None  # all of it on one node
