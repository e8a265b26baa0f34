"""The checker's walks over audit logs (``verify.timeline``), on small hand-made logs: what
an exactly-once history looks like, and each way one can break it."""

from __future__ import annotations

from pathlib import Path

import pytest

from verify.files import AuditFile
from verify.timeline import torn_lines, walk_dense, walk_shard

pytestmark = pytest.mark.timeout(30)

M = 2


def shard_file(gen: int, events: list[tuple], k: int = 0, pid: int = 100) -> AuditFile:
    """events: ("apply", step, t) or ("load", chain, why, t)."""
    f = AuditFile(Path(f"shard-{k}-g{gen}.jsonl"), "shard", k, gen)
    f.records.append({"t": events[0][-1] - 0.001, "gen": gen, "event": "open", "pid": pid + gen, "_line": 1})
    for i, e in enumerate(events, start=2):
        if e[0] == "apply":
            f.records.append({"t": e[2], "gen": gen, "event": "apply", "step": e[1],
                              "microbatches": list(range(e[1] * M, e[1] * M + M)), "_line": i})
        else:
            f.records.append({"t": e[3], "gen": gen, "event": "load", "chain": e[1], "why": e[2], "_line": i})
    f.lines = len(f.records)
    return f


def applies(steps, t0: float) -> list[tuple]:
    return [("apply", s, t0 + i) for i, s in enumerate(steps)]


def test_a_partial_recovery_keeps_the_dead_generations_steps_and_names_its_lost_span():
    dead = shard_file(0, applies(range(0, 8), 0.0))
    # Restored from the checkpoint of step 5; trainers redo step 8, where the dead one stood.
    new = shard_file(1, [("load", [5], "recovery", 20.0)] + applies(range(8, 12), 21.0))
    v, spans = walk_shard(0, [dead, new], M, 12)
    assert v == []
    [span] = spans
    assert (span.generation, span.chain, span.redo, sorted(span.applied)) == (0, [5], 8, list(range(8)))


def test_a_rollback_makes_the_steps_after_it_applied_exactly_once_more():
    f = shard_file(0, applies(range(0, 8), 0.0) + [("load", [5], "rollback", 10.0)] + applies(range(5, 10), 11.0))
    assert walk_shard(0, [f], M, 10) == ([], [])


@pytest.mark.parametrize("steps, expected", [
    ([0, 1, 3, 4], "skipped steps 2..2"),
    ([0, 1, 2, 2, 3, 4], "applied step 2 again"),
    ([0, 1, 2, 3], "holds 4 applied steps at the end, the run has 5"),
])
def test_a_gap_a_repeat_or_a_short_history_is_a_violation(steps, expected):
    v, _ = walk_shard(0, [shard_file(0, applies(steps, 0.0))], M, 5)
    assert any(expected in x for x in v), v


def test_a_rollback_that_skips_a_redo_is_a_violation():
    # Rolled back to 5 but went on at 7: steps 5 and 6 were never applied again.
    f = shard_file(0, applies(range(0, 8), 0.0) + [("load", [5], "rollback", 10.0)] + applies(range(7, 10), 11.0))
    v, _ = walk_shard(0, [f], M, 10)
    assert any("skipped steps 5..6" in x for x in v), v


def test_an_older_generation_applying_after_a_newer_took_over_is_a_violation():
    old = shard_file(0, applies(range(0, 4), 0.0) + [("apply", 4, 30.0)])
    new = shard_file(1, [("load", [2], "recovery", 20.0)] + applies(range(4, 6), 21.0))
    v, _ = walk_shard(0, [old, new], M, 6)
    assert any("generation 0 applied step 4 after generation 1 took over" in x for x in v), v


def trainer_file(rank: int, pid: int, events: list[tuple]) -> AuditFile:
    """events: ("commit", step, quorum, microbatches, t) or ("load", step, why, t)."""
    f = AuditFile(Path(f"trainer-{rank}-{pid}.jsonl"), "trainer", rank, None)
    f.records.append({"t": events[0][-1] - 0.001, "event": "open", "rank": rank, "pid": pid, "_line": 1})
    for i, e in enumerate(events, start=2):
        if e[0] == "commit":
            f.records.append({"t": e[4], "event": "commit", "step": e[1], "quorum": e[2], "rank": rank,
                              "microbatches": e[3], "total": M, "_line": i})
        else:
            f.records.append({"t": e[3], "event": "load", "step": e[1], "why": e[2], "rank": rank, "_line": i})
    f.lines = len(f.records)
    return f


def commits(rank: int, steps, quorum: int, t0: float) -> list[tuple]:
    return [("commit", s, quorum, [s * M + rank], t0 + i) for i, s in enumerate(steps)]


def test_dense_commits_exactly_once_with_a_rollback():
    a = trainer_file(0, 10, commits(0, range(0, 6), 1, 0.0) + [("load", 3, "rollback", 9.0)]
                     + commits(0, range(3, 8), 2, 10.0))
    b = trainer_file(1, 11, commits(1, range(0, 6), 1, 0.0) + [("load", 3, "rollback", 9.0)]
                     + commits(1, range(3, 8), 2, 10.0))
    assert walk_dense([a, b], M, 8, killed=set()) == []


def test_a_dense_step_committed_again_without_a_rollback_or_with_a_missing_share_is_a_violation():
    a = trainer_file(0, 10, commits(0, range(0, 6), 1, 0.0) + commits(0, range(3, 8), 2, 10.0))
    b = trainer_file(1, 11, commits(1, range(0, 6), 1, 0.0) + commits(1, range(3, 7), 2, 10.0))
    v = walk_dense([a, b], M, 8, killed=set())
    assert any("dense step 3 committed again" in x for x in v), v
    assert any("step 7 (quorum 2) committed microbatches [14]" in x for x in v), v
    # The same missing share is explained when its trainer was killed right after step 6.
    assert not any("step 7" in x for x in walk_dense([a, b], M, 8, killed={11}))


def test_a_torn_line_is_accepted_only_last_and_from_a_killed_writer():
    f = shard_file(0, applies(range(0, 3), 0.0), pid=100)
    f.torn, f.lines = [(f.lines + 1, '{"t": 3.0, "gen": 0, "eve')], f.lines + 1
    assert torn_lines([f], killed={100}) == []
    assert "was not killed" in torn_lines([f], killed=set())[0]
    f.torn = [(2, '{"t": 0.')]
    assert "is not its writer's last" in torn_lines([f], killed={100})[0]
