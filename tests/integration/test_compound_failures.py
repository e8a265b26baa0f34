"""Compound failures on a real local Ray, each injected at a named point (``faults.at_points``,
like torchft's ``EventInjector.fail_at``) or at a training step (``faults.at_steps``). Each
test asserts what survived, what was reloaded, what was counted as lost, and that the run
finished; ``cpr verify`` must find the run sound from the files other processes wrote (every
microbatch applied exactly once, a rolled-back or redone step exactly once more; the kills in
the fault log equal the report's; the lost samples recount; nothing left behind)."""

from __future__ import annotations

import pytest

from core.checkpoint import CheckpointStore
from core.config import config_from_dict
from app.job import TrainingJob
from tests.integration.checks import verified

pytestmark = [pytest.mark.integration, pytest.mark.timeout(400)]

M, B, STEPS, EVERY = 4, 128, 80, 20
# at_steps kills land once the step committed, a Ray task later: at or after it, so a
# kill "at step 45" restores from the checkpoint of step 40 or a later one.


def _config(tmp_path, data, recovery="partial", at_steps=None, at_points=None, **checkpoint):
    return config_from_dict({
        "run_dir": str(tmp_path / "run"),
        "seed": 7,
        "data": {"train": [data.train_path], "eval": [data.eval_path], "cache_dir": str(tmp_path.parent / "cache")},
        "model": {"embedding_dim": 8, "table_rows": 20_000, "dense_arch": [32, 8], "over_arch": [32, 1]},
        "embeddings": {"num_shards": 2, "call_timeout_s": 30},
        "training": {"num_trainers": 2, "microbatch_rows": B, "microbatches_per_step": M, "max_steps": STEPS,
                     "progress_every_steps": 5, "collective_timeout_s": 30},
        "checkpoint": {"every_steps": EVERY, "keep_last": 100, **checkpoint},
        "recovery": recovery,
        "audit_log": True,
        "faults": {"max_failures": 0, "at_steps": at_steps or {}, "at_points": at_points or []},
    })


def _train(cfg):
    job = TrainingJob(cfg, show_progress=False)
    try:
        job.start(wait=False)
        training = job.fit_in_background()  # Ray Train starts while the shards do
        job.await_start()
        before = {k: v.pid for k, v in _targets(job).items()}
        training.join(timeout_s=350)
        report = job.finish()
        after = {k: v.pid for k, v in _targets(job).items()}
    finally:
        job.close()
    return report, before, after, verified(cfg.run_dir).violations


def _targets(job):
    import ray

    return ray.get(job.supervisor.targets.remote(), timeout=60)


def _brief(report) -> dict:
    """What an assertion message shows: the failures and kills, without the event log."""
    keys = ("actor", "recovery", "restored_step", "chain", "lost_samples", "lost_steps_recomputed", "generation_after")
    return {
        "steps": report["steps"], "auc": report.get("auc"), "state": report.get("state"),
        "failures": [{k: f.get(k) for k in keys} for f in report["failures"]],
        "kills": [(k["target"], k["trigger"]) for k in report["faults_injected"]],
    }


def _kinds(report, kind):
    return [e for e in report["events"] if e["kind"] == kind]


def test_two_shards_at_once_under_full_recovery(ray_local, small_data, tmp_path):
    cfg = _config(tmp_path, small_data, recovery="full", at_steps={"shard:0": [45], "shard:1": [45]})
    report, before, after, violations = _train(cfg)
    brief = _brief(report)
    assert violations == [], brief
    assert report["steps"] == STEPS and report["auc"] > 0.65, brief
    assert sorted(f["actor"] for f in report["failures"]) == ["shard:0", "shard:1"], brief
    # One rollback respawned both (or a second one followed at once): nothing lost, steps redone.
    assert all(f["recovery"] == "full" and f["lost_samples"] == 0 for f in report["failures"]), brief
    # Both from the newest checkpoint at the kill (a second rollback, if the second death
    # came after the first finished, may find a newer one).
    assert all(f["restored_step"] >= 40 for f in report["failures"]), brief
    assert sum(f["lost_steps_recomputed"] for f in report["failures"]) >= 1, brief
    assert all(after[f"shard:{k}"] != before[f"shard:{k}"] for k in (0, 1))
    assert len(report["faults_injected"]) == 2, brief


def test_shards_killed_while_the_first_and_the_final_save_are_written(ray_local, small_data, tmp_path):
    # Shard 1 dies once it wrote its file of the first save (step 20). At the end, trainer 0
    # dies once the last step committed and shard 0 while the final save's files are written:
    # before, either left no final checkpoint, the report still said completed, and
    # `cpr export` silently took an older one.
    cfg = _config(tmp_path, small_data, at_steps={"trainer:0": [STEPS - 1]},
                  at_points=[{"at": "save.files_written", "kill": "shard:1"},
                             {"at": "save.files_written", "kill": "shard:0", "after_step": STEPS}])
    report, before, after, violations = _train(cfg)
    brief = _brief(report)
    assert violations == [], brief
    assert sorted((k["target"], k["trigger"]) for k in report["faults_injected"]) == [
        ("shard:0", "at save.files_written"), ("shard:1", "at save.files_written"),
        ("trainer:0", f"at step {STEPS - 1}")], brief
    first, last = sorted(report["failures"], key=lambda f: f["failed_at_step"])
    # Whether the first save committed before the recovery read the store or not, shard 1
    # came back alone from a checkpoint that verifies (step 20), or from the initial rows.
    assert first["actor"] == "shard:1" and first["recovery"] == "partial", brief
    assert first["restored_step"] in (0, EVERY) and first["chain"] in ([], [EVERY]), brief
    # From the initial rows, its first 20 steps are lost. Restored from the save it died in,
    # it loses only what it applied after that save's snapshot (training goes on while the
    # files are written), which may be nothing; cpr verify recounted it from the audit.
    assert first["restored_step"] == EVERY or first["lost_samples"] > 0
    assert last["actor"] == "shard:0" and last["failed_at_step"] == STEPS, brief
    # Shard 0 kept its process through shard 1's recovery: the one killed at the end is the first.
    [end_kill] = [k for k in report["faults_injected"] if k["target"] == "shard:0"]
    assert end_kill["pid"] == before["shard:0"], brief
    assert after["shard:0"] != before["shard:0"] and after["shard:1"] != before["shard:1"]
    # A completed run has the final full checkpoint of its last step, after the periodic ones.
    assert report["state"]["state"] == "finished" and report["steps"] == STEPS and report["auc"] > 0.6
    assert report["final_checkpoint_step"] == STEPS
    store = CheckpointStore(cfg.checkpoint_uri)
    assert [s for s in store.list_committed() if s > EVERY] == list(range(2 * EVERY, STEPS, EVERY)) + [STEPS]
    assert store.info(STEPS).kind == "full"


@pytest.mark.parametrize("victim", ["shard:1", "supervisor"])
def test_a_save_in_flight_when_its_writer_dies_never_becomes_a_checkpoint(ray_local, small_data, tmp_path, victim):
    # Killed once every shard copied its rows of the first save (step 20) and their files
    # are being written in the background: before the coordinator heard they are durable.
    cfg = _config(tmp_path, small_data, at_points=[{"at": "save.snapshotted", "kill": victim}])
    report, before, after, violations = _train(cfg)
    brief = _brief(report)
    assert violations == [], brief
    assert report["steps"] == STEPS, brief
    store = CheckpointStore(cfg.checkpoint_uri)
    committed = store.list_committed()
    # Abandoned: no manifest, so step 20 never looks like a checkpoint; later saves commit.
    assert EVERY not in committed and STEPS in committed, committed
    manifest = tmp_path / "run" / "checkpoints" / f"ckpt-{EVERY:012d}" / "manifest.json"
    assert not manifest.exists()
    if victim == "shard:1":
        failed = [e for e in report["events"] if e["kind"] == "checkpoint_failed" and e["step"] == EVERY]
        assert failed and failed[0]["phase"] == "write", brief
        # Nothing committed before the kill: shard 1 came back alone with its initial rows
        # and the steps it had applied are lost (counted, not silently kept).
        [failure] = report["failures"]
        assert failure["actor"] == "shard:1" and failure["recovery"] == "partial", brief
        assert failure["chain"] == [] and failure["restored_step"] == 0 and failure["lost_samples"] > 0, brief
        assert after["shard:0"] == before["shard:0"] and after["shard:1"] != before["shard:1"]
        # The next save came at once (not a whole interval later) and committed.
        assert min(s for s in committed if s > EVERY) < 2 * EVERY, committed
    else:
        # The restarted supervisor never commits it (its journal says a save was in flight:
        # the next one is due at once, whenever the trainers, which kept training, ask);
        # the shards kept their state.
        assert report["supervisor_restarts"] == 1 and report["failures"] == [], brief
        assert after["shard:0"] == before["shard:0"] and after["shard:1"] == before["shard:1"]


def test_shard_killed_during_another_shards_recovery(ray_local, small_data, tmp_path):
    cfg = _config(tmp_path, small_data, at_steps={"shard:1": [45]},
                  at_points=[{"at": "recovery.spawned", "kill": "shard:0"}])
    report, before, after, violations = _train(cfg)
    assert violations == []
    assert report["steps"] == STEPS
    assert sorted(f["actor"] for f in report["failures"]) == ["shard:0", "shard:1"]
    assert all(f["recovery"] == "partial" for f in report["failures"])
    assert len({f["restored_step"] for f in report["failures"]}) == 1 and report["failures"][0]["restored_step"] >= 40
    assert all(after[f"shard:{k}"] != before[f"shard:{k}"] for k in (0, 1))
    # Both came back in one recovery (shard 1's new actor adopted, not spawned twice).
    assert {f["generation_after"] for f in report["failures"]} == {1}
    assert sum(f["lost_samples"] for f in report["failures"]) > 0


def test_trainer_killed_during_a_shard_recovery(ray_local, small_data, tmp_path):
    cfg = _config(tmp_path, small_data, at_steps={"shard:0": [45]},
                  at_points=[{"at": "recovery.spawned", "kill": "trainer:1"}])
    report, before, after, violations = _train(cfg)
    assert violations == []
    assert report["steps"] == STEPS
    [failure] = report["failures"]
    assert failure["actor"] == "shard:0" and failure["restored_step"] >= 40
    assert [t["actor"] for t in report["trainer_failures"]] == ["trainer:1"]
    [killed] = [k for k in report["faults_injected"] if k["target"] == "trainer:1"]
    assert killed["trigger"] == "at recovery.spawned"
    assert after["shard:1"] == before["shard:1"]
    # The replacement takes ~15 s to start; if it joined before the end, it is a new process.
    [trainer] = report["trainer_failures"]
    if trainer["replacement_joined_at_step"] is not None:
        assert after["trainer:1"] != killed["pid"]
    assert report["microbatches_per_committed_step"] == [M]


def test_supervisor_killed_during_a_shard_recovery(ray_local, small_data, tmp_path):
    # Defect 2: the restarted supervisor finds the half-done recovery in its journal, adopts
    # the new shard under its reserved name (or kills it and takes the next), never reuses one.
    cfg = _config(tmp_path, small_data, at_steps={"shard:1": [45]},
                  at_points=[{"at": "recovery.spawned", "kill": "supervisor"}])
    report, before, after, violations = _train(cfg)
    assert violations == []
    assert report["steps"] == STEPS and report["supervisor_restarts"] == 1
    [failure] = report["failures"]
    assert failure["actor"] == "shard:1" and failure["restored_step"] >= 40
    restarted = _kinds(report, "supervisor_restarted")
    assert len(restarted) == 1 and restarted[0]["state"] == "recovering_shards"
    assert not [e for e in report["events"] if e["kind"] == "recovery_error"]
    assert after["supervisor"] != before["supervisor"] and after["shard:0"] == before["shard:0"]


def test_supervisor_killed_during_a_save_keeps_its_history(ray_local, small_data, tmp_path):
    # Defect 1: with auto_interval, a restarted supervisor used to overwrite its state file
    # before reading it, forgetting failures, kills and generations.
    cfg = _config(tmp_path, small_data, at_steps={"shard:1": [25]},
                  at_points=[{"at": "save.files_written", "kill": "supervisor"}],
                  auto_interval=True, mtbf_s=60)
    report, before, after, violations = _train(cfg)
    assert violations == []
    assert report["steps"] == STEPS and report["supervisor_restarts"] == 1
    # What happened before the restart is still in the report.
    assert _kinds(report, "shards_ready") and _kinds(report, "training_started")
    # Each fault fired exactly once, across the restart and both trainers' commit reports.
    assert sorted(e["target"] for e in report["faults_injected"]) == ["shard:1", "supervisor"]
    assert [f["actor"] for f in report["failures"]] == ["shard:1"]
    store = CheckpointStore(cfg.checkpoint_uri)
    assert len(store.list_committed()) >= 2  # saving went on after the restart


def test_supervisor_killed_during_a_rollback(ray_local, small_data, tmp_path):
    cfg = _config(tmp_path, small_data, recovery="full", at_steps={"shard:0": [45]},
                  at_points=[{"at": "rollback.loaded", "kill": "supervisor"}])
    report, before, after, violations = _train(cfg)
    assert violations == []
    assert report["steps"] == STEPS and report["supervisor_restarts"] == 1
    [failure] = report["failures"]
    assert failure["recovery"] == "full" and failure["restored_step"] >= 40 and failure["lost_samples"] == 0
    # The abandoned timeline was fenced once the restarted supervisor finished the rollback.
    assert _kinds(report, "supervisor_restarted")[0]["state"] == "rolling_back"
    assert after["shard:1"] == before["shard:1"] and after["shard:0"] != before["shard:0"]
