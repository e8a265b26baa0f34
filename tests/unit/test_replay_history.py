"""What the replay takes from the audit logs (``verify.replay.history``): a trainer's load
counts only if that trainer trained on from it, a try a trainer logged committed and then
learnt was aborted is dropped, a share nobody logged is the step's missing microbatches, and a
shard's load takes effect at the first step its generation served. No Ray, no files."""

from pathlib import Path

from verify.files import AuditFile, RunFiles
from verify.replay.history import read_history

M = 4


def _trainer(rank: int, pid: int, *records: dict) -> AuditFile:
    f = AuditFile(Path(f"trainer-{rank}-{pid}.jsonl"), "trainer", rank, None)
    f.records = [{"event": "open", "pid": pid, "threads": 1, "t": 0.0, "_line": 1}] + [
        {**r, "rank": rank, "_line": i + 2} for i, r in enumerate(records)]
    return f


def _commit(step: int, t: float, ids, attempt: int = 0) -> dict:
    return {"event": "commit", "step": step, "t": t, "quorum": 1, "microbatches": list(ids), "total": M,
            "try": [0, step, attempt], "dense": "d"}


def _run(trainers, shards=None) -> RunFiles:
    return RunFiles(Path("."), {}, None, {}, shards or {}, trainers, [], [])


def test_a_replacements_resume_that_a_heal_superseded_is_not_a_load():
    healed = _trainer(1, 20, {"event": "load", "step": 10, "why": "resume", "t": 5.0},
                      {"event": "heal", "step": 30, "t": 5.1}, _commit(30, 6.0, [121, 123]))
    rolled = _trainer(0, 21, {"event": "load", "step": 10, "why": "rollback", "t": 7.0},
                      {"event": "heal", "step": 10, "t": 7.1}, _commit(10, 8.0, [40, 41, 42, 43]))
    died = _trainer(0, 22, {"event": "load", "step": 20, "why": "resume", "t": 9.0})
    h = read_history(_run([healed, rolled, died]), M)
    assert [(d.step, d.why) for d in h.dense_loads] == [(10, "rollback")]


def test_an_aborted_try_is_dropped_and_a_killed_trainers_share_is_filled_in():
    t0 = _trainer(0, 30, _commit(5, 1.0, [20, 22]), _commit(6, 2.0, [24, 26]),
                  {"event": "aborted", "step": 6, "try": [0, 6, 0], "t": 2.1}, _commit(6, 3.0, [24, 25, 26, 27], 1))
    t1 = _trainer(1, 31, _commit(5, 1.0, [21, 23]))  # killed before logging step 6's commit
    h = read_history(_run([t0, t1]), M)
    assert [(c.step, c.try_) for c in h.commits] == [(5, (0, 5, 0)), (6, (0, 6, 1))]
    assert [ids for _, ids, _ in h.commits[0].shares] == [[20, 22], [21, 23]]
    t1.records = t1.records[:1]
    h = read_history(_run([t0, t1]), M)
    assert h.commits[0].shares == [(0, [20, 22], 1), (None, [21, 23], None)]


def test_a_shard_load_takes_effect_at_the_first_step_its_generation_served():
    g1 = AuditFile(Path("shard-1-g1.jsonl"), "shard", 1, 1)
    g1.records = [{"event": "open", "pid": 5, "device": "cpu", "slices": [[0, 0, 10]], "t": 4.0, "_line": 1},
                  {"event": "load", "chain": [20], "why": "recovery", "t": 4.1, "_line": 2},
                  {"event": "complete", "step": 26, "try": [0, 0], "t": 5.0, "_line": 3},
                  {"event": "apply", "step": 26, "try": [0, 0], "rows": "r", "t": 5.1, "_line": 4}]
    mirror = AuditFile(Path("mirror-1-m-6.jsonl"), "mirror", 1, None)
    mirror.records = [{"event": "load", "chain": [], "why": "recovery", "t": 1.0, "_line": 1}]
    h = read_history(_run([], {1: [g1, mirror]}), M)
    [load] = h.shard_loads
    assert (load.shard, load.generation, load.chain, load.first_step) == (1, 1, [20], 26)
    assert h.slices == {(1, 1): [(0, 0, 10)]} and h.applies == {(26, (0, 0)): [(1, 1, "shard-1-g1.jsonl", "r")]}
    assert h.slices_of(1) == h.slices_of(1, 1) == [(0, 0, 10)] and h.slices_of(1, 0) == []
    assert not h.accelerated


def test_a_try_no_shard_applied_and_another_replaced_was_not_committed():
    """Seen in the soak: trainer 1 logged step 26's first try committed (its vote not waited
    for) and died with trainer 0; their replacements started from the checkpoint at 26 and
    committed a later try of step 26, the one the shards applied. The first was never the
    run's: no shard applied it."""
    t1 = _trainer(1, 40, _commit(25, 1.0, [100, 102]), _commit(26, 2.0, [104, 106]))
    t0 = _trainer(0, 41, _commit(25, 1.0, [101, 103]))
    t0b = _trainer(0, 42, {"event": "load", "step": 26, "why": "resume", "t": 5.0},
                   _commit(26, 6.0, [104, 105, 106, 107], 2))
    shard = AuditFile(Path("shard-0-g0.jsonl"), "shard", 0, 0)
    shard.records = [{"event": "apply", "step": 25, "try": [0, 0], "t": 1.5, "_line": 1},
                     {"event": "apply", "step": 26, "try": [0, 2], "t": 6.5, "_line": 2}]
    h = read_history(_run([t1, t0, t0b], {0: [shard]}), M)
    assert [(c.step, c.try_) for c in h.commits] == [(25, (0, 25, 0)), (26, (0, 26, 2))]


def test_a_step_every_shard_lost_before_applying_it_still_holds_in_the_dense_model():
    """Step 26 committed; every shard died before applying it (recovered partially, the step
    lost on their side) and the trainers went on to 27 with it in their dense model. A later
    rollback redoes 26 as another try, which the shards apply: the first try still happened."""
    t0 = _trainer(0, 50, _commit(25, 1.0, [100, 101, 102, 103]), _commit(26, 2.0, [104, 105, 106, 107]),
                  _commit(27, 4.0, [108, 109, 110, 111]), {"event": "load", "step": 20, "why": "rollback", "t": 9.0},
                  *[_commit(s, 10.0 + s, range(4 * s, 4 * s + 4), 1) for s in range(20, 28)])
    shard = AuditFile(Path("shard-0-g1.jsonl"), "shard", 0, 1)
    shard.records = [{"event": "apply", "step": 25, "try": [0, 0], "t": 1.5, "_line": 1},
                     {"event": "apply", "step": 26, "try": [0, 1], "t": 36.5, "_line": 2}]
    h = read_history(_run([t0], {0: [shard]}), M)
    assert [(c.step, c.try_) for c in h.commits][:3] == [(25, (0, 25, 0)), (26, (0, 26, 0)), (27, (0, 27, 0))]


def test_a_shards_load_is_due_no_later_than_its_next_load():
    """A generation that completed step 20 and never applied it, then a rollback to 15 that
    reloaded the shard: both take effect before step 15 is redone, in their order."""
    from verify.replay.engine import _due_steps
    from verify.replay.history import ShardLoad

    loads = [ShardLoad(1, 2, [15], "recovery", 1.0, 20), ShardLoad(0, 0, [15], "rollback", 2.0, 15),
             ShardLoad(1, 3, [15], "rollback", 2.0, 15), ShardLoad(1, 4, [15], "recovery", 3.0, None),
             ShardLoad(0, 1, [15], "recovery", 4.0, 30)]
    assert _due_steps(loads) == [None, 15, None, None, 30]
    assert _due_steps(loads[:3]) == [15, 15, 15]


def test_a_checkpoint_reached_again_after_a_rollback_is_judged_by_its_last_comparison(monkeypatch):
    """Seen in the soak: the replay reached step 20 in a timeline a rollback then undid (a
    partial recovery's loss in it), compared it with checkpoint 20 as saved again later, and
    the redo's comparison matched; the first comparison's "not bit for bit" outlived it."""
    from types import SimpleNamespace

    import verify.replay.engine as engine

    calls = []

    def dense_problems(step, model, optimizer, params, sums, steps, tol, seen):
        calls.append(step)
        if len(calls) == 1:
            seen.exact = False
            return [f"checkpoint {step} dense tensor 0 parameter: 1 of 4 values differ from the replay"]
        return []

    monkeypatch.setattr(engine, "dense_problems", dense_problems)
    monkeypatch.setattr(engine, "saved_dense", lambda store, step, directory=None: ([], [], []))
    r = object.__new__(engine.Replay)
    r.history, r.unknown, r._snap_shard, r._snap_dense, r._snapshots = SimpleNamespace(slices={}), False, set(), set(), {}
    r.saved, r.damage, r.model, r.optimizer = {20: 100.0}, [], None, None
    r.store = SimpleNamespace(shard_files=lambda step: [])  # a checkpoint of the dense model alone
    r.files = SimpleNamespace(ok=lambda step, name, loaded_at=None: True)
    r.tolerance, r.result, r._at_boundary = engine.Tolerance(), engine.ReplayResult(), {}
    r._reached(20, 50.0)
    r._reached(20, 90.0)
    r._conclude()
    assert calls == [20, 20]
    assert (r.result.findings, r.result.checkpoints, r.result.exact) == ([], [20], True)


def test_a_lone_try_of_a_dying_trainer_is_not_the_runs_though_a_peer_loaded_just_before_it():
    """Seen in the replica soak at 5b1a8cd: after a rollback to 1380, trainer 1 loaded the
    checkpoint; a moment later trainer 0, alone in its quorum, logged its try of 1380 committed
    and died. Trainer 1 then committed another try of 1380 (the one the shards applied) and went
    on to 1381. The lone try was not the run's: nobody went on from it."""
    t0 = _trainer(0, 60, {"event": "load", "step": 1380, "why": "resume", "t": 8.9},
                  {"event": "heal", "step": 1380, "t": 8.95}, _commit(1380, 9.0, range(5520, 5524), 1))
    t1 = _trainer(1, 61, {"event": "load", "step": 1380, "why": "resume", "t": 8.8},
                  {"event": "heal", "step": 1380, "t": 13.5}, _commit(1380, 13.6, range(5520, 5524), 2),
                  _commit(1381, 13.7, range(5524, 5528)))
    shard = AuditFile(Path("shard-0-g3.jsonl"), "shard", 0, 3)
    shard.records = [{"event": "apply", "step": 1380, "try": [0, 2], "t": 13.65, "_line": 1}]
    h = read_history(_run([t0, t1], {0: [shard]}), M)
    assert [(c.step, c.try_) for c in h.commits] == [(1380, (0, 1380, 2)), (1381, (0, 1381, 0))]
