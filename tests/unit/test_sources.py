"""Input URIs and globs (core.data.sources), files cut into chunks (core.data.chunks), the
frequency-thresholded vocabulary (core.store.vocab) and the store built from them in one
process (app.dataprep with LocalEngine): local files, no Ray."""

from __future__ import annotations

import glob
import gzip
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pytest

from app.dataengines import LocalEngine
from app.dataprep import build_stores, resolve_data, with_table_rows
from core.config import config_from_dict
from core.data import CriteoReader, generate
from core.data.chunks import plan_chunks
from core.data.sources import InputFile, _glob, check_distinct, child_uri, resolve_inputs
from core.errors import ConfigError, DataFormatError
from core.store import MicrobatchStore, Vocabulary
from core.store.vocab import IdCounter, frequent_values

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def tsv(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("src")
    return Path(generate(str(out), 3_000, 200, fmt="tsv", seed=4, vocab_rows=300).train_path)


def test_globs_match_in_name_order_and_across_directories(tmp_path):
    for name in ("day_10", "day_2", "day_1", "other", "sub/day_3"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("x")
    names = [Path(f.name).relative_to(tmp_path).as_posix() for f in resolve_inputs([f"{tmp_path}/day_*"], "data.train")]
    assert names == ["day_1", "day_10", "day_2"]  # sorted by name; a subdirectory is not matched by *
    deep = resolve_inputs([f"{tmp_path}/**/day_?"], "data.train")
    assert [Path(f.name).relative_to(tmp_path).as_posix() for f in deep] == ["day_1", "day_2", "sub/day_3"]
    listed = resolve_inputs([str(tmp_path / "other"), f"{tmp_path}/day_1"], "data.eval")
    assert [Path(f.name).name for f in listed] == ["other", "day_1"] and listed[0].size == 1


def _tree(root: Path, *names: str) -> None:
    for name in names:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text("x")


def _matched(root: Path, pattern: str, field: str = "data.train") -> list[str]:
    return [Path(f.name).relative_to(root).as_posix() for f in resolve_inputs([f"{root}/{pattern}"], field)]


_TREE = ("gl/a.tsv", "gl/b.txt", "gl/x/b.tsv", "gl/x/y/c.tsv", "gl/x/a/deep/b.tsv", "gl/x/ab.tsv", "gl/d/x/y.tsv",
         "gl/xqy.tsv", "gl/.a.tsv", "gl/._x.tsv", "gl/.ipynb_checkpoints/a.tsv", "gl/s/.h/d.tsv", "gl/e[1].tsv",
         "gl/e1.tsv", "gl/f]1.tsv")


def test_a_double_star_segment_matches_zero_or_more_directories(tmp_path):
    _tree(tmp_path, *_TREE)
    assert _matched(tmp_path, "gl/**/*.tsv")[:4] == ["gl/a.tsv", "gl/d/x/y.tsv", "gl/e1.tsv", "gl/e[1].tsv"]
    assert "gl/b.txt" in _matched(tmp_path, "gl/**") and "gl/x/y/c.tsv" in _matched(tmp_path, "gl/**")
    assert _matched(tmp_path, "**/y/c.tsv") == ["gl/x/y/c.tsv"]


def test_wildcards_and_sets_never_cross_a_slash(tmp_path):
    _tree(tmp_path, *_TREE)
    assert _matched(tmp_path, "gl/**/a*.tsv") == ["gl/a.tsv", "gl/x/ab.tsv"]  # not gl/x/a/deep/b.tsv
    assert _matched(tmp_path, "gl/**/x?y.tsv") == ["gl/xqy.tsv"]  # not gl/d/x/y.tsv
    assert _matched(tmp_path, "gl/**/x[!a]y.tsv") == ["gl/xqy.tsv"]
    assert _matched(tmp_path, "gl/*.tsv") == ["gl/a.tsv", "gl/e1.tsv", "gl/e[1].tsv", "gl/f]1.tsv", "gl/xqy.tsv"]


def test_hidden_names_are_matched_only_by_a_segment_that_starts_with_a_dot(tmp_path):
    _tree(tmp_path, *_TREE)
    everything = _matched(tmp_path, "**/*.tsv")
    assert not any("/." in name for name in everything) and "gl/x/y/c.tsv" in everything
    assert _matched(tmp_path, "gl/.*.tsv") == ["gl/._x.tsv", "gl/.a.tsv"]
    assert _matched(tmp_path, "gl/.ipynb_checkpoints/*") == ["gl/.ipynb_checkpoints/a.tsv"]
    assert _matched(tmp_path, "gl/s/.*/*.tsv") == ["gl/s/.h/d.tsv"]
    with pytest.raises(ConfigError, match="matches no file"):
        _matched(tmp_path, "gl/[.]a.tsv")


def test_a_literal_bracket_is_written_as_a_set_and_a_miss_says_how(tmp_path):
    _tree(tmp_path, *_TREE)
    assert _matched(tmp_path, "gl/e[[]1].tsv") == ["gl/e[1].tsv"]
    assert _matched(tmp_path, "gl/e[1].tsv") == ["gl/e1.tsv"]
    assert _matched(tmp_path, glob.escape("gl/e[1]") + "*") == ["gl/e[1].tsv"]
    assert _matched(tmp_path, "gl/f]*") == ["gl/f]1.tsv"]
    with pytest.raises(ConfigError) as info:
        _matched(tmp_path, "gl/g[1].tsv")
    assert str(info.value) == (f"data.train: {tmp_path}/gl/g[1].tsv matches no file "
                               "(a [...] is a set of characters; a literal [ is written [[])")


@pytest.mark.parametrize("pattern", ["gl/**/*.tsv", "gl/**", "**/*.tsv", "**", "gl/*/*", "gl/**/x?y.tsv",
                                     "gl/**/.*", "gl/.*/*", "gl/*[!t]", "gl/[a-e]*", "gl/e[[]1].tsv", "gl/**/**/b.tsv",
                                     "gl/x/**/", "gl/[]]*", "gl/[!]]*", "gl/e[1", "gl/[z-a]*"])
def test_globs_match_what_pythons_glob_matches(tmp_path, pattern):
    _tree(tmp_path, *_TREE)
    want = sorted({p for p in glob.glob(f"{tmp_path}/{pattern}", recursive=True) if os.path.isfile(p)})  # '**/**' repeats
    if not want:
        with pytest.raises(ConfigError, match="matches no file"):
            resolve_inputs([f"{tmp_path}/{pattern}"], "data.train")
    else:
        assert [f.name for f in resolve_inputs([f"{tmp_path}/{pattern}"], "data.train")] == want


def test_object_store_paths_glob_as_local_ones():
    from pyarrow.fs import _MockFileSystem  # an object store without a server: bucket/key paths, no leading /

    fs = _MockFileSystem()
    for key in ("gl/a.tsv", "gl/x/b.tsv", "gl/.h/c.tsv", "gl/._d.tsv", "gl/e[1].tsv"):
        fs.create_dir(f"bucket/{key}".rsplit("/", 1)[0])
        with fs.open_output_stream(f"bucket/{key}") as out:
            out.write(b"x")
    paths = lambda pattern: [i.path for i in _glob(fs, pattern, f"s3://{pattern}?endpoint_override=h:1", "data.train")]
    assert paths("bucket/gl/**/*.tsv") == ["bucket/gl/a.tsv", "bucket/gl/e[1].tsv", "bucket/gl/x/b.tsv"]
    assert paths("bucket/gl/*[[]*") == ["bucket/gl/e[1].tsv"]
    assert paths("bucket/gl/.*") == ["bucket/gl/._d.tsv"]
    with pytest.raises(ConfigError) as info:
        paths("bucket/gl/*/*.csv")
    assert str(info.value) == "data.train: s3://bucket/gl/*/*.csv matches no file"


def _named(tmp_path: Path, field_uris: list[str]) -> list[InputFile]:
    return resolve_inputs([f"{tmp_path}/{u}" for u in field_uris], "data.x")


@pytest.mark.parametrize("train, eval_, said", [
    (["gen/a.tsv", "gen/a.tsv"], ["gen/eval.tsv"],
     "data.train: {t}/gen/a.tsv is named twice in data.train: a file is read once; name it once"),
    (["gen/a.tsv"], ["gen/eval.tsv", "gen/../gen/eval.tsv"],
     "data.eval: {t}/gen/eval.tsv is named twice in data.eval: a file is read once; name it once"),
    (["gen/*.tsv"], ["gen/eval.tsv"],
     "data.eval: {t}/gen/eval.tsv is also in data.train (matched by {t}/gen/*.tsv): a file is read once, as "
     "training or as evaluation data; narrow the glob"),
    (["gen/a.tsv"], ["other/link.tsv"],
     "data.eval: {t}/other/link.tsv is also in data.train, as {t}/gen/a.tsv (one file): a file is read once, as "
     "training or as evaluation data; name it in one of them"),
    (["gen/*.tsv", "gen/a*"], ["gen/eval.tsv"],
     "data.train: {t}/gen/a.tsv is named twice in data.train (matched by {t}/gen/*.tsv, then by {t}/gen/a*): "
     "a file is read once; narrow the glob"),
    (["gen/a.tsv"], ["gen/e*.tsv", "other/link.tsv"],
     "data.eval: {t}/other/link.tsv is also in data.train, as {t}/gen/a.tsv (one file): a file is read once, as "
     "training or as evaluation data; name it in one of them"),
])
def test_a_file_named_twice_is_refused_in_one_line(tmp_path, train, eval_, said):
    _tree(tmp_path, "gen/a.tsv", "gen/eval.tsv")
    (tmp_path / "other").mkdir()
    (tmp_path / "other/link.tsv").symlink_to(tmp_path / "gen/a.tsv")
    with pytest.raises(ConfigError) as info:
        check_distinct(_named(tmp_path, train), _named(tmp_path, eval_))
    assert str(info.value) == said.format(t=tmp_path)


def test_distinct_inputs_pass_and_object_store_files_are_told_apart_by_bucket_and_key(tmp_path):
    _tree(tmp_path, "gen/a.tsv", "gen/b.tsv", "gen/eval.tsv")
    check_distinct(_named(tmp_path, ["gen/[ab].tsv"]), _named(tmp_path, ["gen/eval.tsv"]))
    s3 = lambda key, opts="": InputFile(f"s3://b/{key}{opts}", f"s3://b/{key}", 1, 0)
    check_distinct([s3("x/a.tsv")], [s3("x/b.tsv"), s3("y/a.tsv"), InputFile("gs://b/x/a.tsv", "gs://b/x/a.tsv", 1, 0)])
    with pytest.raises(ConfigError, match=r"^data.eval: s3://b/x/a.tsv is also in data.train: a file is read once"):
        check_distinct([s3("x/a.tsv")], [s3("x/a.tsv", "?endpoint_override=h:1")])


@pytest.mark.parametrize("uri, said", [
    ("missing.tsv", "missing.tsv does not exist"),
    ("day_*.tsv", "day_*.tsv matches no file"),
    ("adir", "adir is a directory; name its files or a glob such as"),
    ("nope://bucket/x", "data.train: cannot open nope://bucket/x"),
    ("nope://bucket/x?k=v", "data.train: cannot open nope://bucket/x"),
])
def test_inputs_that_cannot_be_read_are_refused_naming_field_and_uri(tmp_path, uri, said):
    (tmp_path / "adir").mkdir()
    target = uri if "://" in uri else str(tmp_path / uri)
    with pytest.raises(ConfigError) as info:
        resolve_inputs([target], "data.train")
    assert str(info.value).startswith("data.train: ") and said.split(" ", 1)[1] in str(info.value), str(info.value)
    assert "k=v" not in str(info.value) and "\n" not in str(info.value)


def test_a_run_with_a_missing_input_stops_before_anything_starts(tmp_path):
    cfg = config_from_dict({"run_dir": str(tmp_path / "run"),
                            "data": {"train": [str(tmp_path / "t_*.tsv")], "eval": [str(tmp_path / "e.tsv")]}})
    with pytest.raises(ConfigError, match=r"^data.train: .*/t_\*.tsv matches no file$"):
        resolve_data(cfg)
    (tmp_path / "t_1.tsv").write_text("")
    with pytest.raises(ConfigError, match=r"^data.eval: .*/e.tsv does not exist$"):
        resolve_data(cfg)


@pytest.mark.parametrize("chunk_bytes", [997, 40_000, 10**9])
def test_chunks_hold_every_line_once_in_order(tsv, chunk_bytes):
    files = resolve_inputs([str(tsv)], "data.train")
    chunks = plan_chunks(files, chunk_bytes)
    assert len(chunks) == max(1, -(-files[0].size // chunk_bytes))
    whole = list(CriteoReader([str(tsv)]))
    parts = [b for c in chunks for b in CriteoReader([c])]
    for field in ("labels", "dense", "sparse"):
        assert np.array_equal(np.concatenate([getattr(b, field) for b in parts]),
                              np.concatenate([getattr(b, field) for b in whole]))


def test_a_malformed_line_in_a_later_chunk_names_the_files_line(tmp_path, tsv):
    lines = tsv.read_text().splitlines(keepends=True)
    bad = tmp_path / "bad.tsv"
    bad.write_text("".join(lines[:2500] + ["0\tnot a record\n"] + lines[2500:]))
    chunks = plan_chunks(resolve_inputs([str(bad)], "data.train"), 50_000)
    assert len(chunks) > 5
    with pytest.raises(DataFormatError) as info:
        for c in chunks:
            list(CriteoReader([c]))
    assert (info.value.path, info.value.line) == (str(bad), 2501)


def test_gzip_and_parquet_files_are_one_chunk_each(tmp_path, tsv):
    gz = tmp_path / "a.tsv.gz"
    gz.write_bytes(gzip.compress(tsv.read_bytes()))
    chunks = plan_chunks(resolve_inputs([str(gz), str(tsv)], "data.train"), 50_000)
    assert chunks[0].whole and chunks[0].file.compression == "gzip" and len(chunks) > 2


def test_the_vocabulary_keeps_values_seen_min_count_times_and_shares_row_zero(tmp_path):
    counter = IdCounter()
    sparse = np.zeros((10, 26), dtype=np.uint32)
    sparse[:, 0] = [7, 7, 7, 9, 9, 5, 5, 5, 5, 1]
    counter(sparse[:6])
    counter(sparse[6:])  # counts add up over batches and chunks
    path = str(tmp_path / "counts.arrow")
    counter.write(pafs.LocalFileSystem(), path)
    assert list(frequent_values([path, path], 0, 3)) == [5, 7, 9]  # two chunks: 9 seen 4 times
    kept = [frequent_values([path], f, 3) for f in range(26)]
    vocab = Vocabulary(kept)
    assert list(kept[0]) == [5, 7] and vocab.table_rows[0] == 3 and vocab.table_rows[1] == 2  # 0 seen 10 times
    rows = vocab.map_ids(np.array([[5] + [0] * 25, [7] + [0] * 25, [9] + [1] * 25, [123] + [0] * 25], dtype=np.uint32))
    assert list(rows[:, 0]) == [1, 2, 0, 0] and list(rows[:, 1]) == [1, 1, 0, 1]
    again = Vocabulary.from_table(vocab.to_table())
    assert all(np.array_equal(a, b) for a, b in zip(again.values, vocab.values))


def test_a_vocabulary_run_gets_its_tables_from_the_data(tmp_path, tsv):
    eval_ = tsv.parent / "eval.tsv"
    raw = {"run_dir": str(tmp_path / "run"),
           "data": {"train": [str(tsv)], "eval": [str(eval_)], "mapping": "vocab", "min_count": 2, "chunk_mb": 1},
           "model": {"table_rows": 777}, "training": {"microbatch_rows": 64}}
    cfg = config_from_dict(raw)
    data = build_stores(cfg, resolve_data(cfg), LocalEngine())
    rows = data["table_rows"]
    assert len(rows) == 26 and all(1 <= r < 300 for r in rows)  # 300 distinct values per feature at most
    assert Path(data["train"].vocab_uri).exists() and Path(data["train"].vocab_uri).name == "vocab.arrow" and data["train"].mapping["kind"] == "vocab"
    store = MicrobatchStore(data["eval"].uri)
    assert all((store.get(i)[2] < np.array(rows)).all() for i in range(len(store)))
    assert with_table_rows(cfg, rows).model.rows_per_table == rows
    hashed = config_from_dict({**raw, "data": {**raw["data"], "mapping": "hash"}})
    assert with_table_rows(hashed, rows) is hashed


def test_child_uris_keep_their_options():
    assert child_uri("s3://b/x?endpoint_override=h:1", "train-1") == "s3://b/x/train-1?endpoint_override=h:1"
    assert child_uri("/tmp/a/", "b") == "/tmp/a/b"


def test_the_store_goes_beside_object_store_checkpoints_unless_named():
    base = {"run_dir": "/tmp/runs/r", "data": {"train": ["t"], "eval": ["e"]}}
    assert config_from_dict(base).cache_dir == "/tmp/runs/cache"  # shared by the runs under /tmp/runs
    remote = {**base, "checkpoint": {"storage": "s3://b/runs/x/checkpoints?endpoint_override=h:9&scheme=http"}}
    assert config_from_dict(remote).cache_dir == "s3://b/runs/x/cache?endpoint_override=h:9&scheme=http"
    named = {**remote, "data": {**base["data"], "cache_dir": "gs://c/store"}}
    assert config_from_dict(named).cache_dir == "gs://c/store"
    local_ckpt = {**base, "checkpoint": {"storage": "/mnt/nfs/ckpt"}}
    assert config_from_dict(local_ckpt).cache_dir == "/tmp/runs/cache"


def test_a_label_column_of_strings_of_other_lengths_is_not_taken_for_labels():
    """Parquet labels as strings: '' and '10' are malformed even when the bytes add up."""
    from core.data.criteo import _parse_labels

    labels, bad = _parse_labels(pa.array(["", "10", "1", "0"]))
    assert list(bad) == [True, True, False, False] and list(labels[2:]) == [1.0, 0.0]


def test_compressed_and_file_uri_inputs_read_as_plain_ones(tmp_path, tsv):
    import bz2

    packed = tmp_path / "day_0.bz2"
    packed.write_bytes(bz2.compress(tsv.read_bytes()))
    (file,) = resolve_inputs([f"file://{packed}"], "data.train")
    assert file.compression == "bz2" and plan_chunks([file], 1000) == plan_chunks([file], 10**9)
    assert sum(b.num_rows for b in CriteoReader([file])) == 3_000
    cfg = config_from_dict({"run_dir": str(tmp_path / "run"),
                            "data": {"train": [f"file://{packed}"], "eval": [f"file://{tsv}"]}})
    assert [f.name for f in resolve_data(cfg).train] == [str(packed)]


def test_another_chunk_size_makes_another_store(tmp_path, tsv):
    raw = {"run_dir": str(tmp_path / "run"), "data": {"train": [str(tsv)], "eval": [str(tsv.parent / "eval.tsv")], "chunk_mb": 1,
                                                      "cache_dir": str(tmp_path / "cache")},
           "model": {"table_rows": 500}, "training": {"microbatch_rows": 100}}
    first = build_stores(config_from_dict(raw), resolve_data(config_from_dict(raw)), LocalEngine())
    raw["data"]["chunk_mb"] = 2
    second = build_stores(config_from_dict(raw), resolve_data(config_from_dict(raw)), LocalEngine())
    assert first["train"].uri != second["train"].uri and not second["train"].reused


def test_a_vocabulary_too_small_for_row_wise_shards_says_what_to_change(tmp_path):
    cfg = config_from_dict({"run_dir": str(tmp_path / "run"), "data": {"train": ["t"], "eval": ["e"], "mapping": "vocab"},
                            "embeddings": {"num_shards": 4, "sharding": "row_wise"}})
    rows = [100] * 26
    rows[8] = 3
    with pytest.raises(ConfigError, match=r"table C9 3 rows .* fewer than embeddings.num_shards=4 .* table_wise"):
        with_table_rows(cfg, rows)


def test_credentials_written_into_a_uri_are_never_shown():
    from core.data.sources import shown

    assert shown("s3://AKIAX:SeCrEt@bkt/a/b.tsv?endpoint_override=h:1&scheme=http") == "s3://bkt/a/b.tsv"
    assert shown("/local/p?x.tsv") == "/local/p?x.tsv"
    with pytest.raises(ConfigError) as refused:
        resolve_inputs(["s3://AKIAX:SeCrEt@bkt/a.tsv?endpoint_override=127.0.0.1:9&scheme=http"
                        "&connect_timeout=0.2&request_timeout=0.2"], "data.train")
    assert "SeCrEt" not in str(refused.value) and "AKIAX" not in str(refused.value), str(refused.value)
