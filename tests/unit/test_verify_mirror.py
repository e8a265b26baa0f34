"""The checker's walk of a mirror's own audit log (issue 41, gaps 1 and 2), on hand-made logs:
from its base, an apply of step ``s`` finds ``s`` steps in the mirror's rows; promoted, the
mirror's walk ends at the count its generation's "replica" load claims; and its applies, as a
shard's, name a try the trainers committed."""

from __future__ import annotations

from pathlib import Path

import pytest

from verify.files import AuditFile, load_run
from verify.timeline import applies_committed, walk_shard

pytestmark = pytest.mark.timeout(30)

M = 2
LOG = "mirror-0-mirror0-500.jsonl"


def _file(path: str, kind: str, gen: int | None, records: list[dict]) -> AuditFile:
    f = AuditFile(Path(path), kind, 0, gen)
    f.records = [{**r, "_line": i} for i, r in enumerate(records, start=1)]
    f.lines = len(f.records)
    return f


def _apply(step: int, t: float, **stamp) -> dict:
    return {"t": t, **stamp, "event": "apply", "step": step, "try": [0, step],
            "microbatches": [step * M, step * M + 1]}


def _primary(last: int = 7) -> AuditFile:
    """Generation 0 applied steps 0..last."""
    return _file("shard-0-g0.jsonl", "shard", 0, [{"t": 0.0, "gen": 0, "event": "open", "pid": 100}]
                 + [_apply(s, 1.0 + s, gen=0) for s in range(last + 1)])


def _mirror(base: int, steps, promoted: int | None = None, primary_gen: int | None = 0) -> AuditFile:
    records = [{"t": 0.5, "mirror_of": 0, "event": "open", "pid": 500, "spare": "x-mirror0"},
               {"t": 0.6, "mirror_of": 0, "event": "base", "step": base, "primary_gen": primary_gen}]
    records += [_apply(s, 1.1 + s, mirror_of=0) for s in steps]
    if promoted is not None:
        records.append({"t": 19.0, "mirror_of": 0, "event": "promoted", "shard": 0, "generation": 1, "step": promoted})
    return _file(LOG, "mirror", None, records)


def _promoted(claim: int, last: int = 9, log: str | None = LOG) -> AuditFile:
    """Generation 1, the promoted mirror: its replica load claims ``claim`` steps."""
    return _file("shard-0-g1.jsonl", "shard", 1, [
        {"t": 20.0, "gen": 1, "event": "open", "pid": 500},
        {"t": 20.1, "gen": 1, "event": "load", "chain": [], "why": "replica", "step": claim, "pending": [],
         "mirror_log": log}] + [_apply(s, 21.0 + s, gen=1) for s in range(claim, last + 1)])


def test_a_promoted_mirror_walked_from_its_base_to_the_count_its_replica_load_claims_is_sound():
    assert walk_shard(0, [_primary(), _promoted(8), _mirror(3, range(3, 8), promoted=8)], M, 10) == ([], [])
    # A mirror never promoted is walked too, and counts for nothing in the shard's own steps.
    assert walk_shard(0, [_primary(9), _mirror(3, range(3, 9))], M, 10) == ([], [])


@pytest.mark.parametrize("mirror, claim, expected", [
    (_mirror(3, [3, 4, 6, 7], promoted=8), 8, "the mirror of shard 0 (mirror-0-mirror0-500.jsonl) skipped steps 5..5"),
    (_mirror(3, [3, 4, 4, 5, 6, 7], promoted=8), 8, "applied step 4 again: its rows held 5 steps"),
    (_mirror(3, range(3, 7), promoted=7), 8, "a mirror took its place claiming 8 steps; its log "
                                             "(mirror-0-mirror0-500.jsonl) walks to 7"),
    (_mirror(3, range(3, 7), promoted=8), 8, "was promoted claiming 8 steps; its log holds 7"),
    (_mirror(12, range(12, 14), promoted=14), 8,
     "took a base of 12 steps, which its primary (generation 0) never held"),
])
def test_a_mirrors_gap_repeat_or_a_count_its_replica_load_does_not_match_is_a_violation(mirror, claim, expected):
    v, _ = walk_shard(0, [_primary(), _promoted(claim), mirror], M, 10)
    assert any(expected in x for x in v), v


def test_a_replica_load_naming_a_mirror_log_that_is_not_there_is_a_violation():
    v, _ = walk_shard(0, [_primary(), _promoted(8, log="mirror-0-mirror9-1.jsonl")], M, 10)
    assert v == ["shard 0 generation 1: the mirror that took its place left no log mirror-0-mirror9-1.jsonl"]
    # Logs written before mirrors kept one name none: nothing to walk.
    assert walk_shard(0, [_primary(), _promoted(8, log=None)], M, 10) == ([], [])


def test_a_mirror_base_is_checked_against_the_generation_it_mirrored():
    # Generation 1 (the promoted mirror) held 8 steps at its load, then 9, 10: a new mirror of it
    # based on 8 is sound; on 5 it is not, though generation 0 held 5.
    second = _file("mirror-0-mirror1-600.jsonl", "mirror", None, [
        {"t": 22.0, "mirror_of": 0, "event": "open", "pid": 600},
        {"t": 22.1, "mirror_of": 0, "event": "base", "step": 8, "primary_gen": 1}])
    files = [_primary(), _promoted(8), _mirror(3, range(3, 8), promoted=8), second]
    assert walk_shard(0, files, M, 10) == ([], [])
    second.records[1]["step"] = 5
    v, _ = walk_shard(0, files, M, 10)
    assert v == ["the mirror of shard 0 (mirror-0-mirror1-600.jsonl) took a base of 5 steps, which its primary "
                 "(generation 1) never held"]


def test_a_mirror_applies_only_tries_the_trainers_committed_and_names_the_try():
    trainer = AuditFile(Path("trainer-0-10.jsonl"), "trainer", 0, None)
    trainer.records = [{"t": 1.0 + s, "event": "commit", "step": s, "try": [0, s, s], "_line": s + 1}
                       for s in range(10)]
    mirror = _mirror(3, range(3, 8), promoted=8)
    assert applies_committed({0: [_primary(), mirror]}, [trainer]) == []
    mirror.records[3]["try"] = [0, 9]
    assert applies_committed({0: [mirror]}, [trainer]) == [
        "the mirror of shard 0 (mirror-0-mirror0-500.jsonl) applied step 4 of try (0, 9), which no trainer "
        "committed (committed: [(0, 4)])"]
    mirror.records[3]["try"] = None
    assert applies_committed({0: [mirror]}, [trainer]) == [
        "the mirror of shard 0 (mirror-0-mirror0-500.jsonl) applied step 4 naming no try; the trainers committed "
        "it in [(0, 4)]"]


def test_the_run_files_put_a_shards_mirror_logs_after_its_generations_logs(tmp_path):
    (tmp_path / "config.yaml").write_text("run_dir: run\n")
    audit = tmp_path / "audit"
    audit.mkdir()
    for name in ("shard-0-g0.jsonl", "mirror-0-cpr-r-mirror0-77.jsonl", "shard-0-g1.jsonl", "mirror-1-x-5.jsonl",
                 "trainer-0-9.jsonl", "retention.jsonl"):
        (audit / name).write_text('{"t": 1.0, "event": "open", "pid": 77}\n')
    run = load_run(tmp_path)
    assert [(f.path.name, f.kind, f.gen) for f in run.shards[0]] == [
        ("shard-0-g0.jsonl", "shard", 0), ("shard-0-g1.jsonl", "shard", 1),
        ("mirror-0-cpr-r-mirror0-77.jsonl", "mirror", None)]
    assert [(f.path.name, f.kind) for f in run.shards[1]] == [("mirror-1-x-5.jsonl", "mirror")]
    assert [f.path.name for f in run.trainers] == ["trainer-0-9.jsonl"]
