"""The soak's plan and what it keeps, without Ray: every replica soak seed schedules a promoted
shard killed again before its new mirror, a stall of every mirror and slow storage; each
scheduled fault is found in the injector's log with what followed; a run with a finding (or
unfinished) is kept whole, a sound one loses only its checkpoints; a mirror can be stalled."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from actors import faults as faults_module
from actors.faults import Killer
from app.soak import soak_result
from app.soak_check import keep_or_clean, must_keep, promoted_then_killed, scheduled_outcomes
from app.soak_plan import REPLICA_QUIET_S, scheduled_faults, soak_config
from core.config import load_config
from core.config_failures import FaultSpec
from core.records import Target

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[2]
SEEDS = range(40)


def _soak(tmp_path: Path, seed: int, recovery: str):
    base = load_config(ROOT / "configs" / "soak.yaml", {"recovery": recovery})
    return soak_config(base, str(tmp_path / "runs" / f"soak-{seed}"), seed, 20, 6.0)


@pytest.mark.parametrize("seed", SEEDS)
def test_every_replica_soak_kills_a_promoted_shard_before_its_new_mirror_and_stalls_mirrors_and_storage(
        tmp_path, seed):
    cfg = _soak(tmp_path, seed, "replica")
    f = cfg.faults
    [(target, steps)] = f.at_steps.items()
    first, second = steps
    # The first kill comes after the first checkpoint (saves every 20 steps), on a full fleet of
    # mirrors (random kills wait), and promotes shard K's mirror; the second comes a few steps
    # later, and no warm spare can become its new mirror in between.
    assert target.startswith("shard:") and 40 <= first and 3 <= second - first <= 6, f.at_steps
    assert cfg.embeddings.spares == 0 and f.start_after_s >= REPLICA_QUIET_S
    assert "mirrors" in f.targets and f.max_failures == 20
    stalled = sorted(s.target for s in f.inject if s.kind == "stall" and s.target.startswith("mirror:"))
    assert stalled == [f"mirror:{k}" for k in range(cfg.embeddings.num_shards)]
    assert [s.kind for s in f.inject].count("slow_storage") == 1
    # Nothing else scheduled by step lands in the scenario's window.
    others = [s.after_step for s in f.inject] + [p.after_step for p in f.at_points]
    assert min(others) > second, (others, steps)


def test_the_one_host_soak_has_no_scenario_and_draws_its_faults_as_before(tmp_path):
    cfg = _soak(tmp_path, 3, "partial")
    f = cfg.faults
    assert f.at_steps == {} and f.start_after_s == 0.0 and cfg.embeddings.spares == 1
    # The draws of the soak's own faults for seed 3, as the results before this change ran them.
    assert [(s.kind, s.target, s.after_step) for s in f.inject] == [
        ("stall", "shard:0", 624), ("stall", "trainer:0", 83), ("corrupt_checkpoint", "shard:1", 185),
        ("truncate_checkpoint", "shard:1", 115)]
    # The data cache is shared by the soak's runs, by an absolute path: a kept run verifies anywhere.
    assert Path(cfg.data.cache_dir).is_absolute() and cfg.data.cache_dir.endswith("runs/soak-cache")


def test_scheduled_faults_name_each_fault_as_the_injector_logs_it(tmp_path):
    cfg = _soak(tmp_path, 7, "replica")
    sched = scheduled_faults(cfg.faults)
    (target, (a, b)), = cfg.faults.at_steps.items()
    assert sched[:2] == [{"fault": "kill", "target": target, "trigger": f"at step {a}", "after_step": a},
                         {"fault": "kill", "target": target, "trigger": f"at step {b}", "after_step": b}]
    assert {"fault": "kill", "target": "supervisor", "trigger": "at rollback.loaded", "after_step": 200} in sched
    slow = next(e for e in sched if e["fault"] == "slow_storage")
    assert slow["target"] == "storage" and slow["trigger"] == f"at step {slow['after_step']}" and slow["delay_s"] > 0


# ------------------------------------------------------------------ what a run met, from its files


def _run_dir(tmp_path: Path, faults: list[dict], loads: dict[int, list[dict]], events: list[dict]) -> Path:
    run = tmp_path / "run"
    (run / "faults").mkdir(parents=True)
    (run / "audit").mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump({"run_dir": str(run), "training": {"microbatches_per_step": 4}}))
    (run / "faults" / "faults-h-1-1.jsonl").write_text("".join(json.dumps(r) + "\n" for r in faults))
    for k, records in loads.items():
        for gen, r in enumerate(records, start=1):
            (run / "audit" / f"shard-{k}-g{gen}.jsonl").write_text(json.dumps({"gen": gen, "event": "load", **r}) + "\n")
    (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    return run


def _kill(target: str, step: int, t: float) -> dict:
    return {"t": t, "event": "sent", "fault": "kill", "target": target, "pid": 10, "trigger": f"at step {step}",
            "kill_time": t}


SCHEDULE = [{"fault": "kill", "target": "shard:1", "trigger": "at step 43", "after_step": 43},
            {"fault": "kill", "target": "shard:1", "trigger": "at step 49", "after_step": 49},
            {"fault": "stall", "target": "mirror:0", "trigger": "at step 300", "after_step": 300, "seconds": 8.0},
            {"fault": "slow_storage", "target": "storage", "trigger": "at step 400", "after_step": 400,
             "seconds": 10.0, "delay_s": 2.0}]


def test_the_scenario_is_met_when_the_first_kill_promoted_and_the_second_restored(tmp_path):
    stall = {"t": 300.0, "event": "sent", "fault": "stall", "target": "mirror:0", "pid": 77, "trigger": "at step 300",
             "stall_time": 300.0, "seconds": 8.0}
    resume = {"t": 308.0, "event": "sent", "fault": "resume", "target": "mirror:0", "pid": 77, "trigger": "at step 300"}
    slow = {"t": 400.0, "event": "sent", "fault": "slow_storage", "target": "storage", "pid": None,
            "trigger": "at step 400"}
    run = _run_dir(tmp_path, [_kill("shard:1", 43, 100.0), _kill("shard:1", 49, 104.0), stall, resume, slow],
                   {1: [{"t": 101.0, "why": "replica", "chain": [], "step": 44}, {"t": 110.0, "why": "recovery",
                                                                                 "chain": [40]}]},
                   [{"time": 315.0, "kind": "mirror_lost", "shard": 0}, {"time": 404.0, "kind": "checkpoint_saved"}])
    out = scheduled_outcomes(run, SCHEDULE)
    assert [o["landed"] for o in out] == [True, True, True, True]
    assert out[0]["what_happened"] == "its mirror was promoted"
    assert out[1]["what_happened"] == "recovery from checkpoint chain [40]"
    assert out[2]["mirror_lost"] and out[2]["shard_replaced"] is None
    assert out[2]["what_happened"] == "resumed; the mirror was declared lost; the shard kept serving"
    assert out[3]["saves_committed"] == 1 and "no shard replaced" in out[3]["what_happened"]
    assert promoted_then_killed(out) == {"shard": "shard:1", "steps": [43, 49], "met": True,
                                         "first_recovery": "replica", "second_recovery": "recovery"}


def test_the_scenario_is_not_met_when_a_new_mirror_took_the_second_kill_or_a_fault_never_came(tmp_path):
    run = _run_dir(tmp_path, [_kill("shard:1", 43, 100.0), _kill("shard:1", 49, 104.0)],
                   {1: [{"t": 101.0, "why": "replica", "chain": [], "step": 44},
                        {"t": 105.0, "why": "replica", "chain": [], "step": 50}]}, [])
    out = scheduled_outcomes(run, SCHEDULE)
    assert promoted_then_killed(out)["met"] is False
    assert out[2]["landed"] is False and out[2]["what_happened"] == "not met (the run never got there)"


# ------------------------------------------------------------------ what is kept


def _finished_run(tmp_path: Path) -> Path:
    run = tmp_path / "runs" / "soak-replica-4"
    (run / "checkpoints" / "ckpt-00000020").mkdir(parents=True)
    (run / "checkpoints" / "ckpt-00000020" / "shard-0.arrow").write_bytes(b"rows")
    (run / "audit").mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump({"run_dir": str(run), "training": {"microbatches_per_step": 4}}))
    return run


def _verdict(violations: list[str]) -> SimpleNamespace:
    """What ``verify.verify_run`` returns, as far as the soak reads it."""
    return SimpleNamespace(violations=violations, facts={"kills_by_kind": {"shard": 2}, "other_faults": {"stall": 1},
                                                         "steps": 100, "lost_samples": 0.0})


def test_a_run_with_a_violation_is_kept_whole_for_verify_again(tmp_path):
    run = _finished_run(tmp_path)
    kept_root = tmp_path / "kept"
    result = soak_result(4, str(run), _verdict(["shard 1 holds 99 applied steps at the end, the run has 100"]),
                         {"auc": 0.66}, [], False, [], str(kept_root), False, str(run / "checkpoints"))
    kept = Path(result["kept"])
    assert kept.parent == kept_root and kept.name.startswith("soak-replica-4-")
    assert (kept / "checkpoints" / "ckpt-00000020" / "shard-0.arrow").read_bytes() == b"rows"
    assert not run.exists() and result["faults"] == 3 and len(result["violations"]) == 1


def test_a_sound_run_loses_only_its_checkpoints(tmp_path):
    run = _finished_run(tmp_path)
    result = soak_result(4, str(run), _verdict([]), {"auc": 0.66}, [], False, [], str(tmp_path / "kept"), False,
                         str(run / "checkpoints"))
    assert result["kept"] is None and not (tmp_path / "kept").exists()
    assert (run / "config.yaml").exists() and (run / "audit").is_dir() and not (run / "checkpoints").exists()


def test_an_unfinished_or_wedged_run_is_kept_and_extra_files_go_with_it(tmp_path):
    assert must_keep([], finished=False, wedged=False) and must_keep([], finished=True, wedged=True)
    assert not must_keep([], finished=True, wedged=False)
    run = _finished_run(tmp_path)
    log = tmp_path / "runs" / "soak-replica-4.log"
    log.write_text("driver output\n")
    kept = Path(keep_or_clean(run, tmp_path / "kept", True, run / "checkpoints", extra=[log]))
    assert (kept / "soak-replica-4.log").read_text() == "driver output\n" and not log.exists()


# ------------------------------------------------------------------ a mirror can be stalled


def test_a_stall_may_name_a_mirror():
    spec = FaultSpec(kind="stall", target="mirror:1", after_step=80, seconds=5)
    assert spec.target == "mirror:1"
    with pytest.raises(ValueError):
        FaultSpec(kind="corrupt_checkpoint", target="mirror:1")


def test_a_stall_after_a_step_waits_for_a_mirror_being_built(monkeypatch, tmp_path):
    monkeypatch.setattr(faults_module, "_TARGET_POLL_S", 0.01)
    answers = iter([{}, {"mirror:1": Target(None, "n")}, {"mirror:1": Target(4242, "n")}])
    killer = Killer(lambda: next(answers), lambda kill: None, 1.0, str(tmp_path / "faults"), str(tmp_path / "ck"))
    assert killer._process_of("mirror:1", wait_s=5.0) == Target(4242, "n")


def test_a_stall_whose_target_never_comes_is_logged_as_aborted(monkeypatch, tmp_path):
    monkeypatch.setattr(faults_module, "_TARGET_POLL_S", 0.01)
    monkeypatch.setattr(faults_module, "_TARGET_WAIT_S", 0.05)
    killer = Killer(dict, lambda kill: None, 1.0, str(tmp_path / "faults"), str(tmp_path / "ck"))
    killer.inject(FaultSpec(kind="stall", target="mirror:0", after_step=10, seconds=5), "at step 10")
    [line] = [json.loads(x) for p in (tmp_path / "faults").glob("*.jsonl") for x in p.read_text().splitlines()]
    assert line["event"] == "aborted" and line["target"] == "mirror:0" and "waited" in line["error"]


# ------------------------------------------------------------------ the table


def test_the_table_says_who_met_too_few_faults_the_scenario_and_where_a_run_is_kept():
    from benchmarks.soak import render

    scheduled = [{**SCHEDULE[0], "landed": True, "what_happened": "its mirror was promoted"},
                 {**SCHEDULE[2], "landed": True, "what_happened": "resumed; the shard kept serving"},
                 {**SCHEDULE[3], "landed": False, "what_happened": "not met (the run never got there)"}]
    run = {"seed": 4, "faults": 17, "kills_by_kind": {"shard": 9, "mirror": 2}, "other_faults": {"stall": 3},
           "shard_recoveries": 9, "supervisor_restarts": 1, "fallbacks": 0, "finished": True, "wedged": False,
           "violations": ["shard 1 lost samples: the report says 0, the recount 4,096"], "auc": 0.66,
           "lost_samples": 4096.0, "wall_s": 200.0, "commit": "abc1234", "scheduled": scheduled,
           "kept": "/runs/kept/soak-replica-4-20270101T000000",
           "promoted_shard_killed_before_new_mirror": {"shard": "shard:1", "steps": [43, 49], "met": True,
                                                       "first_recovery": "replica", "second_recovery": "recovery"}}
    meta = {"commit": "abc1234", "date": "2027-01-01", "command": "python benchmarks/soak.py --recovery replica",
            "machine": {"cpu": "x", "cores": 2, "memory_gib": 8, "python": "3.11"}}
    text = render({"meta": meta, "file": "soak-replica.json", "runs": [run], "min_faults": 20})
    assert "| 4 | 17 (< 20) |" in text and "0 of 1 met at least 20" in text
    assert "| 4 | 2 of 3 | slow_storage storage at step 400 | met: shard:1 at steps [43, 49]" in text
    assert "mirror:0: resumed; the shard kept serving" in text
    assert "- seed 4: `/runs/kept/soak-replica-4-20270101T000000`" in text


def test_a_rollback_during_a_stall_is_not_a_replacement_of_the_stalled_shard(tmp_path):
    stall = {"t": 300.0, "event": "sent", "fault": "stall", "target": "mirror:0", "pid": 77, "trigger": "at step 300",
             "stall_time": 300.0, "seconds": 8.0}
    run = _run_dir(tmp_path, [stall], {0: [{"t": 310.0, "why": "rollback", "chain": [280]}]}, [])
    [out] = scheduled_outcomes(run, [SCHEDULE[2]])
    assert out["shard_replaced"] is None and out["what_happened"] == "killed while stopped; the shard kept serving"


def test_a_kept_run_s_violations_name_where_the_driver_log_went(tmp_path):
    run = _finished_run(tmp_path)
    log = tmp_path / "runs" / "soak-replica-4.log"
    log.write_text("driver output\n")
    result = soak_result(4, str(run), _verdict([]), {}, [f"the driver exited with 2; see {log}"], False, [],
                         str(tmp_path / "kept"), False, str(run / "checkpoints"), extra=(log,))
    assert result["violations"][0] == f"the driver exited with 2; see {Path(result['kept']) / log.name}"


def test_the_soak_stops_before_a_run_when_the_disk_is_short(tmp_path):
    from benchmarks.soak import _short_of_disk

    assert _short_of_disk(tmp_path / "runs", 0.0, 3) is None
    said = _short_of_disk(tmp_path / "runs", 1e9, 3)
    assert said.startswith("stopped before seed 3: ") and "--min-free-gib" in said


# ------------------------------------------------------------------ the replay of each seed


def _replay(findings=(), gaps=(), checkpoints=(20, 100), exact=True, loads_by_why=None):
    """What ``app.soak.replay_soak_run`` returns: a ``verify.replay`` result (as far as the soak
    reads it) and the loads of the run's history ({"shard recovery": 1, "dense rollback": 2})."""
    from app.soak import Replayed

    whys = loads_by_why or {}
    result = SimpleNamespace(steps=104, checkpoints=list(checkpoints), findings=list(findings), gaps=list(gaps),
                             exact=exact, seconds=41.26, sound=not findings)
    return Replayed(result, sum(n for w, n in whys.items() if w.startswith("shard ")),
                    sum(n for w, n in whys.items() if w.startswith("dense ")), wall_s=47.04, loads_by_why=dict(whys))


REPORT = {"auc": 0.66, "steps": 100, "wall_time_s": {"training_s": 180.44}}


def test_a_replay_finding_or_gap_is_a_violation_and_keeps_the_run_whole(tmp_path):
    run = _finished_run(tmp_path)
    replayed = _replay(findings=["checkpoint 100 shard 1 table 3: 2 of 50 saved rows differ from the replay"],
                       gaps=["checkpoint 60: the replay never reached it before it was saved"], checkpoints=(20,))
    result = soak_result(4, str(run), _verdict([]), REPORT, [], False, [], str(tmp_path / "kept"), False,
                         str(run / "checkpoints"), replay=replayed)
    assert result["violations"] == ["replay: checkpoint 100 shard 1 table 3: 2 of 50 saved rows differ from the replay",
                                    "not replayed: checkpoint 60: the replay never reached it before it was saved"]
    kept = Path(result["kept"])
    assert (kept / "checkpoints" / "ckpt-00000020" / "shard-0.arrow").read_bytes() == b"rows" and not run.exists()
    assert result["replay"] == {"train_seconds": 180.4, "wall_s": 47.0, "steps": 104, "checkpoints": 1, "exact": True,
                                "seconds": 41.3, "findings": 1, "gaps": 1, "shard_loads": 0, "dense_loads": 0,
                                "loads_by_why": {}}
    assert result["failure_free_equal"] is False


def test_a_sound_replay_of_a_run_with_no_partial_recovery_is_the_failure_free_model(tmp_path):
    run = _finished_run(tmp_path)
    result = soak_result(4, str(run), _verdict([]), REPORT, [], False, [], str(tmp_path / "kept"), False,
                         str(run / "checkpoints"), replay=_replay())
    assert result["violations"] == [] and result["kept"] is None and not (run / "checkpoints").exists()
    assert result["replay"]["checkpoints"] == 2 and result["failure_free_equal"] is True
    # The final checkpoint (the run's steps, 100) not among those matched: not shown equal.
    run = _finished_run(tmp_path / "final")
    result = soak_result(4, str(run), _verdict([]), REPORT, [], False, [], str(tmp_path / "kept"), False,
                         str(run / "checkpoints"), replay=_replay(checkpoints=(20, 40)))
    assert result["failure_free_equal"] is False
    # Full rollbacks (every shard and the dense model to a checkpoint the replay matched) keep
    # it the failure-free model; a shard recovered alone from a checkpoint lost updates: another
    # model by design, whatever its replay.
    for i, (whys, equal) in enumerate([({"shard rollback": 2, "dense rollback": 2}, True),
                                       ({"shard recovery": 1}, None),
                                       ({"shard rollback": 2, "shard recovery": 1, "dense rollback": 2}, None)]):
        run = _finished_run(tmp_path / f"loads{i}")
        result = soak_result(4, str(run), _verdict([]), REPORT, [], False, [], str(tmp_path / "kept"), False,
                             str(run / "checkpoints"), replay=_replay(loads_by_why=whys))
        assert result["failure_free_equal"] is equal and result["violations"] == [], whys


def test_a_replay_that_raised_is_a_violation_not_a_crash(tmp_path, monkeypatch):
    import verify.replay.engine as engine
    from app.soak import replay_soak_run

    def broken(run_dir):
        raise FileNotFoundError(f"{run_dir}: the run's training store is not found; the replay needs it")

    monkeypatch.setattr(engine, "replay_dir", broken)
    run = _finished_run(tmp_path)
    replayed = replay_soak_run(run)
    assert replayed.result is None and replayed.error.startswith("FileNotFoundError(")
    result = soak_result(4, str(run), _verdict([]), REPORT, [], False, [], str(tmp_path / "kept"), False,
                         str(run / "checkpoints"), replay=replayed)
    assert result["violations"] == [f"replay raised {replayed.error}"] and result["kept"]
    assert result["replay"]["error"] == replayed.error and result["replay"]["train_seconds"] == 180.4
    assert result["failure_free_equal"] is None


def test_a_run_not_replayed_has_no_replay_entry(tmp_path):
    run = _finished_run(tmp_path)
    result = soak_result(4, str(run), _verdict([]), {"auc": 0.66}, [], False, [], str(tmp_path / "kept"), False,
                         str(run / "checkpoints"))
    assert "replay" not in result and "failure_free_equal" not in result


def test_the_table_shows_each_replay_beside_the_training_and_blanks_for_a_run_without_one():
    from benchmarks.soak import render

    meta = {"commit": "abc1234", "date": "2027-01-01", "command": "python benchmarks/soak.py --recovery replica",
            "machine": {"cpu": "x", "cores": 2, "memory_gib": 8, "python": "3.11"}}
    base = {"faults": 20, "kills_by_kind": {"shard": 9}, "other_faults": {}, "shard_recoveries": 9,
            "supervisor_restarts": 0, "fallbacks": 0, "finished": True, "wedged": False, "violations": [],
            "auc": 0.66, "lost_samples": 0.0, "wall_s": 300.0, "commit": "abc1234"}
    old = {**base, "seed": 0}
    replayed = {**base, "seed": 1, "failure_free_equal": True,
                "replay": {"train_seconds": 180.4, "wall_s": 47.0, "steps": 2404, "checkpoints": 118, "exact": True,
                           "seconds": 41.3, "findings": 0, "gaps": 0, "shard_loads": 0, "dense_loads": 0}}
    raised = {**base, "seed": 2, "violations": ["replay raised OSError('x')"], "failure_free_equal": None,
              "replay": {"train_seconds": 200.0, "wall_s": 1.0, "error": "OSError('x')"}}
    assert "replayed" not in render({"meta": meta, "runs": [old], "min_faults": 0})  # older results: as before
    text = render({"meta": meta, "runs": [old, replayed, raised], "min_faults": 0})
    assert "| 0 |  |  |  |  |  |  |  |  |  |" in text
    assert "| 1 | 2,404 | 118 | yes | 0 | 0 | 0 / 0 | 47 (41) | 180 | yes |" in text
    assert "| 2 | raised OSError('x') |  |  |  |  |  | 1 | 200 |  |" in text
    assert "1 of 2 sound and complete, 1 bit for bit, **1 raised**; replay time 26%-26% of the training time" in text
    assert "equals the failure-free run's bit for bit in 1 of the 1 runs with no partial recovery (promotions and full rollbacks only)" in text
