"""A shard's load without Ray, on real checkpoint files: what it restores when its chain is
unlisted, removed or corrupt, and that it goes back to its initial rows only when the run has
no checkpoint at all, saying so."""

from __future__ import annotations

import json
import pickle

import numpy as np
import pytest

from actors.shard import EmbeddingShard
from core.checkpoint import FULL, NO_CHECKPOINT_YET, CheckpointStore, shard_file_name, step_dir_name
from core.errors import NoValidChain
from core.plan import make_plan

pytestmark = pytest.mark.timeout(120)

TABLE_ROWS = [50] * 26
DIM = 4
PLAN = make_plan("table_wise", TABLE_ROWS, 2)


def _shard(k: int, **kw) -> EmbeddingShard:
    return EmbeddingShard(k, list(PLAN.shards[k]), DIM, learning_rate=0.1, eps=1e-8, seed=3, microbatches_per_step=1,
                          **kw)


def _train(shards, step: int) -> None:
    rows = np.random.default_rng(step).integers(0, 50, size=(8, 26))
    for k, shard in enumerate(shards):
        sb = PLAN.route(rows, k)
        shard.lookup(step, (step,), sb.lengths, sb.indices)
        shard.push_grads(step, (step,), np.ones((8, len(PLAN.shards[k]) * DIM), dtype=np.float32))


def _run(uri: str, steps: int, keep_last: int = 10, listed=(0, 1)):
    """Two shards trained for ``steps`` steps with a full checkpoint after each; ``listed``
    (a function of the step) says whose files the manifest lists. Returns the rows of each
    shard at each checkpoint."""
    store = CheckpointStore(uri, keep_last=keep_last)
    shards, saved = [_shard(0), _shard(1)], {}
    for step in range(steps):
        _train(shards, step)
        entries = []
        for shard in shards:
            shard.save_checkpoint(uri, step + 1, full=True)
            entries.append(shard.save_written(step + 1).entry)
        who = listed(step + 1) if callable(listed) else listed
        store.commit(step + 1, [entries[k] for k in who], kind=FULL)
        saved[step + 1] = [shard.get_rows() for shard in shards]
    return saved


def _same_rows(a, b) -> bool:
    return all(np.array_equal(wa, wb) and np.array_equal(ma, mb) for (wa, ma), (wb, mb) in zip(a, b))


def test_a_manifest_that_lists_no_file_of_the_shard_is_a_fallback_to_the_older_full(tmp_path):
    # Defect 3: the missing entry read as "not found", which the chain rule passed over in
    # silence; now the step and the file are named and the shard loads the older full.
    uri = str(tmp_path / "ckpt")
    saved = _run(uri, 2, listed=lambda step: (0, 1) if step == 1 else (0,))
    for why in ("recovery", "rollback"):
        fresh = _shard(1)
        loaded = fresh.load_checkpoint(uri, [2], why)
        assert loaded.chain == (1,) and _same_rows(fresh.get_rows(), saved[1][1])
        assert [(f.step, f.removed) for f in loaded.fallbacks] == [(2, False)]
        assert "step 2 lists no file shard-1.arrow" in loaded.fallbacks[0].reason
        assert loaded.initial_rows_reason is None and fresh.applied_step == 0


def test_a_partial_recovery_whose_chain_was_removed_loads_the_newer_full(tmp_path):
    # Defect 3: the chain chosen at detection (step 1) was deleted by the gc of a save that
    # committed before the load (keep_last: 1); the shard reset to its initial rows although
    # step 2 holds a newer full.
    uri = str(tmp_path / "ckpt")
    saved = _run(uri, 2, keep_last=1)
    assert CheckpointStore(uri).list_committed() == [2]
    fresh = _shard(0)
    loaded = fresh.load_checkpoint(uri, [1], "recovery")
    assert loaded.chain == (2,) and loaded.rows == PLAN.shard_rows(0) and fresh.applied_step == 1
    assert _same_rows(fresh.get_rows(), saved[2][0])
    assert [(f.step, f.removed) for f in loaded.fallbacks] == [(1, True)]
    assert "removed after it was chosen" in loaded.fallbacks[0].reason

    # A rollback must stay at or before its chain: with nothing left there it refuses.
    with pytest.raises(NoValidChain, match=r"shard 0 .* at or before step 1 .*step 1: removed after it was chosen"):
        _shard(0).load_checkpoint(uri, [1], "rollback")


def test_a_partial_recovery_loads_a_checkpoint_committed_after_its_chain_was_chosen(tmp_path):
    uri = str(tmp_path / "ckpt")
    saved = _run(uri, 3)
    fresh = _shard(1)
    loaded = fresh.load_checkpoint(uri, [1], "recovery")
    assert loaded.chain == (3,) and loaded.fallbacks == () and _same_rows(fresh.get_rows(), saved[3][1])
    back = _shard(1)
    assert back.load_checkpoint(uri, [2], "rollback").chain == (2,) and _same_rows(back.get_rows(), saved[2][1])


def test_no_valid_file_of_the_shard_in_any_checkpoint_refuses_instead_of_resetting(tmp_path):
    # Defect 3: every file of shard 0 is corrupt or unlisted: before, it reset to its initial
    # rows (every step since the start lost, nothing said); now NoValidChain names each step.
    uri = str(tmp_path / "ckpt")
    _run(uri, 3, listed=lambda step: (1,) if step == 3 else (0, 1))
    for step in (1, 2):
        path = tmp_path / "ckpt" / step_dir_name(step) / shard_file_name(0)
        path.write_bytes(path.read_bytes()[:-64] + bytes(64))
    survivor = _shard(0)
    _train([survivor], 0)
    trained = survivor.get_rows()
    with pytest.raises(NoValidChain) as refused:
        survivor.load_checkpoint(uri, [3], "recovery")
    err = refused.value
    assert err.shard_id == 0 and err.upto_step is None and [s for s, _ in err.tried] == [3, 2, 1]
    assert "lists no file shard-0.arrow" in err.tried[0][1] and "checksum" in err.tried[1][1]
    again = pickle.loads(pickle.dumps(err))  # crosses Ray intact
    assert isinstance(again, NoValidChain) and str(again) == str(err) and again.tried == err.tried
    assert survivor.applied_step == 0 and _same_rows(survivor.get_rows(), trained)  # not reset


def test_with_no_checkpoint_at_all_the_initial_rows_say_why(tmp_path):
    uri = str(tmp_path / "ckpt")
    audit = tmp_path / "audit"
    shard = _shard(0, audit_dir=str(audit))
    initial = shard.get_rows()
    _train([shard], 0)
    loaded = shard.load_checkpoint(uri, [], "recovery")
    assert (loaded.rows, loaded.chain, loaded.fallbacks) == (0, (), ())
    assert loaded.initial_rows_reason == NO_CHECKPOINT_YET == "no checkpoint exists yet: the initial rows"
    assert shard.applied_step == -1 and all(np.array_equal(a[0], b[0]) for a, b in zip(initial, shard.get_rows()))
    records = [json.loads(line) for line in (audit / "shard-0-g0.jsonl").read_text().splitlines()]
    load = [r for r in records if r["event"] == "load"]
    assert load == [{**load[0], "chain": [], "why": "recovery", "initial_rows_reason": NO_CHECKPOINT_YET}]
