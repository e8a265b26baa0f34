"""Manifests and data positions a writer never produces make their checkpoint corrupt: a
checksum naming another hash algorithm or malformed, a save_index that is not a count, a
data position missing keys. Every reader then falls back as for any corrupt checkpoint."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from core.checkpoint import (
    DATA_POSITION_FILE,
    DENSE_FILE,
    MANIFEST_FILE,
    CheckpointStore,
    DataPosition,
    ShardRows,
    read_position,
    shard_file_name,
    step_dir_name,
    write_blob,
    write_shard_file,
)
from core.errors import CheckpointCorrupt

pytestmark = pytest.mark.timeout(60)

POSITION = DataPosition(
    next_step=3, microbatches_per_step=4, microbatch_rows=64, num_microbatches=100, seed=7, samples_trained=768
)


def rows(seed: int) -> ShardRows:
    rng = np.random.default_rng(seed)
    return ShardRows(
        tables=rng.integers(0, 3, 20, dtype=np.int32),
        rows=rng.choice(200, 20, replace=False).astype(np.int64),
        weights=rng.standard_normal((20, 4), dtype=np.float32),
        momentum=rng.random(20, dtype=np.float32),
    )


def commit(store: CheckpointStore, step: int, position: bytes | None = None, **kwargs) -> None:
    entries = [write_shard_file(store.uri, step, k, rows(step * 10 + k)) for k in range(2)]
    entries.append(write_blob(store.uri, step, DENSE_FILE, f"dense-{step}".encode()))
    position = POSITION.to_json() if position is None else position
    entries.append(write_blob(store.uri, step, DATA_POSITION_FILE, position))
    store.commit(step, entries, **kwargs)


def path_of(root: Path, step: int, name: str) -> Path:
    return root / step_dir_name(step) / name


def rewrite_manifest(root: Path, step: int, edit) -> None:
    manifest = json.loads(path_of(root, step, MANIFEST_FILE).read_text())
    edit(manifest)
    path_of(root, step, MANIFEST_FILE).write_text(json.dumps(manifest))


@pytest.fixture
def two_steps(tmp_path: Path) -> tuple[CheckpointStore, Path]:
    writer = CheckpointStore(str(tmp_path), keep_last=5)
    commit(writer, 1)
    commit(writer, 2)
    return writer, tmp_path


def assert_step_2_refused_everywhere(root: Path, match: str) -> None:
    store = CheckpointStore(str(root), keep_last=5)  # fresh: nothing trusted
    with pytest.raises(CheckpointCorrupt, match=match):
        store.info(2)
    with pytest.raises(CheckpointCorrupt, match=match):
        store.verify(2)
    with pytest.raises(CheckpointCorrupt, match=match):
        store.read_shard(2, 0)
    with pytest.raises(CheckpointCorrupt, match=match):
        store.read_blob(2, DENSE_FILE)
    assert store.chain_steps() == [1]
    assert store.verified_chain() == [1]
    assert store.shard_chain(0)[0] == [1]
    assert store.latest_valid().step == 1
    # skipped as a full, and (its manifest unreadable, so maybe an incremental) ending the chain
    assert {step for step, _ in store.fallbacks} == {2}
    assert len(set(store.fallbacks)) == len(store.fallbacks) == 2
    assert store.gc() == []  # left for inspection, like any corrupt checkpoint


# ----------------------------------------------------------------------------- checksums


def _digest(raw: bytes, algo: str) -> str:
    """The checksum of ``raw`` as the manifest's docs define it, computed here on its own:
    ``<algo>`` over the whole file, ``<algo>c<M>`` over the digests of its M MiB chunks."""
    base, _, mib = algo.partition("c") if algo[-1].isdigit() and "c" in algo else (algo, "", "")
    if not mib:
        return hashlib.new(algo, raw).hexdigest()
    size = int(mib) << 20
    chunks = [raw[i: i + size] for i in range(0, max(len(raw), 1), size)]
    return hashlib.new(base, b"".join(hashlib.new(base, c).digest() for c in chunks)).hexdigest()


def _checksums(root: Path, step: int, algo: str) -> dict[str, str]:
    names = [shard_file_name(0), shard_file_name(1), DENSE_FILE, DATA_POSITION_FILE]
    return {n: f"{algo}:{_digest(path_of(root, step, n).read_bytes(), algo)}" for n in names}


@pytest.mark.parametrize(
    "crafted",
    [
        "shake_128:" + "ab" * 32,  # hexdigest() of a shake needs a length: a TypeError once
        "md5:{md5}",  # the right digest, of an algorithm no writer of ours uses
        "sha256",
        "sha256:{sha256_upper}",
        "sha256:{sha256_short}",
        "sha256:" + "g" * 64,
        ":" + "0" * 64,
        "sha256c0:" + "0" * 64,  # chunks of no bytes
        "sha256c2048:" + "0" * 64,  # chunks larger than any writer's
        "sha256cx:" + "0" * 64,
        "sha256c16:{sha256_short}",
    ],
)
def test_a_checksum_of_an_unknown_algorithm_or_malformed_makes_the_checkpoint_corrupt(two_steps, crafted: str) -> None:
    _, root = two_steps
    raw = path_of(root, 2, shard_file_name(0)).read_bytes()
    sha256 = hashlib.sha256(raw).hexdigest()
    checksum = crafted.format(md5=hashlib.md5(raw).hexdigest(), sha256_upper=sha256.upper(), sha256_short=sha256[:-1])

    def edit(manifest: dict) -> None:
        manifest["files"][shard_file_name(0)]["checksum"] = checksum

    rewrite_manifest(root, 2, edit)
    assert_step_2_refused_everywhere(root, "checksum")
    with pytest.raises(CheckpointCorrupt) as info:
        CheckpointStore(str(root)).info(2)
    assert f"step 2: {MANIFEST_FILE}: file {shard_file_name(0)} has checksum {checksum!r}" in str(info.value)


def test_a_shake_checksum_falls_back_instead_of_raising_type_error(two_steps) -> None:
    # shake_* is in hashlib.algorithms_available, and its hexdigest() needs a length: once a
    # TypeError out of verify, chain_steps and gc, past every corruption handler.
    _, root = two_steps

    def edit(manifest: dict) -> None:
        manifest["files"][DENSE_FILE]["checksum"] = "shake_128:" + "00" * 32

    rewrite_manifest(root, 2, edit)
    store = CheckpointStore(str(root), keep_last=1)
    assert store.chain_steps() == [1]
    with pytest.raises(CheckpointCorrupt, match="shake_128"):
        store.verify(2)
    assert store.gc() == []


@pytest.mark.parametrize("algo", ["sha256", "sha512", "blake2b", "sha256c1", "blake2bc4"])
def test_checksums_of_the_other_allowed_algorithms_verify(two_steps, algo: str) -> None:
    """Whole-file sha256 (what every checkpoint written before chunked sums has) and the other
    algorithms, whole or chunked, verify; a changed byte is found."""
    _, root = two_steps
    checksums = _checksums(root, 2, algo)

    def edit(manifest: dict) -> None:
        for name, checksum in checksums.items():
            manifest["files"][name]["checksum"] = checksum

    rewrite_manifest(root, 2, edit)
    store = CheckpointStore(str(root))
    assert store.verify(2).files[DENSE_FILE].checksum == checksums[DENSE_FILE]
    assert store.read_blob(2, DENSE_FILE) == b"dense-2"
    assert store.chain_steps() == [2]
    path_of(root, 2, DENSE_FILE).write_bytes(b"dense-X")  # same size, other bytes
    with pytest.raises(CheckpointCorrupt, match=f"expected {algo}:"):
        CheckpointStore(str(root)).verify(2)


def test_commit_refuses_a_checksum_its_readers_would_refuse(tmp_path: Path) -> None:
    store = CheckpointStore(str(tmp_path))
    entry = write_blob(store.uri, 1, DENSE_FILE, b"d")
    crafted = type(entry)(entry.name, entry.size_bytes, "shake_128:" + "00" * 16)
    with pytest.raises(ValueError, match="shake_128"):
        store.commit(1, [crafted])
    assert store.list_committed() == []


# ----------------------------------------------------------------------------- save_index


@pytest.mark.parametrize("value", [-1, "3", 2.5, True, None, [1]])
def test_a_save_index_that_is_no_count_makes_the_checkpoint_corrupt(two_steps, value) -> None:
    _, root = two_steps

    def edit(manifest: dict) -> None:
        manifest["meta"]["save_index"] = value

    rewrite_manifest(root, 2, edit)
    assert_step_2_refused_everywhere(root, "save_index")
    with pytest.raises(CheckpointCorrupt) as info:
        CheckpointStore(str(root)).info(2)
    assert f"{MANIFEST_FILE} has save_index {value!r}, expected an integer >= 0" in str(info.value)


def test_a_save_index_that_is_a_count_or_absent_is_fine(tmp_path: Path) -> None:
    store = CheckpointStore(str(tmp_path), keep_last=5)
    commit(store, 1)
    commit(store, 2, meta={"save_index": 0})
    commit(store, 3, meta={"save_index": 41, "run_id": "r"})
    fresh = CheckpointStore(str(tmp_path))
    assert [fresh.verify(s).meta.get("save_index") for s in (1, 2, 3)] == [None, 0, 41]


def test_commit_refuses_a_negative_save_index(tmp_path: Path) -> None:
    store = CheckpointStore(str(tmp_path))
    entry = write_blob(store.uri, 1, DENSE_FILE, b"d")
    with pytest.raises(ValueError, match="save_index -1"):
        store.commit(1, [entry], meta={"save_index": -1})
    assert store.list_committed() == []


# ----------------------------------------------------------------------------- data position


def test_data_position_round_trips(tmp_path: Path) -> None:
    store = CheckpointStore(str(tmp_path))
    commit(store, 3)
    assert read_position(CheckpointStore(str(tmp_path)), 3) == POSITION
    # The layout the supervisor always wrote, and the training store's key and inputs since issue 42.
    assert json.loads(POSITION.to_json()) == {
        "next_step": 3, "microbatches_per_step": 4, "microbatch_rows": 64, "num_microbatches": 100, "seed": 7,
        "samples_trained": 768, "store_key": "", "inputs": [], "content": "",
    }
    # A position written before them still reads (its run resumes without the data check).
    legacy = {k: v for k, v in json.loads(POSITION.to_json()).items() if k not in ("store_key", "inputs", "content")}
    assert DataPosition(**legacy) == POSITION


def test_data_position_tolerates_extra_keys(tmp_path: Path) -> None:
    store = CheckpointStore(str(tmp_path))
    commit(store, 3, position=json.dumps({**json.loads(POSITION.to_json()), "epoch": 1}).encode())
    assert read_position(store, 3) == POSITION


def _position_with(**changes) -> bytes:
    document = json.loads(POSITION.to_json())
    for key, value in changes.items():
        if value is _DROP:
            del document[key]
        else:
            document[key] = value
    return json.dumps(document).encode()


_DROP = object()


@pytest.mark.parametrize(
    ("payload", "problem"),
    [
        (_position_with(seed=_DROP), "lacks seed"),
        (_position_with(seed=_DROP, next_step=_DROP), "lacks next_step, seed"),
        (_position_with(num_microbatches="100"), "num_microbatches = '100', expected an integer >= 0"),
        (_position_with(microbatch_rows=64.0), "microbatch_rows = 64.0, expected an integer >= 0"),
        (_position_with(next_step=True), "next_step = True, expected an integer >= 0"),
        (_position_with(samples_trained=None), "samples_trained = None, expected an integer >= 0"),
        (_position_with(samples_trained=-768), "samples_trained = -768, expected an integer >= 0"),
        (b'{"next_step": 3', "is not JSON"),
        (b"\xff\xfe", "is not JSON"),
        (b"[3, 4]", "holds a JSON list, expected an object"),
    ],
)
def test_a_bad_data_position_is_a_corrupt_checkpoint(tmp_path: Path, payload: bytes, problem: str) -> None:
    store = CheckpointStore(str(tmp_path))
    commit(store, 3, position=payload)
    with pytest.raises(CheckpointCorrupt) as info:
        read_position(store, 3)
    assert str(info.value).startswith(f"checkpoint step 3: file {DATA_POSITION_FILE} ")
    assert problem in str(info.value)


def test_a_data_position_whose_bytes_changed_fails_its_checksum(tmp_path: Path) -> None:
    store = CheckpointStore(str(tmp_path))
    commit(store, 3)
    position_path = path_of(tmp_path, 3, DATA_POSITION_FILE)
    position_path.write_bytes(position_path.read_bytes().replace(b'"seed": 7', b'"seed": 8'))
    with pytest.raises(CheckpointCorrupt, match=f"{DATA_POSITION_FILE} has checksum"):
        read_position(store, 3)


def test_a_chunked_checksum_is_the_same_streamed_or_verified_in_parallel() -> None:
    """Writers hash a file as it streams out in pieces of any size; readers hash its chunks
    on several threads: both give the checksum the format defines (``_digest``)."""
    from core.checkpoint.checksum import checksum_of, new_hasher

    rng = np.random.default_rng(3)
    for size in (0, 1, (1 << 20) - 1, 1 << 20, 3 * (1 << 20) + 17):
        raw = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
        hasher = new_hasher("sha256c1")
        pos = 0
        while pos < size:
            step = int(rng.integers(1, 700_000))
            hasher.update(raw[pos: pos + step])
            pos += step
        expected = _digest(raw, "sha256c1")
        assert hasher.hexdigest() == expected
        assert checksum_of(raw, "sha256c1", workers=3) == f"sha256c1:{expected}"
        assert checksum_of(raw, "sha256c1", workers=1) == f"sha256c1:{expected}"
