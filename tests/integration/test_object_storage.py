"""Data in object storage, through a real S3 API (moto on 127.0.0.1, ``tests/s3_server.py``):
inputs named by ``s3://`` URIs and globs, the refusals that name them, malformed lines that
name the object and the line, and the microbatch store built on Ray Data into S3 holding
exactly what a store built in one process from local files holds.
"""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
import pytest

from app.dataengines import LocalEngine
from app.dataprep import build_stores, resolve_data
from core.config import config_from_dict
from core.data import generate
from core.data.reader import CriteoReader
from core.data.sources import resolve_inputs
from core.errors import ConfigError, DataFormatError
from core.store import MicrobatchStore

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def days(tmp_path_factory, s3):
    """Three 'days' of Criteo data (TSV, TSV, gzip TSV) and a held-out file, locally and in S3."""
    out = tmp_path_factory.mktemp("days")
    local = []
    for day in range(3):
        summary = generate(str(out / f"g{day}"), 6_000, 1_500, fmt="tsv", seed=10 + day, vocab_rows=800)
        path = out / (f"day_{day}.gz" if day == 2 else f"day_{day}")
        raw = Path(summary.train_path).read_bytes()
        path.write_bytes(gzip.compress(raw) if day == 2 else raw)
        local.append(path)
    held_out = out / "g0" / "eval.tsv"
    for path in local:
        s3.upload(path, f"cpr/criteo/{path.name}")
    s3.upload(held_out, "cpr/criteo/eval/eval.tsv")
    return {"local": local, "eval": held_out}


def _config(tmp_path: Path, train: list[str], eval_: list[str], cache: str, **data) -> object:
    return config_from_dict({
        "run_dir": str(tmp_path / "run"),
        "data": {"train": train, "eval": eval_, "cache_dir": cache, "chunk_mb": 1, **data},
        "model": {"table_rows": 5_000}, "training": {"microbatch_rows": 128},
    })


def test_s3_uris_and_globs_resolve_and_bad_ones_are_refused_by_name(s3, days):
    files = resolve_inputs([s3.uri("cpr/criteo/day_*")], "data.train")
    assert [f.name for f in files] == [f"s3://cpr/criteo/day_{d}" + (".gz" if d == 2 else "") for d in range(3)]
    assert [f.size for f in files] == [p.stat().st_size for p in days["local"]]
    assert all("endpoint_override=" in f.uri for f in files)  # any process can open them again
    for glob, days_matched in (("day_?", [0, 1]), ("day_[12]*", [1, 2])):  # '?' is a glob here, not options
        matched = resolve_inputs([s3.uri(f"cpr/criteo/{glob}")], "data.train")
        assert [f.name.split("day_")[1][:1] for f in matched] == [str(d) for d in days_matched], glob
    for uri, said in ((s3.uri("cpr/criteo/day_9"), "s3://cpr/criteo/day_9 does not exist"),
                      (s3.uri("cpr/criteo/week_*"), "s3://cpr/criteo/week_* matches no file"),
                      (s3.uri("nobucket/x"), "s3://nobucket/x")):
        with pytest.raises(ConfigError) as info:
            resolve_inputs([uri], "data.train")
        assert str(info.value).startswith("data.train: ") and said in str(info.value), str(info.value)
        assert "endpoint_override" not in str(info.value)


def test_keys_that_a_uri_would_misread_are_taken_literally(s3, days):
    s3.upload(days["local"][0], "cpr/odd/a%41 b#1.tsv")
    (found,) = resolve_inputs([s3.uri("cpr/odd/*")], "data.train")
    assert found.name == "s3://cpr/odd/a%41 b#1.tsv"
    assert sum(b.num_rows for b in CriteoReader([found])) == 6_000


def test_a_malformed_line_in_an_object_names_its_uri_and_line(s3, days, tmp_path):
    lines = days["local"][0].read_text().splitlines(keepends=True)
    bad = tmp_path / "bad"
    bad.write_text("".join(lines[:4321] + ["1\t2\t3\n"] + lines[4321:]))
    uri = s3.upload(bad, "cpr/bad/day_0")
    with pytest.raises(DataFormatError) as info:
        list(CriteoReader(resolve_inputs([uri], "data.train")))
    assert (info.value.path, info.value.line) == ("s3://cpr/bad/day_0", 4322)
    # skipped instead: counted, and the other rows all kept
    reader = CriteoReader(resolve_inputs([uri], "data.train"), skip_bad_lines=True)
    assert sum(b.num_rows for b in reader) == len(lines) and reader.bad_lines == 1


def _microbatches(uri: str) -> list[tuple[np.ndarray, ...]]:
    store = MicrobatchStore(uri)
    return [store.get(i) for i in range(len(store))]


def test_ray_data_builds_the_store_in_s3_as_one_process_does_from_local_files(ray_local, s3, days, tmp_path):
    """Every input, the store and the vocabulary in S3, preprocessed by Ray Data tasks: the
    same microbatches, ids and table sizes as the one-process build of the local files. (The
    hash mapping on Ray Data into S3: the cluster test in test_multinode.py.)"""
    mapping = "vocab"
    remote = _config(tmp_path, [s3.uri("cpr/criteo/day_*")], [s3.uri("cpr/criteo/eval/*.tsv")],
                     s3.uri(f"cpr/stores/{tmp_path.name}"), mapping=mapping)
    local = _config(tmp_path, [str(p) for p in days["local"]], [str(days["eval"])], str(tmp_path / "cache"),
                    mapping=mapping)
    built = build_stores(remote, resolve_data(remote))
    expected = build_stores(local, resolve_data(local), LocalEngine())
    assert built["table_rows"] == expected["table_rows"]
    assert max(built["table_rows"]) < 5_000  # the vocabulary's sizes, not model.table_rows
    assert built["train"].build["engine"] == "Ray Data" and built["train"].build["chunks"] > 3  # files were cut
    for name in ("train", "eval"):
        got, want = _microbatches(built[name].uri), _microbatches(expected[name].uri)
        assert len(got) == len(want) == built[name].microbatches
        for g, w in zip(got, want):
            assert all(np.array_equal(a, b) for a, b in zip(g, w))
    assert built["train"].uri.startswith("s3://cpr/stores/")
    again = build_stores(remote, resolve_data(remote))
    assert again["train"].reused and again["eval"].reused


def test_builds_of_one_store_in_s3_at_once_publish_one_store(s3, days, tmp_path):
    """Object storage has no lock and no rename: three builds of one store, at once, each
    write a directory of their own and the first manifest is the store; a build that finds it
    published removes its own files, and every build reads the same microbatches. (Two builds
    whose checks fall between each other's check and write both publish, the last one wins;
    the other's directory is left, named by no manifest.)"""
    from concurrent.futures import ThreadPoolExecutor

    import pyarrow.fs as pafs

    cache = s3.uri(f"cpr/stores/race-{tmp_path.name}")
    cfg = _config(tmp_path, [s3.uri("cpr/criteo/day_0")], [s3.uri("cpr/criteo/eval/*.tsv")], cache)
    inputs = resolve_data(cfg)
    with ThreadPoolExecutor(3) as pool:
        built = list(pool.map(lambda _: build_stores(cfg, inputs, LocalEngine()), range(3)))
    # each reads a build of the one store (the same one, but where two published at once)
    assert len({b["train"].uri.rsplit("/", 1)[0] for b in built}) == 1
    reference = _microbatches(built[0]["train"].uri)
    assert len(reference) == built[0]["train"].microbatches > 0
    for b in built[1:]:
        assert all(np.array_equal(x, y) for g, w in zip(_microbatches(b["train"].uri), reference)
                   for x, y in zip(g, w))
    store_path = built[0]["train"].uri.split("://")[1].split("?")[0].rsplit("/", 1)[0]  # the build's parent
    builds = [i.base_name for i in s3.filesystem().get_file_info(pafs.FileSelector(store_path))
              if i.type == pafs.FileType.Directory]
    assert 1 <= len(builds) <= 3 and MicrobatchStore(built[0]["train"].uri).manifest.dir in builds
