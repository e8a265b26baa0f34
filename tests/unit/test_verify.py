"""The checker's walks over audit logs (``verify.timeline``), on small hand-made logs: what
an exactly-once history looks like, and each way one can break it."""

from __future__ import annotations

from pathlib import Path

import json
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


def test_a_commit_of_a_try_its_trainer_then_logged_aborted_is_not_a_commit():
    # Trainer 0 summed step 5 and logged its commit, its vote riding on the report; trainer 1's
    # sum broke and its abort came first. Trainer 0 logs "aborted", and both redo step 5.
    def tried(f: AuditFile, t: float, step: int, attempt: int) -> None:
        for r in f.records:
            if r.get("event") == "commit" and r["t"] == t:
                r["try"] = [1, step, attempt]

    a = trainer_file(0, 10, commits(0, range(0, 5), 1, 0.0) + [("commit", 5, 1, [10], 5.0)]
                     + [("commit", 5, 2, [10], 7.0)] + commits(0, range(6, 8), 2, 8.0))
    a.records.insert(7, {"t": 6.0, "event": "aborted", "step": 5, "rank": 0, "try": [1, 5, 0], "_line": 99})
    b = trainer_file(1, 11, commits(1, range(0, 5), 1, 0.0) + [("commit", 5, 2, [11], 7.0)]
                     + commits(1, range(6, 8), 2, 8.0))
    tried(a, 5.0, 5, 0), tried(a, 7.0, 5, 1), tried(b, 7.0, 5, 1)
    assert walk_dense([a, b], M, 8, killed=set()) == []
    a.records.pop(7)  # without its "aborted" line, trainer 0's lone commit of step 5 is a finding
    assert walk_dense([a, b], M, 8, killed=set()) != []


def test_a_replacement_that_went_on_from_its_own_load_redoes_the_step_a_dying_peer_committed():
    """Seen in the replica soak at c6e9296: every trainer died at step 5; replacement A loaded
    checkpoint 5 and, alone in its quorum, committed its try of step 5, then died too; B loaded
    checkpoint 5 a moment *before* A's commit, healed to 5 and committed step 5 again. B's redo
    comes from its own load, not from A's commit."""
    a = trainer_file(0, 10, commits(0, range(0, 5), 1, 0.0))
    b = trainer_file(1, 11, commits(1, range(0, 5), 1, 0.0))
    a2 = trainer_file(0, 20, [("load", 5, "resume", 10.0), ("commit", 5, 2, [10, 11], 10.5)])
    b2 = trainer_file(1, 21, [("load", 5, "resume", 10.4), ("commit", 5, 3, [10, 11], 12.0),
                              ("commit", 6, 3, [12, 13], 12.5), ("commit", 7, 3, [14, 15], 13.0)])
    b2.records.insert(2, {"t": 11.0, "event": "heal", "step": 5, "rank": 1, "_line": 98})
    assert walk_dense([a, b, a2, b2], M, 8, killed={10, 11, 20}) == []
    # Without its own load (a trainer that just went on), the same commit is a double one.
    b2.records.pop(1)
    assert any("dense step 5 committed again" in x for x in walk_dense([a, b, a2, b2], M, 8, killed={10, 11, 20}))


def test_a_torn_line_is_accepted_only_last_and_from_a_killed_writer():
    f = shard_file(0, applies(range(0, 3), 0.0), pid=100)
    f.torn, f.lines = [(f.lines + 1, '{"t": 3.0, "gen": 0, "eve')], f.lines + 1
    assert torn_lines([f], killed={100}) == []
    assert "was not killed" in torn_lines([f], killed=set())[0]
    f.torn = [(2, '{"t": 0.')]
    assert "is not its writer's last" in torn_lines([f], killed={100})[0]


def _run_files(tmp_path: Path, report: dict, faults: list[dict], shards: dict | None = None):
    from verify.files import RunFiles

    return RunFiles(tmp_path, {}, report, {}, shards or {}, [], faults, [])


def _host_fault(kind: str, ip: str, t: float) -> dict:
    return {"t": t, "event": "sent", "fault": kind, "target": "host:1", "pid": None, "ip": ip}


def test_every_host_kill_is_a_reported_host_loss_and_every_reported_loss_has_a_cause(tmp_path):
    from verify.kills import check_hosts, host_faults

    faults = [_host_fault("host_kill", "10.77.0.11", 100.0), _host_fault("partition", "10.77.0.12", 200.0)]
    lost = [{"node_ip": "10.77.0.11", "declared_dead_at": 101.5}, {"node_ip": "10.77.0.12", "declared_dead_at": 202.0}]
    run = _run_files(tmp_path, {"hosts_lost": lost}, faults)
    assert check_hosts(run, host_faults(run)) == []
    # A partition Ray did not take for a loss is no violation; a kill the report missed is.
    run = _run_files(tmp_path, {"hosts_lost": lost[1:]}, faults)
    assert check_hosts(run, host_faults(run)) == [
        "host 10.77.0.11 was killed at 100.000 (fault log) but the report names no loss of it after that"]
    # A loss nothing explains: the report names one the fault log lacks (or one before its fault).
    run = _run_files(tmp_path, {"hosts_lost": lost + [{"node_ip": "10.77.0.11", "declared_dead_at": 99.0}]}, faults)
    assert len(check_hosts(run, host_faults(run))) == 1


def test_a_kill_matches_its_report_entry_whatever_its_time_rounds_to(tmp_path):
    from verify.kills import check_kills, landed_kills

    # Both sides hold the very float the killer took; a time whose 4th to 6th decimals sit
    # just under a half once matched no report entry (the log's time was rounded twice).
    t = 1764300000.1234996
    faults = [{"t": t, "event": "sending", "fault": "kill", "target": "trainer:0", "pid": 7, "sender": 9},
              {"t": t + 0.01, "event": "sent", "fault": "kill", "target": "trainer:0", "pid": 7, "kill_time": t}]
    run = _run_files(tmp_path, {"faults_injected": [{"target": "trainer:0", "pid": 7, "time": t}]}, faults)
    kills, problems = landed_kills(run)
    assert problems == [] and [k.time for k in kills] == [t]
    assert check_kills(run, kills) == []
    run = _run_files(tmp_path, {"faults_injected": [{"target": "trainer:0", "pid": 7, "time": t + 1.0}]}, faults)
    assert len(check_kills(run, kills)) == 2


def test_the_processes_of_a_killed_host_may_leave_a_torn_line(tmp_path):
    from verify.kills import host_faults, host_victims

    on_host = shard_file(0, applies(range(3), 10.0), pid=300)
    on_host.records[0]["ip"] = "10.77.0.11"
    elsewhere = shard_file(1, applies(range(3), 10.0), k=1, pid=400)
    elsewhere.records[0]["ip"] = "10.77.0.12"
    later = shard_file(2, applies(range(3), 500.0), k=0, pid=500)
    later.records[0]["ip"] = "10.77.0.11"
    run = _run_files(tmp_path, {}, [_host_fault("host_kill", "10.77.0.11", 100.0)], {0: [on_host, later], 1: [elsewhere]})
    assert host_victims(run, host_faults(run)) == {300}


def test_a_cluster_runs_processes_are_checked_on_their_own_host(tmp_path):
    import json

    from verify.leftovers import run_processes

    (tmp_path / "logs").mkdir()
    for name in ["shard-0-10.77.0.11-42.log", "trainer-1-10.77.0.12-42.log", "shard-1-77.log", "driver.log"]:
        (tmp_path / "logs" / name).write_text("")
    run = _run_files(tmp_path, {}, [])
    assert set(run_processes(run)) == {42, 77}  # no cluster.json: every pid is this host's
    (tmp_path / "cluster.json").write_text(json.dumps({"hosts": {"10.77.0.11": 1, "10.77.0.12": 2}}))
    assert set(run_processes(run)) == {77}
    assert [w for w, _ in run_processes(run, "10.77.0.12").values()] == ["trainer-1 (log trainer-1-10.77.0.12-42.log)"]


def test_a_live_process_of_the_run_is_left_behind_on_its_own_host_only(tmp_path):
    """A real process named by a log on cluster host .11: checked on .11 it is left behind;
    checked on .12, or as the root host's, it is not that host's to answer for."""
    import json
    import subprocess
    import time

    from verify.leftovers import leftovers

    proc = subprocess.Popen(["sleep", "60"])
    try:
        time.sleep(0.1)
        (tmp_path / "logs").mkdir()
        (tmp_path / "logs" / f"shard-0-10.77.0.11-{proc.pid}.log").write_text("")
        (tmp_path / "cluster.json").write_text(json.dumps({"hosts": {"10.77.0.11": 1, "10.77.0.12": 2}}))
        run = _run_files(tmp_path, {}, [])
        assert leftovers(run, wait_s=0.0, host="10.77.0.11") == [
            f"left behind on host 10.77.0.11 after the run: process {proc.pid}: shard-0 (log shard-0-10.77.0.11-{proc.pid}.log)"]
        assert leftovers(run, wait_s=0.0, host="10.77.0.12") == []
        assert leftovers(run, wait_s=0.0) == []
        proc.kill()
        proc.wait()
        assert leftovers(run, wait_s=0.0, host="10.77.0.11") == []  # gone: nothing left
    finally:
        proc.kill()
        proc.wait()


def test_a_damaged_checkpoint_loaded_is_a_violation_unless_its_step_was_saved_again_first(tmp_path):
    from verify.kills import Damage, check_damage_unused

    f = shard_file(1, [("load", [626], "recovery", 50.0)], k=1)
    run = _run_files(tmp_path, {}, [], {1: [f]})
    damage = [Damage(626, 1, "shard-1.arrow", 30.0)]
    assert len(check_damage_unused(run, damage, lambda step: 20.0)) == 1  # the damaged checkpoint itself
    assert len(check_damage_unused(run, damage, lambda step: None)) == 1
    # Fenced by a rollback at 35 and saved again at 40: the load at 50 is of the new checkpoint.
    assert check_damage_unused(run, damage, lambda step: 40.0) == []


def test_a_missing_share_of_a_replacement_killed_right_after_it_healed_is_explained():
    """The soak's seed 6: a replacement trainer healed to step 155 from its peer, took its share
    of step 155 (the shards applied all four ids) and was killed before writing its commit."""
    a = trainer_file(0, 10, commits(0, range(0, 8), 1, 0.0))
    healed = trainer_file(1, 12, [("load", 4, "resume", 3.0)])
    healed.records.append({"t": 3.5, "event": "heal", "step": 7, "why": "heal", "rank": 1, "_line": 3})
    early = trainer_file(1, 11, commits(1, range(0, 7), 1, 0.0))
    assert walk_dense([a, early, healed], M, 8, killed={12}) == []
    # Not explained when the replacement was not killed, or had healed to another step.
    assert any("step 7 (quorum 1) committed microbatches [14]" in x for x in walk_dense([a, early, healed], M, 8, set()))
    healed.records[-1]["step"] = 6
    assert any("committed microbatches [14]" in x for x in walk_dense([a, early, healed], M, 8, {12}))


def test_the_checker_hashes_whole_and_chunked_checksums_with_its_own_code(tmp_path):
    """``cpr verify`` reads checksums of both kinds (whole-file, as older checkpoints have,
    and chunked, as files are written now) and finds a changed byte in either."""
    import hashlib

    from verify.store import Store

    raw = bytes(range(256)) * ((3 << 20) // 256 + 7)  # a little over 3 MiB: four 1 MiB chunks
    d = tmp_path / "ckpt-000000000004"
    d.mkdir()
    (d / "shard-0.arrow").write_bytes(raw)
    pieces = [raw[i: i + (1 << 20)] for i in range(0, len(raw), 1 << 20)]
    chunked = hashlib.sha256(b"".join(hashlib.sha256(p).digest() for p in pieces)).hexdigest()
    for checksum in (f"sha256:{hashlib.sha256(raw).hexdigest()}", f"sha256c1:{chunked}"):
        manifest = {"step": 4, "files": {"shard-0.arrow": {"size_bytes": len(raw), "checksum": checksum}}}
        (d / "manifest.json").write_text(json.dumps(manifest))
        assert Store(str(tmp_path)).problems(4) == []
        changed = bytearray(raw)
        changed[(2 << 20) + 5] ^= 1
        (d / "shard-0.arrow").write_bytes(bytes(changed))
        [problem] = Store(str(tmp_path)).problems(4)
        assert "hashes to" in problem
        (d / "shard-0.arrow").write_bytes(raw)
    # Chunks larger than any reader accepts (1024 MiB), or a name with a trailing newline: not ours.
    for checksum in ("sha256c2048:" + "0" * 64, "sha256c16\n:" + "0" * 64):
        manifest = {"step": 4, "files": {"shard-0.arrow": {"size_bytes": len(raw), "checksum": checksum}}}
        (d / "manifest.json").write_text(json.dumps(manifest))
        [problem] = Store(str(tmp_path)).problems(4)
        assert "is not one its writer makes" in problem


def test_a_mirror_taking_a_shards_place_keeps_its_steps_and_loses_nothing():
    """A promoted mirror's "replica" load carries the steps in its rows: its predecessor's, or
    one fewer (the predecessor applied its last committed step, which the mirror holds and
    applies next). Anything else is a violation; the report's replica failures match the logs."""
    from verify.lost import check_replicas

    def mirror(step, applied_from):
        f = shard_file(1, [("load", [], "replica", 20.0)] + applies(range(applied_from, 10), 21.0))
        f.records[1]["step"] = step
        return f

    dead = shard_file(0, applies(range(0, 8), 0.0))
    for step, first in ((8, 8), (7, 7)):
        v, spans = walk_shard(0, [dead, mirror(step, first)], M, 10)
        assert (v, spans) == ([], []), step
    v, _ = walk_shard(0, [dead, mirror(5, 5)], M, 10)
    assert v and "a mirror with 5 steps replaced one with 8" in v[0]
    report = {"failures": [{"recovery": "replica", "shard": 0, "generation": 0, "lost_samples": 0.0,
                            "bytes_reloaded": 0}]}
    assert check_replicas({0: [dead, mirror(8, 8)]}, report) == []
    assert "its audit logs 0" in check_replicas({0: [dead]}, report)[0]
    report["failures"][0]["lost_samples"] = 3.0
    assert "3.0 lost samples" in check_replicas({0: [dead, mirror(8, 8)]}, report)[0]


def test_a_generation_that_dies_holding_a_committed_step_it_had_not_applied_loses_that_step():
    """A step applies at its commit: a shard that died after its trainers committed step 8 (its
    gradients all there, its "complete" line written) and before the next step's request
    never applied it. The step's update is lost with it, as the supervisor counts it."""
    dead = shard_file(2, [("load", [5], "recovery", 1.0)])
    dead.records.append({"t": 2.0, "gen": 2, "event": "complete", "step": 8, "microbatches": [16, 17],
                         "_line": 3})
    new = shard_file(3, [("load", [5], "recovery", 20.0)] + applies(range(9, 12), 21.0))
    earlier = shard_file(1, applies(range(0, 8), -20.0))
    v, spans = walk_shard(0, [earlier, dead, new], M, 12)
    span = next(s for s in spans if s.generation == 2)
    assert span.applied == {8: [16, 17]} and span.redo == 9 and span.chain == [5]
    assert not [x for x in v if "generation 2" in x]


def test_a_promoted_mirror_recovered_from_a_checkpoint_loses_its_predecessors_steps_too():
    """Its rows held its primary's steps: killed again before a new mirror existed and restored
    from the checkpoint of step 4, it lost every step since 4, not only those since its
    promotion (before, the recount restarted at the promotion: 0 instead of the report's count)."""
    primary = shard_file(0, applies(range(0, 8), 0.0))
    promoted = shard_file(1, [("load", [], "replica", 20.0)] + applies(range(8, 10), 21.0))
    promoted.records[1]["step"] = 8
    restored = shard_file(2, [("load", [4], "recovery", 30.0)] + applies(range(10, 12), 31.0))
    v, spans = walk_shard(0, [primary, promoted, restored], M, 12)
    assert v == []
    [span] = spans
    assert (span.generation, span.chain, span.redo, sorted(span.applied)) == (1, [4], 10, list(range(10)))


def test_books_that_contradict_what_the_processes_confirmed_are_a_finding():
    from verify.run import _contradictions

    events = [{"kind": "books_corrected", "finding": "lag", "subject": "commits", "detail": "behind"},
              {"kind": "books_corrected", "finding": "contradiction", "subject": "mirror:1", "detail": "broken"}]
    assert _contradictions({"events": events}) == [
        "the supervisor's books contradicted what the processes confirmed (mirror:1): broken"]


def test_a_shard_applying_a_try_no_trainer_committed_is_a_violation():
    """Step 3's first try was abandoned and its second committed: a shard that applied the
    first (its gradients were all there when the next request came) broke the protocol."""
    from verify.timeline import applies_committed

    trainer = AuditFile(Path("trainer-0-10.jsonl"), "trainer", 0, 0)
    trainer.records = [{"t": 1.0, "event": "commit", "step": 3, "try": [2, 3, 1], "_line": 1}]
    shard = shard_file(2, applies([3], 2.0))
    shard.records[-1]["try"] = [2, 1]
    assert applies_committed({0: [shard]}, [trainer]) == []
    shard.records[-1]["try"] = [2, 0]
    [v] = applies_committed({0: [shard]}, [trainer])
    assert "shard 0 applied step 3 of try (2, 0), which no trainer committed" in v
