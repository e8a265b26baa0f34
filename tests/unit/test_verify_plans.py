"""cpr verify across a resume on another plan, on synthetic audit logs (found in review): a shard
the last plan does not have is walked to the step the run resumed from, not to the run's end; a
damaged file counts against the shards of another plan that read it; only the writers of an
attempt that did not finish are taken for killed."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from verify.files import AuditFile
from verify.kills import Damage, check_damage_unused, crashed_attempt_pids
from verify.timeline import walk_shard

M = 1


def _shard(k: int, gen: int, records: list[dict]) -> AuditFile:
    f = AuditFile(Path(f"shard-{k}-g{gen}.jsonl"), "shard", k, gen)
    f.records = [dict(r, _line=i + 1) for i, r in enumerate(records)]
    return f


def _applies(first: int, last: int, t0: float) -> list[dict]:
    return [{"event": "apply", "step": s, "microbatches": [s], "t": t0 + s} for s in range(first, last)]


def test_a_shard_the_last_plan_has_not_is_walked_to_the_resume():
    log = _shard(2, 0, [{"event": "open", "pid": 7, "slices": [[0, 20, 30]], "t": 0.0}] + _applies(0, 45, 1.0))
    assert walk_shard(2, [log], M, 100)[0] == ["shard 2 holds 45 applied steps at the end, the run has 100"]
    assert walk_shard(2, [log], M, 100, retired_at=40)[0] == []
    assert walk_shard(2, [log], M, 100, retired_at=50)[0] == [
        "shard 2 held 45 applied steps when the run resumed without it from step 50"]


def test_a_damaged_file_counts_against_the_shards_of_another_plan_that_read_it():
    # Checkpoint 40 of two table-wise shards: shard 0 holds table 0, shard 1 table 1. A resume on
    # three shards: shard 2 holds table 1 (read from shard-1.arrow), shard 1 table 2 (another's).
    written = [[(0, 0, 10)], [(1, 0, 10)]]
    damaged = [Damage(step=40, file="shard-1.arrow", shard=1, time=5.0)]
    load = {"event": "load", "chain": [40], "why": "resume", "t": 6.0}
    run = SimpleNamespace(shards={
        1: [_shard(1, 3, [{"event": "open", "pid": 8, "slices": [[2, 0, 10]], "t": 5.5}, load])],
        2: [_shard(2, 0, [{"event": "open", "pid": 9, "slices": [[1, 0, 10]], "t": 5.5}, load])],
    })
    found = check_damage_unused(run, damaged, lambda step: None, lambda step: written)
    assert found == ["shard 2 (generation 0) loaded checkpoint 40 at 6.000, after its file shard-1.arrow was damaged "
                     "at 5.000"]


def test_only_the_writers_of_an_attempt_that_did_not_finish_count_as_killed():
    def log(k, pid, t):
        return _shard(k, 0, [{"event": "open", "pid": pid, "t": t}])

    run = SimpleNamespace(shards={0: [log(0, 1, 1.0), log(0, 2, 11.0), log(0, 3, 21.0)]}, trainers=[])
    report = {"events": [{"kind": "attempt_started", "time": 10.0, "previous_state": "finished"},
                         {"kind": "attempt_started", "time": 20.0, "previous_state": "running"}]}
    assert crashed_attempt_pids(run, report) == {2}
