"""Faults other than SIGKILLs, in two runs on a real local Ray. The first: a shard that stops
answering (SIGSTOP, resumed by SIGCONT after a while), a trainer that does, storage whose every
write is slow, a damaged file in the newest checkpoint met by a recovery, and the supervisor
killed in the middle of a save's commit. The second: checkpoint storage that fills up (a 256 MB
tmpfs of the test's own) while every trainer dies, a rollback that must not use a damaged file,
and the supervisor killed in the middle of that rollback. The windows of the storage faults are
in seconds and the rest in steps: two runs keep them apart whatever the machine's speed (in one
run, the fill and the slow storage met on a fast machine). Each test states what must survive;
every one of them also needs ``cpr verify`` to find the run sound (exactly-once applies and
commits, kills and report equal, lost samples recounted, nothing left behind)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import time

import pytest

from tests.integration.checks import verified
from verify.files import load_run

from .small_runs import small_run_config, train_to_report

pytestmark = [pytest.mark.integration, pytest.mark.timeout(500)]

M, EVERY, CALL_TIMEOUT, SLOW_S, FILL_S = 4, 10, 4.0, 1.0, 10.0

STALLS_STEPS = 150
STALLS = {
    "inject": [
        # Three call timeouts: the trainers' calls time out, and the shard must be declared dead.
        {"kind": "stall", "target": "shard:1", "after_step": 15, "seconds": 3 * CALL_TIMEOUT},
        {"kind": "stall", "target": "trainer:1", "after_step": 45, "seconds": 8.0},
        # Shard 0 dies at step 85; its recovery finds its file of the newest checkpoint damaged
        # right before it loads, and must refuse it.
        {"kind": "corrupt_checkpoint", "target": "shard:0", "at": "recovery.spawned", "after_step": 80},
        # Every file written to the checkpoint storage takes 1 s longer for 8 s.
        {"kind": "slow_storage", "after_step": 100, "seconds": 8.0, "delay_s": SLOW_S},
    ],
    "at_steps": {"shard:0": [85]},
    "at_points": [{"at": "save.files_written", "kill": "supervisor", "after_step": 30}],
}

ROLLBACK_STEPS = 70
ROLLBACK = {
    "inject": [
        # The checkpoint storage fills up in the first save after step 25, right after its
        # snapshot (that save fails), and stays full until well after every trainer died (at
        # step 35): the saves due meanwhile fail, none may commit torn, and the shards are ahead
        # of every checkpoint when the trainers die, whatever the machine's speed (a save that
        # committed at the step they died at would leave nothing to roll back).
        {"kind": "fill_storage", "at": "save.snapshotted", "after_step": 25, "seconds": FILL_S},
        # The rollback finds shard 1's file of the checkpoint it goes to cut in half, and must go
        # further back, the dense model with it.
        {"kind": "truncate_checkpoint", "target": "shard:1", "at": "rollback.spawned", "after_step": 30},
    ],
    # Every trainer dies at step 35 (all recorded, then signalled at once).
    "at_steps": {"all_trainers": [35]},
    "at_points": [{"at": "rollback.loaded", "kill": "supervisor"}],
}


@contextlib.contextmanager
def _tmpfs(path):
    """A 256 MB tmpfs for a run's checkpoints (root, as CI runs: the mount must work)."""
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256m", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)


def _faulted_run(small_data, tmp_path_factory, name: str, steps: int, faults: dict):
    tmp_path = tmp_path_factory.mktemp(name)
    with _tmpfs(tmp_path_factory.mktemp(f"{name}_disk")) as disk:
        cfg = small_run_config(
            tmp_path, small_data, seed=11, steps=steps, microbatches=M, call_timeout_s=CALL_TIMEOUT,
            collective_timeout_s=5,
            # Four checkpoints of 25 MB fit in the 256 MB: the storage is full only while filled.
            checkpoint={"every_steps": EVERY, "keep_last": 4, "storage": str(disk / "checkpoints")},
            faults={"seed": 1, **faults},
        )
        report = train_to_report(cfg)
        yield cfg, report, verified(cfg.run_dir)


@pytest.fixture(scope="module")
def faulted(ray_local, small_data, tmp_path_factory):
    yield from _faulted_run(small_data, tmp_path_factory, "faults", STALLS_STEPS, STALLS)


@pytest.fixture(scope="module")
def rolled_back(ray_local, small_data, tmp_path_factory):
    yield from _faulted_run(small_data, tmp_path_factory, "rollback", ROLLBACK_STEPS, ROLLBACK)


def _sent(cfg, fault: str) -> list[dict]:
    return [r for r in load_run(cfg.run_dir).faults if r["event"] == "sent" and r["fault"] == fault]


def test_the_runs_survive_every_fault_kind_and_verify(faulted, rolled_back):
    for (cfg, report, verdict), steps in ((faulted, STALLS_STEPS), (rolled_back, ROLLBACK_STEPS)):
        assert report["state"]["state"] == "finished" and report["steps"] == steps, report["state"]
        assert verdict.violations == [], verdict.violations
    assert faulted[2].facts["stalls"] == 2 and faulted[2].facts["damaged_checkpoints"] == 1, faulted[2].facts
    assert rolled_back[2].facts["damaged_checkpoints"] == 1, rolled_back[2].facts


def test_a_stalled_shard_is_declared_dead_and_replaced(faulted):
    cfg, report, _ = faulted
    [stall] = [r for r in _sent(cfg, "stall") if r["target"] == "shard:1"]
    [failure] = [f for f in report["failures"] if f["shard"] == 1 and f["detected_at"] > stall["t"]][:1]
    # Declared dead within the trainers' call timeout plus the supervisor's reaction, before the
    # stall would have ended by itself. Its process was killed (Ray may force the kill only
    # after the SIGCONT); it never applied a step after its replacement took over and is not
    # left running (both in the verdict).
    assert failure["detected_at"] - stall["t"] < 3 * CALL_TIMEOUT, failure
    assert failure["recovery"] == "partial" and failure["actor"] == "shard:1", failure
    with pytest.raises(ProcessLookupError):
        os.kill(stall["pid"], 0)


def test_a_stalled_trainer_does_not_stop_the_others(faulted):
    cfg, report, verdict = faulted
    [stall] = [r for r in _sent(cfg, "stall") if r["target"] == "trainer:1"]
    # Trainer 0 committed steps alone while trainer 1 was stopped (read from the trainers' own
    # audit), each with all M microbatches (the verdict checks every commit's shares).
    groups: dict[tuple[int, int], set[int]] = {}
    for f in load_run(cfg.run_dir).trainers:
        for r in f.records:
            if r.get("event") == "commit" and stall["t"] < r["t"] < stall["t"] + stall["seconds"]:
                groups.setdefault((r["step"], r["quorum"]), set()).add(r["rank"])
    assert any(ranks == {0} for ranks in groups.values()), groups
    assert report["microbatches_per_committed_step"] == [M], report["microbatches_per_committed_step"]


def test_full_checkpoint_storage_fails_saves_and_commits_nothing_torn(rolled_back):
    cfg, report, verdict = rolled_back
    [fill] = _sent(cfg, "fill_storage")
    [freed] = [r for r in _sent(cfg, "free_storage") if r["file"] == fill["file"]]
    assert fill["bytes"] > 0, fill
    failed = [e for e in report["events"] if e["kind"] == "checkpoint_failed" and fill["t"] <= e["time"] <= freed["t"] + 1]
    saved_after = [e for e in report["events"] if e["kind"] == "checkpoint_saved" and e["time"] > freed["t"]]
    # Saves failed while it was full, later ones committed; every committed checkpoint verifies
    # (the verdict hashes each file against its manifest).
    assert failed and saved_after, [e for e in report["events"] if e["kind"].startswith("checkpoint")][-12:]
    assert verdict.facts["checkpoints_verified"] > 0
    # Each failed save was tried again after a backoff that doubles with the failures in a row
    # (not at every step), and the report counts them.
    counted = [e for e in report["events"] if e["kind"] == "checkpoint_failed" and "failed_in_a_row" in e]
    assert report["failed_saves"]["failed"] == len(counted) > 0, report["failed_saves"]
    assert all(e["step"] < e["retry_step"] <= e["step"] + 2 ** (e["failed_in_a_row"] - 1) for e in counted), counted


def test_slow_storage_slows_the_saves_in_the_background_not_training(faulted):
    cfg, report, verdict = faulted
    [slow] = _sent(cfg, "slow_storage")
    # Saves that began early enough in the window for their shard files to be written in it.
    during = [e for e in report["events"] if e["kind"] == "checkpoint_saved"
              and slow["t"] <= e["time"] - e["background_s"] <= slow["t"] + slow["seconds"] - 2 * SLOW_S]
    assert during, [e for e in report["events"] if e["kind"].startswith("checkpoint")][-8:]
    for e in during:
        # Each shard's file took the delay longer; training was held only for the snapshot.
        assert min(e["shard_write_s"]) >= SLOW_S and e["background_s"] >= SLOW_S, e
        assert e["hold_s"] < SLOW_S, e
    # The fault's own process removes its file when the window ends.
    deadline = time.monotonic() + slow["seconds"] + 10
    while os.path.exists(os.path.join(cfg.checkpoint_uri, ".cpr-slow-writes.json")) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not os.path.exists(os.path.join(cfg.checkpoint_uri, ".cpr-slow-writes.json"))


def _damaged(cfg, fault: str) -> int:
    [step] = [r["step"] for r in _sent(cfg, fault)]
    return step


def test_a_recovery_refuses_a_damaged_file_and_loads_the_previous_checkpoint(faulted):
    cfg, report, verdict = faulted
    damaged = _damaged(cfg, "corrupt_checkpoint")
    [kill] = [r for r in _sent(cfg, "kill") if r["target"] == "shard:0"]
    [recovery] = [f for f in report["failures"] if f["actor"] == "shard:0" and f["killed_at"] == kill["kill_time"]]
    assert recovery["recovery"] == "partial" and damaged not in recovery["chain"], (damaged, recovery)
    assert recovery["chain"] and recovery["restored_step"] < damaged, (damaged, recovery)
    assert not [v for v in verdict.violations if "damaged" in v]  # no shard ever loaded it (from the audit)


def test_a_rollback_refuses_a_damaged_file_and_goes_further_back_with_the_dense_model(rolled_back):
    cfg, report, verdict = rolled_back
    damaged = _damaged(cfg, "truncate_checkpoint")
    [fallback] = report["all_trainers_failed"]
    assert fallback["fallback_step"] < damaged, (damaged, fallback)
    # The dense model went back with the shards: every step after the fallback step was
    # committed again exactly once (the verdict walks the trainers' audit).
    assert verdict.violations == []


def test_the_supervisor_killed_in_a_rollback_and_in_a_save_commit_comes_back(faulted, rolled_back):
    for (cfg, report, _), trigger, targets in (
            (faulted, "at save.files_written", ["shard:0", "supervisor"]),
            (rolled_back, "at rollback.loaded", ["supervisor", "trainer:0", "trainer:1"])):
        assert [k["trigger"] for k in report["faults_injected"] if k["target"] == "supervisor"] == [trigger]
        assert report["supervisor_restarts"] == 1, report["supervisor_restarts"]
        # What happened before the restart is still in the report, and each fault fired once
        # across it (the verdict matched the report's kills to the injector's own log).
        kinds = {e["kind"] for e in report["events"]}
        assert {"shards_ready", "training_started", "supervisor_restarted"} <= kinds
        assert sorted(k["target"] for k in report["faults_injected"]) == targets
    assert len(rolled_back[1]["all_trainers_failed"]) == 1
