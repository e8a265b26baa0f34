"""``cpr verify --replay``: a run with a shard killed (partial recovery) and a trainer killed is
recomputed in one process and matches every checkpoint it left, bit for bit; then defects are
planted one at a time in copies of it, the logs left as a correct run writes them, and the
replay alone finds each at the first checkpoint after it, naming the shard and the rows."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.replay_plant import Mutation, change_one_float, copy_run, plant
from tests.integration.small_runs import small_run_config, train_to_report
from verify.files import load_run
from verify.replay.engine import replay_dir
from verify.replay.history import read_history

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

EVERY = 10  # a checkpoint every 10 steps: each defect is found within 10 steps


@pytest.fixture(scope="module")
def sound_run(ray_local, small_data, tmp_path_factory):
    """60 steps, two row-wise shards with partial recovery, two trainers; shard 1 killed at
    step 25 (it comes back from its checkpoint at 20, everything else keeps its state),
    trainer 1 at step 38 (trainer 0 takes every microbatch while it comes back)."""
    cfg = small_run_config(
        tmp_path_factory.mktemp("replay"), small_data, seed=5, steps=60, microbatches=4, call_timeout_s=30,
        collective_timeout_s=30, checkpoint={"every_steps": EVERY, "keep_last": 100},
        faults={"at_steps": {"shard:1": [25], "trainer:1": [38]}})
    report = train_to_report(cfg)
    assert report["steps"] == 60 and [f["recovery"] for f in report["failures"]].count("partial") == 1, report
    return Path(cfg.run_dir)


def test_the_replay_matches_every_checkpoint_bit_for_bit(sound_run):
    done = subprocess.run([sys.executable, "-m", "app", "verify", "--replay", str(sound_run)], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("replay:"))
    assert "checkpoints match bit for bit" in line, done.stdout
    result = replay_dir(sound_run)
    assert result.sound and result.exact and not result.gaps, (result.findings, result.gaps)
    assert result.checkpoints == list(range(EVERY, 61, EVERY)), result.checkpoints
    assert result.steps >= 60
    # The loads it walked, by kind (what the soak's table and failure_free_equal read): shard 1's
    # partial recovery; trainer 1 healed from its peer, so no dense load.
    history = read_history(load_run(sound_run), 4)
    assert result.loads == {"shard recovery": 1} == {f"shard {s.why}": 1 for s in history.shard_loads}, result.loads
    assert not history.dense_loads


@pytest.mark.parametrize("kind,step", [("drop", 33), ("double", 33), ("other_rows", 44), ("initial_rows", None)])
def test_a_planted_defect_is_found_where_it_happened(sound_run, tmp_path, kind, step):
    """Found at its step, naming the shard (its apply line's digest of the rows it left), and
    at every checkpoint from there on; the checkpoints before it still match."""
    run = copy_run(sound_run, tmp_path / "run")
    if step is None:  # the recovery of shard 1: its rows reset to their initial values, not its chain
        loads = [s for s in read_history(load_run(run), 4).shard_loads if s.why == "recovery"]
        step = loads[0].first_step
    rewritten = plant(run, Mutation(kind, 1, step))
    result = replay_dir(run)
    assert not result.sound, kind
    first = result.findings[0]
    if kind == "initial_rows":  # everything looked up in that step parts: named with the load before it
        assert first.startswith(f"step {step}: ") and "shard 1 generation 1 loaded [20]" in first, first
    else:
        assert first.startswith(f"step {step}: shard 1's rows after the apply "), first
    assert any(f.startswith(f"checkpoint {min(rewritten)} shard 1 ") for f in result.findings), result.findings
    assert result.checkpoints == [c for c in range(EVERY, 61, EVERY) if c < min(rewritten)]


@pytest.fixture(scope="module")
def replica_run(ray_local, small_data, tmp_path_factory):
    """The same run with mirrors: shard 1 killed at step 35 (its mirror takes its place),
    trainer 0 at step 45."""
    cfg = small_run_config(
        tmp_path_factory.mktemp("replay_replica"), small_data, seed=5, steps=60, microbatches=4, call_timeout_s=30,
        collective_timeout_s=30, checkpoint={"every_steps": EVERY, "keep_last": 100}, recovery="replica",
        faults={"at_steps": {"shard:1": [35], "trainer:0": [45]}})
    report = train_to_report(cfg)
    assert [f["recovery"] for f in report["failures"]] == ["replica"], report["failures"]
    return Path(cfg.run_dir)


def test_a_mirror_that_skipped_a_step_before_its_promotion_is_found_at_that_step(replica_run, tmp_path):
    """The replica run replays bit for bit with no load at all (a promotion changes nothing):
    it is the failure-free run's model. A mirror that skipped step 20, 16 steps before it took
    its shard's place, is found at step 20, in its own log."""
    result = replay_dir(replica_run)
    assert result.sound and result.exact and not result.gaps, (result.findings, result.gaps)
    assert not read_history(load_run(replica_run), 4).shard_loads, "no shard's rows were loaded"
    run = copy_run(replica_run, tmp_path / "run")
    rewritten = plant(run, Mutation("mirror_skip", 1, 20))
    result = replay_dir(run)
    assert result.findings[0].startswith("step 20: shard 1's rows after the apply (mirror-1-"), result.findings[:2]
    assert any(f.startswith(f"checkpoint {min(rewritten)} shard 1 ") for f in result.findings), result.findings


def test_a_changed_float_with_its_manifest_rehashed_is_found(sound_run, tmp_path):
    run = copy_run(sound_run, tmp_path / "run")
    table, row = change_one_float(run, 40, 0)
    result = replay_dir(run)
    assert result.findings and result.findings[0].startswith(f"checkpoint 40 shard 0 table {table}: 1 of "), \
        result.findings
    assert f"first row {row} " in result.findings[0]
