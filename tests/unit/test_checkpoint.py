"""Tests of core.checkpoint on real files: round trip, manifest gating, corruption
fallback, retention and incremental restore chains."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import numpy as np
import pytest

from core.checkpoint import (
    DATA_POSITION_FILE,
    DENSE_FILE,
    FULL,
    INCREMENTAL,
    MANIFEST_FILE,
    CheckpointStore,
    FileEntry,
    ShardRows,
    shard_file_name,
    step_dir_name,
    write_blob,
    write_shard_file,
)
from core.errors import CheckpointCorrupt, CheckpointNotFound

pytestmark = pytest.mark.timeout(60)

DIM = 8


def random_rows(seed: int, n: int, tables: int = 3, dim: int = DIM) -> ShardRows:
    rng = np.random.default_rng(seed)
    return ShardRows(
        tables=rng.integers(0, tables, n, dtype=np.int32),
        rows=rng.choice(10 * n, n, replace=False).astype(np.int64),
        weights=rng.standard_normal((n, dim), dtype=np.float32),
        momentum=rng.random(n, dtype=np.float32),
    )


def assert_rows_equal(actual: ShardRows, expected: ShardRows) -> None:
    for name in ("tables", "rows", "weights", "momentum"):
        a, e = getattr(actual, name), getattr(expected, name)
        assert a.dtype == e.dtype, name
        assert a.shape == e.shape, name
        assert np.array_equal(a, e), name


def save(uri: str, step: int, shards: int = 2, seed: int | None = None) -> list[FileEntry]:
    """Write a small checkpoint with ``shards`` shards plus both blobs, uncommitted."""
    seed = step if seed is None else seed
    entries = [write_shard_file(uri, step, k, random_rows(seed * 100 + k, 50)) for k in range(shards)]
    entries.append(write_blob(uri, step, DENSE_FILE, f"dense-{step}".encode()))
    entries.append(write_blob(uri, step, DATA_POSITION_FILE, json.dumps({"file": 3, "row": step}).encode()))
    return entries


def save_and_commit(store: CheckpointStore, step: int, **commit_kwargs):
    return store.commit(step, save(store.uri, step), **commit_kwargs)


def file_path(root: Path, step: int, name: str) -> Path:
    return root / step_dir_name(step) / name


def flip_byte(path: Path, offset: int | None = None) -> None:
    data = bytearray(path.read_bytes())
    offset = len(data) // 2 if offset is None else offset
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


# ----------------------------------------------------------------------------- round trip


@pytest.mark.parametrize("scheme", ["path", "file_uri"])
def test_round_trip_is_bit_exact(tmp_path: Path, scheme: str) -> None:
    uri = str(tmp_path / "ck") if scheme == "path" else f"file://{tmp_path / 'ck'}"
    shards = [random_rows(1, 1000), random_rows(2, 777)]
    dense = os.urandom(4096)
    position = json.dumps({"file": 7, "row": 123456}).encode()

    entries = [write_shard_file(uri, 100, k, rows) for k, rows in enumerate(shards)]
    entries.append(write_blob(uri, 100, DENSE_FILE, dense))
    entries.append(write_blob(uri, 100, DATA_POSITION_FILE, position))
    store = CheckpointStore(uri)
    committed = store.commit(100, entries, meta={"lr": 0.01, "world": 2})

    info = store.verify(100)
    assert info == committed
    assert info.kind == FULL and info.base_step is None
    assert info.meta == {"lr": 0.01, "world": 2}
    assert info.shard_ids == [0, 1]
    assert info.total_bytes == sum(e.size_bytes for e in entries)
    for k, rows in enumerate(shards):
        assert_rows_equal(store.read_shard(100, k), rows)
    assert store.read_blob(100, DENSE_FILE) == dense
    assert json.loads(store.read_blob(100, DATA_POSITION_FILE)) == {"file": 7, "row": 123456}


def test_entry_matches_bytes_on_disk(tmp_path: Path) -> None:
    import hashlib

    entry = write_shard_file(str(tmp_path), 5, 3, random_rows(0, 64))
    raw = file_path(tmp_path, 5, shard_file_name(3)).read_bytes()
    assert entry.name == "shard-3.arrow"
    assert entry.size_bytes == len(raw)
    # sha256 over the sha256 of each 16 MiB chunk (one here), as core.checkpoint.checksum says.
    assert entry.checksum == "sha256c16:" + hashlib.sha256(hashlib.sha256(raw).digest()).hexdigest()


def test_non_contiguous_and_empty_shards_round_trip(tmp_path: Path) -> None:
    base = random_rows(3, 40, dim=16)
    strided = ShardRows(base.tables[::2], base.rows[::2], base.weights[::2, ::2], base.momentum[::2])
    empty = ShardRows(
        np.empty(0, np.int32), np.empty(0, np.int64), np.empty((0, 5), np.float32), np.empty(0, np.float32)
    )
    uri = str(tmp_path)
    store = CheckpointStore(uri)
    store.commit(1, [write_shard_file(uri, 1, 0, strided), write_shard_file(uri, 1, 1, empty)])
    assert_rows_equal(store.read_shard(1, 0), strided)
    assert_rows_equal(store.read_shard(1, 1), empty)


def test_shard_rows_rejects_wrong_dtype() -> None:
    rows = random_rows(0, 4)
    with pytest.raises(ValueError, match="weights"):
        ShardRows(rows.tables, rows.rows, rows.weights.astype(np.float64), rows.momentum)
    with pytest.raises(ValueError, match="lengths"):
        ShardRows(rows.tables, rows.rows[:3], rows.weights, rows.momentum)


# ----------------------------------------------------------------------------- manifest


def test_checkpoint_without_manifest_does_not_exist(tmp_path: Path) -> None:
    uri = str(tmp_path)
    store = CheckpointStore(uri)
    save_and_commit(store, 1)
    save(uri, 2)  # every file written, never committed

    assert store.list_committed() == [1]
    assert store.latest_valid().step == 1
    with pytest.raises(CheckpointNotFound):
        store.verify(2)
    with pytest.raises(CheckpointNotFound):
        store.read_shard(2, 0)
    assert store.restore_chain(0)[0] == [1]


def test_manifest_is_written_last(tmp_path: Path) -> None:
    uri = str(tmp_path)
    entries = save(uri, 7)
    store = CheckpointStore(uri)
    store.commit(7, entries)
    directory = tmp_path / step_dir_name(7)
    manifest_ns = (directory / MANIFEST_FILE).stat().st_mtime_ns
    assert all(manifest_ns >= p.stat().st_mtime_ns for p in directory.iterdir())
    assert sorted(p.name for p in directory.iterdir()) == sorted([MANIFEST_FILE] + [e.name for e in entries])


def test_commit_refuses_missing_or_wrong_size_files(tmp_path: Path) -> None:
    uri = str(tmp_path)
    store = CheckpointStore(uri)
    entries = save(uri, 3)
    missing = FileEntry("shard-9.arrow", 10, "sha256:00")
    with pytest.raises(CheckpointCorrupt, match="shard-9.arrow"):
        store.commit(3, [*entries, missing])
    wrong_size = FileEntry(entries[0].name, entries[0].size_bytes + 1, entries[0].checksum)
    with pytest.raises(CheckpointCorrupt, match=entries[0].name):
        store.commit(3, [wrong_size, *entries[1:]])
    assert not file_path(tmp_path, 3, MANIFEST_FILE).exists()
    assert store.list_committed() == []


def test_committed_checkpoint_cannot_be_rewritten(tmp_path: Path) -> None:
    uri = str(tmp_path)
    store = CheckpointStore(uri)
    save_and_commit(store, 4)
    with pytest.raises(FileExistsError):
        write_shard_file(uri, 4, 0, random_rows(9, 10))
    with pytest.raises(FileExistsError):
        store.commit(4, [])
    store.verify(4)


def test_incremental_needs_committed_full_base(tmp_path: Path) -> None:
    store = CheckpointStore(str(tmp_path))
    with pytest.raises(CheckpointNotFound):
        store.commit(20, save(store.uri, 20), kind=INCREMENTAL, base_step=10)
    with pytest.raises(ValueError):
        store.commit(20, save(store.uri, 20), kind=INCREMENTAL)


# ----------------------------------------------------------------------------- corruption


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_corrupt_newest_falls_back_to_previous(tmp_path: Path, damage: str, caplog) -> None:
    store = CheckpointStore(str(tmp_path), keep_last=5)
    save_and_commit(store, 10)
    save_and_commit(store, 20)
    victim = file_path(tmp_path, 20, shard_file_name(1))
    if damage == "flip":
        flip_byte(victim)
    elif damage == "truncate":
        victim.write_bytes(victim.read_bytes()[:-10])
    else:
        victim.unlink()

    with pytest.raises(CheckpointCorrupt, match=r"shard-1\.arrow") as excinfo:
        store.verify(20)
    if damage == "flip":
        assert "checksum" in str(excinfo.value) and "expected sha256c16:" in str(excinfo.value)
    elif damage == "truncate":
        entry = store.info(20).files["shard-1.arrow"]
        assert f"{entry.size_bytes - 10} bytes, expected {entry.size_bytes}" in str(excinfo.value)
    else:
        assert "missing" in str(excinfo.value)
    with pytest.raises(CheckpointCorrupt, match=r"shard-1\.arrow"):
        store.read_shard(20, 1)
    assert_rows_equal(store.read_shard(20, 0), random_rows(2000, 50))  # the intact shard still reads

    with caplog.at_level(logging.WARNING):
        assert store.latest_valid().step == 10
    assert [step for step, _ in store.fallbacks] == [20]
    assert "shard-1.arrow" in store.fallbacks[0][1]
    assert "checkpoint step 20 is corrupt" in caplog.text and "falling back to step 10" in caplog.text


def test_corrupt_blob_and_manifest_are_detected(tmp_path: Path) -> None:
    store = CheckpointStore(str(tmp_path), keep_last=5)
    for step in (1, 2, 3):
        save_and_commit(store, step)
    flip_byte(file_path(tmp_path, 3, DENSE_FILE), offset=0)
    file_path(tmp_path, 2, MANIFEST_FILE).write_text('{"format": 1, "step": 2')  # torn write

    with pytest.raises(CheckpointCorrupt, match=DENSE_FILE):
        store.read_blob(3, DENSE_FILE)
    with pytest.raises(CheckpointCorrupt, match=MANIFEST_FILE):
        store.verify(2)
    assert store.latest_valid().step == 1
    assert [step for step, _ in store.fallbacks] == [3, 2]


def test_latest_valid_none_when_all_corrupt(tmp_path: Path) -> None:
    store = CheckpointStore(str(tmp_path))
    assert store.latest_valid() is None
    save_and_commit(store, 1)
    flip_byte(file_path(tmp_path, 1, shard_file_name(0)))
    assert store.latest_valid() is None
    with pytest.raises(CheckpointNotFound):
        store.restore_chain(0)


def test_latest_valid_filters_kind(tmp_path: Path) -> None:
    store = CheckpointStore(str(tmp_path))
    save_and_commit(store, 10)
    save_and_commit(store, 20, kind=INCREMENTAL, base_step=10)
    assert store.latest_valid().step == 20
    assert store.latest_valid(kind=FULL).step == 10


# ----------------------------------------------------------------------------- retention


def test_keeps_last_full_checkpoints(tmp_path: Path) -> None:
    store = CheckpointStore(str(tmp_path), keep_last=2)
    for step in (1, 2, 3, 4, 5):
        save_and_commit(store, step)
    assert store.list_committed() == [4, 5]
    assert sorted(p.name for p in tmp_path.iterdir()) == [step_dir_name(4), step_dir_name(5)]


def test_gc_returns_deleted_steps(tmp_path: Path) -> None:
    uri = str(tmp_path)
    writer = CheckpointStore(uri, keep_last=10)
    for step in (1, 2, 3):
        save_and_commit(writer, step)
    assert CheckpointStore(uri, keep_last=1).gc() == [1, 2]
    assert writer.list_committed() == [3]


def test_newest_valid_survives_newer_corrupt_ones(tmp_path: Path) -> None:
    uri = str(tmp_path)
    writer = CheckpointStore(uri, keep_last=10)
    for step in (1, 2, 3, 4):
        save_and_commit(writer, step)
    flip_byte(file_path(tmp_path, 3, shard_file_name(0)))
    file_path(tmp_path, 4, DENSE_FILE).unlink()

    store = CheckpointStore(uri, keep_last=2)
    assert store.gc() == [1]
    assert store.list_committed() == [2, 3, 4]
    assert store.latest_valid().step == 2


def test_incrementals_of_kept_fulls_survive(tmp_path: Path) -> None:
    store = CheckpointStore(str(tmp_path), keep_last=2)
    save_and_commit(store, 10)
    save_and_commit(store, 15, kind=INCREMENTAL, base_step=10)
    save_and_commit(store, 20)
    save_and_commit(store, 25, kind=INCREMENTAL, base_step=20)
    save_and_commit(store, 30)
    save_and_commit(store, 35, kind=INCREMENTAL, base_step=30)
    assert store.list_committed() == [20, 25, 30, 35]
    save_and_commit(store, 40)
    assert store.list_committed() == [30, 35, 40]


def test_incrementals_of_deleted_fulls_go_with_them(tmp_path: Path) -> None:
    uri = str(tmp_path)
    writer = CheckpointStore(uri, keep_last=10)
    save_and_commit(writer, 10)
    save_and_commit(writer, 20)
    save_and_commit(writer, 25, kind=INCREMENTAL, base_step=10)  # newer than 20, yet builds on 10
    save_and_commit(writer, 30)
    assert CheckpointStore(uri, keep_last=2).gc() == [10, 25]
    assert writer.list_committed() == [20, 30]


def test_orphan_directories(tmp_path: Path) -> None:
    uri = str(tmp_path)
    store = CheckpointStore(uri, keep_last=3)
    save(uri, 5)  # crashed save, older than what gets committed
    save_and_commit(store, 10)
    save(uri, 15)  # a save in progress
    assert store.gc() == []  # the orphan went with the commit of step 10
    assert not (tmp_path / step_dir_name(5)).exists()
    assert (tmp_path / step_dir_name(15)).exists()
    (tmp_path / "unrelated").mkdir()
    save_and_commit(store, 20)
    assert not (tmp_path / step_dir_name(15)).exists()  # now older than the newest committed
    assert (tmp_path / "unrelated").exists()


# ----------------------------------------------------------------------------- restore


def shard_rows(tables: list[int], rows: list[int], fill: list[float]) -> ShardRows:
    n = len(rows)
    return ShardRows(
        tables=np.array(tables, np.int32),
        rows=np.array(rows, np.int64),
        weights=np.repeat(np.array(fill, np.float32)[:, None], 4, axis=1) + np.arange(4, dtype=np.float32),
        momentum=np.array(fill, np.float32) / 10,
    )


def commit_rows(store: CheckpointStore, step: int, rows: ShardRows, **kwargs) -> None:
    entries = [
        write_shard_file(store.uri, step, 0, rows),
        write_blob(store.uri, step, DENSE_FILE, b"d"),
    ]
    store.commit(step, entries, **kwargs)


@pytest.fixture
def chain_store(tmp_path: Path) -> CheckpointStore:
    store = CheckpointStore(str(tmp_path), keep_last=3)
    commit_rows(store, 10, shard_rows([0, 0, 0, 1, 1], [0, 1, 2, 0, 5], [1, 2, 3, 4, 5]))
    commit_rows(store, 20, shard_rows([0, 1], [1, 7], [20, 21]), kind=INCREMENTAL, base_step=10)
    commit_rows(store, 30, shard_rows([1, 0, 1], [0, 1, 7], [30, 31, 32]), kind=INCREMENTAL, base_step=10)
    return store


def test_restore_chain_applies_incrementals_in_order(chain_store: CheckpointStore) -> None:
    steps, merged = chain_store.restore_chain(0)
    assert steps == [10, 20, 30]
    # (table, row) -> value by hand: 10 gives 1..5, 20 overrides (0,1) and adds (1,7),
    # 30 overrides (1,0), (0,1), (1,7).
    expected = shard_rows([0, 0, 0, 1, 1, 1], [0, 1, 2, 0, 5, 7], [1, 31, 3, 30, 5, 32])
    assert_rows_equal(merged, expected)


def test_restore_chain_upto_step(chain_store: CheckpointStore) -> None:
    steps, merged = chain_store.restore_chain(0, upto_step=25)
    assert steps == [10, 20]
    assert_rows_equal(merged, shard_rows([0, 0, 0, 1, 1, 1], [0, 1, 2, 0, 5, 7], [1, 20, 3, 4, 5, 21]))


def test_corrupt_incremental_stops_the_chain(chain_store: CheckpointStore, tmp_path: Path, caplog) -> None:
    flip_byte(file_path(tmp_path, 20, shard_file_name(0)))
    with caplog.at_level(logging.WARNING):
        steps, merged = chain_store.restore_chain(0)
    # 30 is intact but holds only the rows changed since 20, so it is not applied without 20.
    assert steps == [10]
    assert_rows_equal(merged, shard_rows([0, 0, 0, 1, 1], [0, 1, 2, 0, 5], [1, 2, 3, 4, 5]))
    assert [step for step, _ in chain_store.fallbacks] == [20]
    assert "checkpoint step 20 is corrupt" in caplog.text and "falling back to step 10" in caplog.text


def test_corrupt_full_falls_back_to_older_chain(tmp_path: Path) -> None:
    store = CheckpointStore(str(tmp_path), keep_last=3)
    commit_rows(store, 10, shard_rows([0], [0], [1]))
    commit_rows(store, 15, shard_rows([0], [0], [2]), kind=INCREMENTAL, base_step=10)
    commit_rows(store, 20, shard_rows([0], [0], [3]))
    commit_rows(store, 25, shard_rows([0], [0], [4]), kind=INCREMENTAL, base_step=20)
    flip_byte(file_path(tmp_path, 20, shard_file_name(0)))
    steps, merged = store.restore_chain(0)
    assert steps == [10, 15]
    assert_rows_equal(merged, shard_rows([0], [0], [2]))


def test_gc_keeps_chain_of_newest_valid_state(tmp_path: Path) -> None:
    uri = str(tmp_path)
    writer = CheckpointStore(uri, keep_last=10)
    commit_rows(writer, 10, shard_rows([0], [0], [1]))
    commit_rows(writer, 15, shard_rows([0], [0], [2]), kind=INCREMENTAL, base_step=10)
    commit_rows(writer, 20, shard_rows([0], [0], [3]))
    commit_rows(writer, 30, shard_rows([0], [0], [4]))
    flip_byte(file_path(tmp_path, 20, shard_file_name(0)))
    flip_byte(file_path(tmp_path, 30, shard_file_name(0)))

    # 20 is corrupt and older than the kept full 30; 10 and 15 are the newest valid state.
    assert CheckpointStore(uri, keep_last=1).gc() == [20]
    assert writer.list_committed() == [10, 15, 30]
    assert writer.restore_chain(0)[0] == [10, 15]


@pytest.mark.parametrize("name", ["../../etc/passwd", "/etc/passwd", "..", "a/../../b", "x\\..\\y", "nul\0"])
def test_crafted_manifest_file_names_make_the_checkpoint_corrupt(tmp_path: Path, name: str) -> None:
    # A manifest that names a file outside its checkpoint directory is refused like a corrupt
    # checkpoint: never opened, and restores fall back to the previous valid one.
    store = CheckpointStore(str(tmp_path), keep_last=5)
    for step in (1, 2):
        save_and_commit(store, step)
    outside = tmp_path / "secret"
    outside.write_bytes(b"not yours")
    manifest = json.loads(file_path(tmp_path, 2, MANIFEST_FILE).read_text())
    manifest["files"][name] = {"size_bytes": outside.stat().st_size, "checksum": "sha256:" + "0" * 64}
    file_path(tmp_path, 2, MANIFEST_FILE).write_text(json.dumps(manifest))

    with pytest.raises(CheckpointCorrupt, match="unsafe file name"):
        store.info(2)
    assert store.chain_steps() == [1]
    assert store.fallbacks and store.fallbacks[-1][0] == 2


def test_a_chain_read_while_a_rollback_fences_stops_before_the_fenced_step(chain_store: CheckpointStore, monkeypatch) -> None:
    # Seen in the soak: a replacement trainer asked for the chain while a rollback fenced
    # step 20; the listing still held it, reading its manifest raised CheckpointNotFound.
    listed = chain_store.list_committed()
    chain_store.fence_after(10)
    monkeypatch.setattr(chain_store, "list_committed", lambda: listed)
    assert chain_store.chain_steps() == [10]


# ----------------------------------------------------------------------------- one shard's chain


def test_shard_chain_reads_and_verifies_only_that_shards_files(tmp_path: Path) -> None:
    store = CheckpointStore(str(tmp_path), keep_last=10)
    save_and_commit(store, 10)
    store.commit(20, save(store.uri, 20), kind=INCREMENTAL, base_step=10)
    # Another shard's file and the dense blob of the full are corrupt: a rollback of
    # everything must refuse step 10, the recovery of shard 0 alone need not.
    flip_byte(file_path(tmp_path, 10, shard_file_name(1)))
    flip_byte(file_path(tmp_path, 10, DENSE_FILE))
    assert store.chain_steps() == []
    steps, parts = CheckpointStore(str(tmp_path)).shard_chain(0)
    assert steps == [10, 20]
    assert_rows_equal(parts[0], store.read_shard(10, 0))
    assert_rows_equal(parts[1], store.read_shard(20, 0))
    # The manifests alone name the same chain, reading no data file.
    assert store.chain_candidates() == [10, 20]


def test_shard_chain_falls_back_past_its_own_corrupt_files(tmp_path: Path, caplog) -> None:
    store = CheckpointStore(str(tmp_path), keep_last=10)
    save_and_commit(store, 10)
    save_and_commit(store, 30)
    store.commit(40, save(store.uri, 40), kind=INCREMENTAL, base_step=30)
    flip_byte(file_path(tmp_path, 30, shard_file_name(0)))
    fresh = CheckpointStore(str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="core.checkpoint"):
        steps, parts = fresh.shard_chain(0)
    # Its full of step 30 is corrupt: the incremental built on it is unusable too.
    assert steps == [10] and len(parts) == 1
    assert [s for s, _ in fresh.fallbacks] == [30]
    assert "falling back to step 10" in caplog.text
    # Shard 1's files are intact: its chain is the newest.
    assert CheckpointStore(str(tmp_path)).shard_chain(1)[0] == [30, 40]
    # Bounded by the chain the supervisor chose; nothing valid at all gives an empty chain.
    assert fresh.shard_chain(1, upto_step=30)[0] == [30]
    flip_byte(file_path(tmp_path, 10, shard_file_name(0)))
    assert CheckpointStore(str(tmp_path)).shard_chain(0) == ([], [])


def test_an_audited_store_keeps_what_a_rollback_fences_aside_for_the_replay(tmp_path: Path) -> None:
    """With ``keep_fenced`` (``audit_log``) a fenced checkpoint moves to ``fenced/`` with its
    manifest: no reader of the store sees it, and ``cpr verify --replay`` finds it (a load of
    the abandoned timeline read it); without, it is deleted."""
    from verify.store import Store

    for keep in (True, False):
        root = tmp_path / str(keep)
        store = CheckpointStore(str(root), keep_last=10, keep_fenced=keep)
        save_and_commit(store, 10)
        save_and_commit(store, 20)
        assert store.fence_after(10) == [20]
        assert store.list_committed() == [10] and Store(str(root)).committed() == [10]
        fenced = Store(str(root)).fenced()
        if not keep:
            assert fenced == {} and not (root / "fenced").exists()
            continue
        [(committed, fenced_at, directory)] = fenced[20]
        assert committed <= fenced_at and Path(directory, "shard-0.arrow").exists()
        assert json.loads(Path(directory, MANIFEST_FILE).read_text())["step"] == 20
