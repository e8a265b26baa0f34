"""Restore targets against retention and removal, on real files: a protected chain outlives
the gc of a save that commits meanwhile, and a checkpoint that vanishes or lacks a shard's
file is a recorded fallback, never passed over in silence."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from actors.supervisor.checkpoints import CheckpointCoordinator
from actors.supervisor.costs import SharedCosts
from actors.supervisor.hooks import HookList
from core.checkpoint import FULL, INCREMENTAL, CheckpointStore, ShardRows, write_blob, write_shard_file
from core.checkpoint.retention import with_bases
from core.config import config_from_dict
from policies import BudgetLimits, FailurePolicy, OnlineCostModel

pytestmark = pytest.mark.timeout(60)


def _rows(step: int, shard: int) -> ShardRows:
    rng = np.random.default_rng(step * 10 + shard)
    return ShardRows(np.zeros(4, np.int32), np.arange(4, dtype=np.int64), rng.standard_normal((4, 4), dtype=np.float32),
                     rng.random(4, dtype=np.float32))


def _commit(store: CheckpointStore, step: int, kind: str = FULL, base: int | None = None, shards=(0, 1)) -> None:
    """A checkpoint of ``step`` whose manifest lists the files of ``shards`` and the dense blob."""
    entries = [write_shard_file(store.uri, step, k, _rows(step, k)) for k in (0, 1)]
    listed = [e for k, e in zip((0, 1), entries) if k in shards]
    store.commit(step, [*listed, write_blob(store.uri, step, "dense.pt", b"d")], kind=kind, base_step=base)


def _coordinator(tmp_path, pinned=set):
    cfg = config_from_dict({"run_dir": str(tmp_path), "data": {"train": ["x"], "eval": ["y"]},
                            "checkpoint": {"keep_last": 1, "every_steps": 10}})
    costs = SharedCosts(OnlineCostModel(mtbf_s=100.0, save_cost_s=1.0, load_cost_s=1.0, reschedule_cost_s=1.0))
    return CheckpointCoordinator(cfg, _plan(cfg), costs, lambda kind, **f: {}, lambda: 0.1, HookList(),
                                 lambda *a: None, keep=pinned, policy=FailurePolicy(BudgetLimits()),
                                 fail=lambda reason: None)


def test_a_protected_chain_outlives_the_gc_of_a_save_that_commits_meanwhile(tmp_path):
    # Defect 3: a partial recovery chose the chain (10, 15) at detection; a save in flight
    # commits step 20 before the shard loads, and its gc (keep_last: 1) deleted the chain.
    c = _coordinator(tmp_path)
    _commit(c.store, 10)
    _commit(c.store, 15, INCREMENTAL, 10)
    chain = c.chain_candidates()
    assert chain == (10, 15)
    c.targets.protect("recovery of shard 1", chain)
    _commit(c.store, 20)
    assert c.store.list_committed() == [10, 15, 20]
    assert c.store.shard_chain(1, upto_step=15)[0] == [10, 15]  # still loadable, whole
    assert c.targets.protected() == {10, 15}

    # Released (the restore is done), the next save's gc deletes it, as an unprotected chain
    # would have gone at step 20's commit.
    c.targets.release("recovery of shard 1")
    c.targets.release("recovery of shard 1")  # idempotent
    assert c.targets.protected() == set()
    _commit(c.store, 30)
    assert c.store.list_committed() == [30]


def test_without_protection_the_same_commit_deletes_the_chain(tmp_path):
    c = _coordinator(tmp_path)
    _commit(c.store, 10)
    _commit(c.store, 15, INCREMENTAL, 10)
    chain = c.chain_candidates()
    _commit(c.store, 20)
    assert not set(chain) & set(c.store.list_committed())


def test_a_protected_incremental_keeps_what_it_builds_on(tmp_path):
    # Protecting the last step of a chain keeps its base full and the incrementals before it:
    # without them it would restore rows that never were together.
    c = _coordinator(tmp_path)
    _commit(c.store, 10)
    _commit(c.store, 12, INCREMENTAL, 10)
    _commit(c.store, 15, INCREMENTAL, 10)
    c.targets.protect("rollback", [15])
    _commit(c.store, 20)
    assert c.store.list_committed() == [10, 12, 15, 20]
    c.targets.protect("rollback", [20])  # a second call replaces the first
    _commit(c.store, 30)
    assert c.store.list_committed() == [20, 30]


def test_owners_protect_apart_and_trainer_pins_still_count(tmp_path):
    pins = {10}
    c = _coordinator(tmp_path, pinned=lambda: pins)
    c.targets.protect("recovery", [20])
    c.targets.protect("rollback", [30])
    for step in (10, 20, 30, 40):
        _commit(c.store, step)
    assert c.store.list_committed() == [10, 20, 30, 40]
    assert c.targets.protected() == {20, 30}
    c.targets.release("recovery")
    pins.clear()
    _commit(c.store, 50)
    assert c.store.list_committed() == [30, 50]


def test_a_protection_made_while_gc_decides_binds_that_gc(tmp_path):
    # gc reads what to keep, then deletes: a chain protected in between (the supervisor's
    # thread deciding a recovery while the save thread commits) must not be deleted by it.
    calls = []

    def pins():
        if not calls:
            c.targets.protect("recovery", [10])  # lands after this gc read what to keep
        calls.append(1)
        return set()

    c = _coordinator(tmp_path, pinned=pins)
    _commit(c.store, 10)
    _commit(c.store, 20)
    assert c.store.list_committed() == [10, 20] and len(calls) >= 2


def test_with_bases_adds_the_chain_an_incremental_restores_through(tmp_path):
    store = CheckpointStore(str(tmp_path), keep_last=10)
    _commit(store, 10)
    _commit(store, 12, INCREMENTAL, 10)
    _commit(store, 20)
    _commit(store, 25, INCREMENTAL, 20)
    infos = {s: store.info(s) for s in store.list_committed()}
    assert with_bases(infos, [12]) == {10, 12}
    assert with_bases(infos, [25, 99]) == {20, 25, 99}  # a step not committed is kept as named


def test_a_checkpoint_removed_while_a_chain_is_read_is_a_recorded_fallback(tmp_path, monkeypatch, caplog):
    # Before, a step whose manifest vanished between the listing and the read was passed over
    # without a word: a shard then fell back (or reset) with nothing saying why.
    store = CheckpointStore(str(tmp_path), keep_last=10)
    _commit(store, 10)
    _commit(store, 20)
    reader = CheckpointStore(str(tmp_path))
    listed = reader.list_committed()
    CheckpointStore(str(tmp_path), keep_last=10).fence_after(10)
    monkeypatch.setattr(reader, "list_committed", lambda: listed)  # every listing is stale
    with caplog.at_level(logging.WARNING, logger="core.checkpoint"):
        steps, _ = reader.shard_chain(0)
    assert steps == [10]
    assert [s for s, _ in reader.fallbacks] == [20] and "removed while it was being loaded" in reader.fallbacks[0][1]
    assert reader.removed_steps == {20}
    assert "checkpoint step 20 was removed while it was being loaded" in caplog.text


def test_a_removal_seen_mid_read_lists_again_and_finds_the_newer_state(tmp_path, monkeypatch):
    store = CheckpointStore(str(tmp_path), keep_last=10)
    _commit(store, 10)
    reader = CheckpointStore(str(tmp_path))
    stale = reader.list_committed()
    _commit(store, 20)
    CheckpointStore(str(tmp_path), keep_last=1).gc()  # retention removes 10 meanwhile
    listings = [stale]
    real = CheckpointStore.list_committed
    monkeypatch.setattr(reader, "list_committed", lambda: listings.pop() if listings else real(reader))
    assert reader.shard_chain(0)[0] == [20]
    assert [s for s, _ in reader.fallbacks] == [10] and reader.removed_steps == {10}


def test_a_manifest_that_lists_no_file_for_the_shard_is_corrupt_for_it(tmp_path):
    # Before: CheckpointNotFound, which the chain rule took for a removed step and skipped
    # in silence.
    store = CheckpointStore(str(tmp_path), keep_last=10)
    _commit(store, 10)
    _commit(store, 20, shards=(0,))
    reader = CheckpointStore(str(tmp_path))
    assert reader.shard_chain(0)[0] == [20]
    assert reader.shard_chain(1)[0] == [10]
    assert reader.fallbacks == [(20, "checkpoint step 20 lists no file shard-1.arrow; it lists "
                                     "['dense.pt', 'shard-0.arrow']")]
    assert reader.removed_steps == set()


def test_a_save_that_committed_after_the_journals_last_write_is_the_schedules_newest(tmp_path):
    # A supervisor killed between a save's manifest and its event restarted with the schedule of
    # the save before: its next incrementals named an older full as their base.
    c = _coordinator(tmp_path)
    for step in (10, 20):
        _commit(c.store, step, kind=FULL)
    c.load({"save_index": 1, "last_full_step": 10, "last_checkpoint_step": 10, "next_checkpoint_step": 20,
            "interval_steps_in_use": 10, "in_flight_step": 20})
    assert (c.last_checkpoint_step, c.last_full_step) == (20, 20)


def _plan(cfg):
    """The plan of a run of ``cfg`` on two shards (the manifests record it)."""
    from core.plan import make_plan

    return make_plan(cfg.embeddings.sharding, cfg.model.rows_per_table, 2)
