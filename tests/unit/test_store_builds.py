"""A store is what its inputs are: built into a directory of its own, published by its
manifest, reused only for the same bytes (cheaply: size, time and the ends of each file;
fully with data.verify_data), removed when its build fails; and a checkpoint's data position
names the store, so that --resume refuses other data. The product's own build, without Ray
(LocalEngine); tests/integration/test_data_store.py runs builds and readers in processes of
their own, at once."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from app.dataengines import LocalEngine
from app.dataprep import build_stores, prepare_data, resolve_data
from core.checkpoint.position import DataPosition, other_data
from core.config import config_from_dict
from core.data import generate
from core.errors import DataFormatError, InsufficientData
from core.store import MicrobatchStore, read_manifest
from core.store.identity import EDGE_BYTES
from core.store import reader as store_reader

ROWS = 32


def _config(base: Path, train: list[str], eval_: list[str], **data) -> object:
    return config_from_dict({
        "run_dir": str(base / "run"), "seed": 1,
        "data": {"train": train, "eval": eval_, "cache_dir": str(base / "cache"), **data},
        "model": {"table_rows": 1000},
        "training": {"microbatch_rows": ROWS, "microbatches_per_step": 2, "epochs": 1},
    })


@pytest.fixture
def data(tmp_path) -> dict:
    g = generate(str(tmp_path / "gen"), 2_000, 300, fmt="tsv", seed=3, vocab_rows=500)
    return {"base": tmp_path, "train": g.train_path, "eval": g.eval_path}


def _labels(uri: str) -> np.ndarray:
    store = MicrobatchStore(uri)
    return np.concatenate([store.get(i)[0] for i in range(len(store))])


def _builds(cache: Path) -> list[str]:
    return sorted(p.name for p in cache.glob("*/b-*"))


def _rewrite_keeping_size_and_time(path: str, at: int) -> None:
    """Flips the label of the line that starts at or after byte ``at`` (0 <-> 1), keeping the
    file's size and modification time (as ``cp -p`` or ``rsync -a`` leave a rewritten file)."""
    st = os.stat(path)
    raw = bytearray(Path(path).read_bytes())
    start = raw.index(b"\n", at) + 1
    raw[start] = ord("1") if raw[start] == ord("0") else ord("0")
    Path(path).write_bytes(bytes(raw))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(path).st_size == st.st_size


def test_a_store_is_built_into_a_directory_of_its_own_and_reused(data):
    cfg = _config(data["base"], [data["train"]], [data["eval"]])
    first = prepare_data(cfg, LocalEngine())
    again = prepare_data(cfg, LocalEngine())
    assert not first["train"].reused and again["train"].reused and again["eval"].reused
    # the run reads its build, by the build's own manifest; the store's manifest publishes it
    build, store = Path(first["train"].uri), Path(first["train"].uri).parent
    assert build.name.startswith("b-") and again["train"].uri == first["train"].uri
    own, published = read_manifest(str(build)), read_manifest(str(store))
    assert own.dir == published.dir == build.name and own.content == published.content == first["train"].content
    assert [p["file"] for p in published.parts] == [f"{build.name}/{p['file']}" for p in own.parts]
    assert [c["file"] for c in own.chunks] == [data["train"]] and len(own.chunks[0]["digest"]) == 32
    assert len(_builds(data["base"] / "cache")) == 2  # train and eval, one build each


def test_a_change_at_either_end_with_size_and_time_kept_makes_another_store(data):
    cfg = _config(data["base"], [data["train"]], [data["eval"]])
    before = prepare_data(cfg, LocalEngine())["train"]
    _rewrite_keeping_size_and_time(data["train"], 10)
    after = prepare_data(cfg, LocalEngine())["train"]
    assert after.key != before.key and not after.reused
    assert not np.array_equal(_labels(after.uri), _labels(before.uri))


def test_a_change_in_the_middle_is_found_by_verify_data_and_the_store_rebuilt(data, caplog):
    size = os.path.getsize(data["train"])
    assert size > 3 * EDGE_BYTES
    cfg = _config(data["base"], [data["train"]], [data["eval"]])
    before = prepare_data(cfg, LocalEngine())["train"]
    old_labels = _labels(before.uri)
    _rewrite_keeping_size_and_time(data["train"], size // 2)
    # the cheap check cannot see it: same name, size, time and ends
    assert prepare_data(cfg, LocalEngine())["train"].reused
    checked = prepare_data(_config(data["base"], [data["train"]], [data["eval"]], verify_data=True), LocalEngine())
    assert not checked["train"].reused and checked["train"].key == before.key
    assert f"{data['train']}: its bytes changed" in caplog.text
    new_labels = _labels(checked["train"].uri)
    assert (new_labels != old_labels).sum() == 1 and checked["train"].content != before.content
    # the stale build stays for the runs that started on it (a day), each reading its own build
    assert np.array_equal(_labels(before.uri), old_labels)
    assert read_manifest(str(Path(before.uri).parent)).replaced[0]["dir"] == Path(before.uri).name
    assert prepare_data(_config(data["base"], [data["train"]], [data["eval"]], verify_data=True),
                        LocalEngine())["train"].reused


def test_a_failed_build_leaves_nothing_behind(data):
    bad = data["base"] / "bad.tsv"
    lines = Path(data["train"]).read_text().splitlines(keepends=True)
    bad.write_text("".join(lines[:1500]) + "2" + lines[1500][1:] + "".join(lines[1501:]))
    cfg = _config(data["base"], [str(bad)], [data["eval"]])
    with pytest.raises(DataFormatError, match=r"bad.tsv:1501"):
        prepare_data(cfg, LocalEngine())
    assert not (data["base"] / "cache").exists()  # the store's and the cache's directories, empty, too
    # a cache that holds other stores keeps them
    prepare_data(_config(data["base"], [data["train"]], [data["eval"]]), LocalEngine())
    kept = sorted(p.name for p in (data["base"] / "cache").iterdir())
    with pytest.raises(DataFormatError):
        prepare_data(cfg, LocalEngine())
    assert sorted(p.name for p in (data["base"] / "cache").iterdir()) == kept


def test_a_build_that_died_is_removed_by_the_next(data):
    cfg = _config(data["base"], [data["train"]], [data["eval"]])
    built = prepare_data(cfg, LocalEngine())["train"]
    dead = Path(built.uri).parent / "b-deadbeef0000"
    dead.mkdir()
    (dead / "part-00000.arrow").write_bytes(b"half")
    prepare_data(cfg, LocalEngine())
    assert not dead.exists()


def test_the_reader_keeps_a_bounded_number_of_parts_open(data, monkeypatch):
    lines = Path(data["train"]).read_text().splitlines(keepends=True)
    files = []
    for k in range(4):  # a part each
        f = data["base"] / f"day{k}.tsv"
        f.write_text("".join(lines[k * 500:(k + 1) * 500]))
        files.append(str(f))
    uri = prepare_data(_config(data["base"], files, [data["eval"]]), LocalEngine())["train"].uri
    monkeypatch.setattr(store_reader, "OPEN_PARTS", 2)
    store = MicrobatchStore(uri)
    assert len(store.manifest.parts) >= 4
    first = [store.get(i)[0] for i in range(len(store))]
    for i in reversed(range(len(store))):
        assert np.array_equal(store.get(i)[0], first[i])
        assert len(store._files) <= 2
    fds = len(os.listdir("/proc/self/fd"))
    for i in range(len(store)):
        store.get(i)
    assert len(os.listdir("/proc/self/fd")) <= fds  # parts closed as others open


def test_resume_refuses_a_checkpoint_of_other_data_naming_the_file(data):
    cfg = _config(data["base"], [data["train"]], [data["eval"]])
    inputs = resolve_data(cfg)
    before = build_stores(cfg, inputs, LocalEngine())["train"]
    with open(data["train"], "a") as f:
        f.write(Path(data["train"]).read_text().splitlines(keepends=True)[0])
    after = build_stores(cfg, resolve_data(cfg), LocalEngine())["train"]

    def position(info) -> DataPosition:
        return DataPosition(next_step=5, microbatches_per_step=2, microbatch_rows=ROWS, num_microbatches=62, seed=1,
                            samples_trained=320, store_key=info.key, inputs=tuple(info.inputs))

    assert other_data(position(before), position(before), 5) is None
    why = other_data(position(before), position(after), 5)
    assert why.startswith("--resume: the training data changed since checkpoint step 5")
    assert f"{data['train']}: size" in why
    legacy = DataPosition(5, 2, ROWS, 62, 1, 320)  # a checkpoint older than the key in its position
    assert other_data(legacy, position(after), 5) is None


def test_resume_goes_on_over_touched_files_and_stops_on_other_bytes_under_the_same_key(data):
    cfg = _config(data["base"], [data["train"]], [data["eval"]])
    first = build_stores(cfg, resolve_data(cfg), LocalEngine())["train"]

    def position(info, content: str = "") -> DataPosition:
        return DataPosition(5, 2, ROWS, 62, 1, 320, store_key=info.key, inputs=tuple(info.inputs), content=content)

    st = os.stat(data["train"])
    os.utime(data["train"], ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # touched: the same bytes
    touched = build_stores(cfg, resolve_data(cfg), LocalEngine())["train"]
    assert touched.key != first.key and touched.content == first.content
    assert other_data(position(first, first.content), position(touched), 5) is None  # the driver: wait for it
    assert other_data(position(first, first.content), position(touched, touched.content), 5) is None
    # other bytes in the middle, size and time kept, found by verify_data: the same key, another content
    _rewrite_keeping_size_and_time(data["train"], os.path.getsize(data["train"]) // 2)
    rebuilt = prepare_data(_config(data["base"], [data["train"]], [data["eval"]], verify_data=True),
                           LocalEngine())["train"]
    assert rebuilt.key == touched.key and rebuilt.content != touched.content
    why = other_data(position(touched, touched.content), position(rebuilt, rebuilt.content), 5)
    assert why.startswith("--resume: the training data changed since checkpoint step 5 (their bytes changed)")


def test_a_vocabulary_store_built_again_makes_its_evaluation_store_again(data):
    """Its ids are rows of the training store's vocabulary: a training store built again from
    other bytes under the same key (data.verify_data) has another, and so another evaluation store."""
    cfg = _config(data["base"], [data["train"]], [data["eval"]], mapping="vocab", min_count=2, verify_data=True)
    before = prepare_data(cfg, LocalEngine())
    _rewrite_keeping_size_and_time(data["train"], os.path.getsize(data["train"]) // 2)
    after = prepare_data(cfg, LocalEngine())
    assert after["train"].key == before["train"].key and after["train"].content != before["train"].content
    assert not after["eval"].reused and after["eval"].key != before["eval"].key
    assert after["eval"].vocab_uri is None and Path(after["train"].vocab_uri).parent == Path(after["train"].uri)
    assert prepare_data(cfg, LocalEngine())["eval"].reused


def test_a_failed_build_keeps_a_cache_directory_it_did_not_make(data):
    bad = data["base"] / "empty.tsv"
    bad.write_text("")
    (data["base"] / "cache").mkdir()
    with pytest.raises(InsufficientData):
        prepare_data(_config(data["base"], [str(bad)], [data["eval"]]), LocalEngine())
    assert (data["base"] / "cache").is_dir() and not list((data["base"] / "cache").iterdir())


def test_a_manifest_of_another_version_is_replaced_and_its_builds_kept(data):
    cfg = _config(data["base"], [data["train"]], [data["eval"]])
    first = prepare_data(cfg, LocalEngine())["train"]
    store = Path(first.uri).parent
    raw = json.loads((store / "store.json").read_text())
    (store / "store.json").write_text(json.dumps({**raw, "version": 99}))
    again = prepare_data(cfg, LocalEngine())["train"]
    assert not again.reused and again.uri != first.uri
    assert Path(first.uri).is_dir() and np.array_equal(_labels(first.uri), _labels(again.uri))
    assert [r["dir"] for r in read_manifest(str(store)).replaced] == [Path(first.uri).name]
    assert prepare_data(cfg, LocalEngine())["train"].reused and Path(first.uri).is_dir()
