"""What a CheckpointStore remembers about checkpoints: each corrupt one reported once in
``fallbacks``, and in ``verified_chain`` each checkpoint's files read and hashed at most
once per instance (committed checkpoints never change), until it is fenced or deleted."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import numpy as np
import pytest

from core.checkpoint import (
    DENSE_FILE,
    FULL,
    INCREMENTAL,
    CheckpointStore,
    ShardRows,
    shard_file_name,
    step_dir_name,
    write_blob,
    write_shard_file,
)

pytestmark = pytest.mark.timeout(60)


def commit(store: CheckpointStore, step: int, kind: str = FULL, base_step: int | None = None) -> None:
    rng = np.random.default_rng(step)
    data = ShardRows(
        tables=np.zeros(10, np.int32),
        rows=np.arange(10, dtype=np.int64),
        weights=rng.standard_normal((10, 4), dtype=np.float32),
        momentum=rng.random(10, dtype=np.float32),
    )
    entries = [write_shard_file(store.uri, step, 0, data), write_blob(store.uri, step, DENSE_FILE, b"d%d" % step)]
    store.commit(step, entries, kind=kind, base_step=base_step)


def flip_byte(root: Path, step: int, name: str) -> None:
    path = root / step_dir_name(step) / name
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


# ----------------------------------------------------------------------------- fallbacks


def test_each_corrupt_checkpoint_is_reported_once(tmp_path: Path, caplog) -> None:
    writer = CheckpointStore(str(tmp_path), keep_last=5)
    commit(writer, 10)
    commit(writer, 15, INCREMENTAL, 10)
    commit(writer, 20)
    flip_byte(tmp_path, 20, shard_file_name(0))
    store = CheckpointStore(str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="core.checkpoint"):
        for _ in range(3):
            assert store.chain_steps() == [10, 15]
            assert store.latest_valid().step == 15
            assert store.shard_chain(0)[0] == [10, 15]
    assert [step for step, _ in store.fallbacks] == [20]
    assert caplog.text.count("checkpoint step 20 is corrupt") == 1

    flip_byte(tmp_path, 15, DENSE_FILE)
    for _ in range(2):
        assert store.chain_steps() == [10]
    # Another reason, so another record: the incremental that now ends the chain.
    assert [step for step, _ in store.fallbacks] == [20, 15]
    assert store.fallbacks[1][1].endswith("(restore chain stops before it)")


# ----------------------------------------------------------------------------- verified_chain


def test_verified_chain_follows_the_rule_of_chain_steps(tmp_path: Path) -> None:
    writer = CheckpointStore(str(tmp_path), keep_last=5)
    commit(writer, 10)
    commit(writer, 20, INCREMENTAL, 10)
    commit(writer, 30, INCREMENTAL, 10)
    commit(writer, 40)
    flip_byte(tmp_path, 40, DENSE_FILE)
    flip_byte(tmp_path, 30, shard_file_name(0))
    store = CheckpointStore(str(tmp_path))
    assert store.verified_chain() == store.chain_steps() == [10, 20]
    assert store.verified_chain(upto_step=15) == store.chain_steps(upto_step=15) == [10]
    assert CheckpointStore(str(tmp_path / "empty")).verified_chain() == []


def test_verified_chain_reads_each_checkpoint_once(tmp_path: Path) -> None:
    writer = CheckpointStore(str(tmp_path), keep_last=5)
    commit(writer, 10)
    commit(writer, 15, INCREMENTAL, 10)
    store = CheckpointStore(str(tmp_path))
    assert store.verified_chain() == [10, 15]
    # Damage the first call would have caught: the second does not read the files again.
    flip_byte(tmp_path, 10, DENSE_FILE)
    flip_byte(tmp_path, 15, shard_file_name(0))
    assert store.verified_chain() == [10, 15]
    assert store.fallbacks == []
    # A fresh instance, and the public chain_steps, read them and refuse them.
    assert CheckpointStore(str(tmp_path)).verified_chain() == []
    assert store.chain_steps() == []


def test_a_checkpoint_found_corrupt_stays_corrupt(tmp_path: Path) -> None:
    writer = CheckpointStore(str(tmp_path), keep_last=5)
    commit(writer, 10)
    commit(writer, 20)
    flip_byte(tmp_path, 20, shard_file_name(0))
    store = CheckpointStore(str(tmp_path))
    assert store.verified_chain() == [10]
    flip_byte(tmp_path, 20, shard_file_name(0))  # the same byte back: the files verify again
    assert store.verified_chain() == [10]
    assert [step for step, _ in store.fallbacks] == [20]
    assert CheckpointStore(str(tmp_path)).verified_chain() == [20]


def test_what_the_instance_committed_counts_as_verified(tmp_path: Path) -> None:
    store = CheckpointStore(str(tmp_path))
    commit(store, 10)
    flip_byte(tmp_path, 10, shard_file_name(0))
    assert store.verified_chain() == [10]
    assert store.chain_steps() == []  # the public check reads the files


def test_a_fenced_step_is_judged_afresh(tmp_path: Path) -> None:
    writer = CheckpointStore(str(tmp_path), keep_last=5)
    commit(writer, 10)
    commit(writer, 20)
    store = CheckpointStore(str(tmp_path))
    assert store.verified_chain() == [20]
    kept = tmp_path / "kept"
    shutil.copytree(tmp_path / step_dir_name(20), kept)
    assert store.fence_after(10) == [20]
    assert store.verified_chain() == [10]
    # The step written again with the very same manifest, but other bytes in a file.
    shutil.copytree(kept, tmp_path / step_dir_name(20))
    flip_byte(tmp_path, 20, DENSE_FILE)
    assert store.verified_chain() == [10]


def test_a_deleted_step_is_judged_afresh(tmp_path: Path) -> None:
    writer = CheckpointStore(str(tmp_path), keep_last=5)
    commit(writer, 10)
    commit(writer, 20)
    store = CheckpointStore(str(tmp_path), keep_last=1)
    assert store.verified_chain(upto_step=10) == [10]
    kept = tmp_path / "kept"
    shutil.copytree(tmp_path / step_dir_name(10), kept)
    assert store.gc() == [10]
    shutil.copytree(kept, tmp_path / step_dir_name(10))
    flip_byte(tmp_path, 10, DENSE_FILE)
    assert store.verified_chain(upto_step=10) == []


def test_a_step_committed_anew_is_judged_afresh(tmp_path: Path) -> None:
    writer = CheckpointStore(str(tmp_path), keep_last=5)
    commit(writer, 10)
    commit(writer, 20)
    store = CheckpointStore(str(tmp_path))
    assert store.verified_chain() == [20]
    # Another instance (a restarted coordinator) rolls back and saves step 20 again.
    other = CheckpointStore(str(tmp_path), keep_last=5)
    assert other.fence_after(10) == [20]
    commit(other, 20)
    flip_byte(tmp_path, 20, DENSE_FILE)
    assert store.verified_chain() == [10]
