"""Checkpoints that retention removes are checked too (issue 41, gap 3), and a manifest that
lacks a shard's file or the dense state is refused (gap 4). With ``audit_log`` the supervisor's
store appends each checkpoint it is about to remove to ``audit/retention.jsonl``: its manifest
and each file's checksum computed again from the bytes on storage (``core.checkpoint``'s own
code); ``cpr verify`` checks those against the manifest (``verify.retention``)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from core.checkpoint import DATA_POSITION_FILE, DENSE_FILE, FULL, CheckpointStore, ShardRows, step_dir_name
from core.checkpoint import write_blob, write_shard_file
from core.checkpoint.removal_log import RemovalLog
from verify.files import RunFiles
from verify.retention import check_removed
from verify.store import Store

pytestmark = pytest.mark.timeout(60)


def _save(store: CheckpointStore, uri: str, step: int, shards: int = 2) -> None:
    rows = ShardRows(np.arange(3, dtype=np.int32), np.arange(3, dtype=np.int64),
                     np.full((3, 4), step, np.float32), np.zeros(3, np.float32))
    entries = [write_shard_file(uri, step, k, rows) for k in range(shards)]
    entries += [write_blob(uri, step, DENSE_FILE, f"dense-{step}".encode()),
                write_blob(uri, step, DATA_POSITION_FILE, b"{}")]
    store.commit(step, entries, kind=FULL)


def _run(run_dir: Path, shards: int = 2) -> RunFiles:
    return RunFiles(run_dir, {"embeddings": {"num_shards": shards}}, {}, {}, {}, [], [], [])


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "audit" / "retention.jsonl").read_text().splitlines()]


def test_retention_records_each_checkpoint_it_removes_hashed_from_storage_and_the_checker_verifies_it(tmp_path):
    uri, run_dir = str(tmp_path / "ckpt"), tmp_path / "run"
    store = CheckpointStore(uri, keep_last=1, audit_removal=RemovalLog(str(run_dir / "audit")))
    for step in (10, 20, 30):
        _save(store, uri, step)
    assert store.list_committed() == [30]
    records = _records(run_dir)
    assert [(r["event"], r.get("step")) for r in records] == [("open", None), ("remove", 10), ("remove", 20)]
    removed = records[1]
    assert removed["why"] == "retention" and removed["manifest"]["step"] == 10
    assert removed["files"] == {name: {"size_bytes": e["size_bytes"], "checksum": e["checksum"]}
                                for name, e in removed["manifest"]["files"].items()}
    assert sorted(removed["files"]) == [DATA_POSITION_FILE, DENSE_FILE, "shard-0.arrow", "shard-1.arrow"]
    assert check_removed(_run(run_dir)) == []

    # A file whose bytes changed on storage before retention removed it: the record says so.
    _save(store, uri, 40)
    shard = Path(uri) / step_dir_name(40) / "shard-1.arrow"
    raw = bytearray(shard.read_bytes())
    raw[-9] ^= 1
    shard.write_bytes(bytes(raw))
    _save(store, uri, 50)
    [problem] = check_removed(_run(run_dir))
    assert problem.startswith("checkpoint 40: file shard-1.arrow hashed to sha256c16:") and "when retention" in problem
    # Unless the fault injector damaged it on purpose.
    assert check_removed(_run(run_dir), damaged={(40, "shard-1.arrow")}) == []


def test_a_checkpoint_retention_cannot_record_is_kept_for_a_later_gc(tmp_path):
    uri = str(tmp_path / "ckpt")

    def unwritable(step, found):
        raise OSError("disk full")

    store = CheckpointStore(uri, keep_last=1, audit_removal=unwritable)
    for step in (10, 20):
        _save(store, uri, step)  # the gc after 20 fails (logged): the commit stands
    assert store.list_committed() == [10, 20]


def _remove(step: int, files: dict, found: dict | None = None) -> str:
    manifest = {"format": 1, "step": step, "kind": "full", "files": files}
    return json.dumps({"t": 1.0, "event": "remove", "why": "retention", "step": step, "manifest": manifest,
                       "files": dict(files) if found is None else found})


def _entries(*names: str) -> dict:
    return {n: {"size_bytes": 3, "checksum": f"sha256c16:{i:064x}"} for i, n in enumerate(names)}


def test_the_checker_refuses_a_removed_checkpoint_that_lacked_a_file_or_did_not_match(tmp_path):
    (tmp_path / "audit").mkdir()
    log = tmp_path / "audit" / "retention.jsonl"
    full = _entries("dense.pt", "shard-0.arrow", "shard-1.arrow")
    short = {**full, "shard-0.arrow": {"size_bytes": 2, "checksum": full["shard-0.arrow"]["checksum"]}}
    lines = ['{"t": 0.5, "event": "open", "pid": 7}', _remove(10, full),
             _remove(20, _entries("dense.pt", "shard-0.arrow")), _remove(30, full, short),
             _remove(40, full, {k: v for k, v in full.items() if k != "dense.pt"}),
             json.dumps({"t": 2.0, "event": "remove", "step": 50, "manifest": None, "manifest_error": "ValueError()"})]
    log.write_text("\n".join(lines) + "\n")
    assert check_removed(_run(tmp_path)) == [
        "checkpoint 20: its manifest lists no shard-1.arrow (the run has 2 shards)",
        "checkpoint 30: file shard-0.arrow held 2 bytes when retention removed it, its manifest says 3",
        "checkpoint 40: file dense.pt was not hashed before retention removed it",
        "checkpoint 50: removed by retention with an unreadable manifest (ValueError())"]
    # A torn line: only as the writer's last (killed while writing it, before the removal).
    log.write_text("\n".join([lines[0], lines[1], '{"t": 3.0, "ev']) + "\n")
    assert check_removed(_run(tmp_path)) == []
    log.write_text("\n".join([lines[0], '{"t": 3.0, "ev', lines[1]]) + "\n")
    assert check_removed(_run(tmp_path)) == [
        """retention.jsonl line 2 does not parse and is not its writer's last: '{"t": 3.0, "ev'"""]
    log.write_text("\n".join([lines[0], '{"t": 3.0, "ev', lines[0], lines[1]]) + "\n")
    assert check_removed(_run(tmp_path)) == []  # the next writer's "open" follows it


def test_a_committed_manifest_without_every_shards_file_and_the_dense_state_is_refused(tmp_path):
    uri = str(tmp_path)
    store = CheckpointStore(uri, keep_last=5)
    _save(store, uri, 10, shards=2)
    assert Store(uri).problems(10, shards=2) == []
    assert Store(uri).problems(10, shards=3) == [
        "checkpoint 10: its manifest lists no shard-2.arrow (the run has 3 shards)"]
    assert Store(uri).problems(10) == []  # not asked: the number of shards is not known
    manifest = Path(uri) / step_dir_name(10) / "manifest.json"
    doc = json.loads(manifest.read_text())
    del doc["files"][DENSE_FILE]
    manifest.write_text(json.dumps(doc))
    assert Store(uri).problems(10, shards=2) == ["checkpoint 10: its manifest lists no dense.pt (the run has 2 shards)"]


def _coordinator(run_dir: Path, audit_log: bool):
    from actors.supervisor.checkpoints import CheckpointCoordinator
    from actors.supervisor.costs import SharedCosts
    from actors.supervisor.hooks import HookList
    from core.config import config_from_dict
    from policies import BudgetLimits, FailurePolicy, OnlineCostModel

    cfg = config_from_dict({"run_dir": str(run_dir), "data": {"train": ["x"], "eval": ["y"]}, "audit_log": audit_log,
                            "checkpoint": {"keep_last": 1, "every_steps": 10}})
    costs = SharedCosts(OnlineCostModel(mtbf_s=100.0, save_cost_s=1.0, load_cost_s=1.0, reschedule_cost_s=1.0))
    return CheckpointCoordinator(cfg, _plan(cfg), costs, lambda kind, **f: {}, lambda: 0.1, HookList(), lambda *a: None,
                                 policy=FailurePolicy(BudgetLimits()), fail=lambda reason: None,
                                 audit_dir=str(run_dir / "audit") if audit_log else None)


def test_the_supervisors_retention_records_what_it_removes_only_with_an_audit_log(tmp_path):
    for audit_log, run_dir in ((False, tmp_path / "plain"), (True, tmp_path / "audited")):
        c = _coordinator(run_dir, audit_log)
        for step in (10, 20):
            _save(c.store, c.cfg.checkpoint_uri, step)
        assert c.store.list_committed() == [20]
        assert (run_dir / "audit" / "retention.jsonl").exists() == audit_log
    assert [r.get("step") for r in _records(tmp_path / "audited")] == [None, 10]
    assert check_removed(_run(tmp_path / "audited")) == []


def _plan(cfg):
    """The plan of a run of ``cfg`` on two shards (the manifests record it)."""
    from core.plan import make_plan

    return make_plan(cfg.embeddings.sharding, cfg.model.rows_per_table, 2)
