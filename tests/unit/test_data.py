"""Tests of core.data: the Criteo reader (formats, exact error lines, skipping) and the
synthetic data generator (layout, determinism, skew, known ceiling AUC)."""

from __future__ import annotations

import gc
import gzip
import json
import math
import os
import pickle
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from core.data import (
    COLUMNS,
    NUM_DENSE,
    NUM_SPARSE,
    CriteoReader,
    RawBatch,
    auc,
    generate,
    preprocess_dense,
    sparse_to_rows,
)
from app.dataengines import LocalEngine
from app.dataprep import build_stores, resolve_data
from core.config import config_from_dict
from core.errors import ConfigError, DataFormatError, InsufficientData

pytestmark = pytest.mark.timeout(60)

ROWS = 2000
EVAL_ROWS = 500


def read_all(paths, batch_rows: int = 512, skip_bad_lines: bool = False) -> tuple[RawBatch, list[int], CriteoReader]:
    reader = CriteoReader([str(p) for p in paths], batch_rows=batch_rows, skip_bad_lines=skip_bad_lines)
    batches = list(reader)
    merged = RawBatch(
        np.concatenate([b.labels for b in batches]) if batches else np.zeros(0, np.float32),
        np.concatenate([b.dense for b in batches]) if batches else np.zeros((0, NUM_DENSE), np.float32),
        np.concatenate([b.sparse for b in batches]) if batches else np.zeros((0, NUM_SPARSE), np.uint32),
    )
    return merged, [b.num_rows for b in batches], reader


def line(label: str = "0", ints: list[str] | None = None, cats: list[str] | None = None) -> str:
    ints = ints if ints is not None else [str(i) for i in range(NUM_DENSE)]
    cats = cats if cats is not None else [f"{0xA0000000 + f:08x}" for f in range(NUM_SPARSE)]
    return "\t".join([label, *ints, *cats])


def numbered_lines(count: int) -> list[str]:
    """Valid lines whose I1 is their own 1-based line number, so returned rows can be traced."""
    return [line(label=str(n % 2), ints=[str(n)] + ["1"] * (NUM_DENSE - 1)) for n in range(1, count + 1)]


def write_tsv(path: Path, lines: list[str]) -> Path:
    data = ("\n".join(lines) + "\n").encode()
    if path.suffix == ".gz":
        path.write_bytes(gzip.compress(data, mtime=0))
    else:
        path.write_bytes(data)
    return path


def line_numbers_read(batch: RawBatch) -> list[int]:
    """The I1 markers of ``numbered_lines`` back from preprocessed dense values."""
    return [int(round(math.expm1(float(v)))) for v in batch.dense[:, 0]]


@pytest.fixture(scope="module")
def generated(tmp_path_factory) -> dict:
    out = {}
    for fmt in ("tsv", "tsv.gz", "parquet"):
        d = tmp_path_factory.mktemp(fmt.replace(".", "_"))
        out[fmt] = generate(str(d), ROWS, EVAL_ROWS, fmt=fmt, seed=7, vocab_rows=1000, chunk_rows=700)
    return out


# --- generated data: formats, layout, determinism ------------------------------------


def test_all_formats_read_back_identically(generated):
    reads = {fmt: read_all([s.train_path]) for fmt, s in generated.items()}
    for fmt, (batch, sizes, _) in reads.items():
        assert batch.num_rows == ROWS, fmt
        assert sizes == [512, 512, 512, ROWS - 3 * 512], fmt
        assert batch.labels.dtype == np.float32 and batch.dense.dtype == np.float32
        assert batch.sparse.dtype == np.uint32 and batch.sparse.shape == (ROWS, NUM_SPARSE)
    ref = reads["tsv"][0]
    for fmt in ("tsv.gz", "parquet"):
        other = reads[fmt][0]
        np.testing.assert_array_equal(other.labels, ref.labels)
        np.testing.assert_array_equal(other.dense, ref.dense)
        np.testing.assert_array_equal(other.sparse, ref.sparse)
    eval_batch, _, _ = read_all([generated["parquet"].eval_path])
    assert eval_batch.num_rows == EVAL_ROWS
    # the compressed file holds exactly the plain file's text
    assert gzip.decompress(Path(generated["tsv.gz"].train_path).read_bytes()) == Path(
        generated["tsv"].train_path
    ).read_bytes()


def test_tsv_has_exact_criteo_layout(generated):
    text = Path(generated["tsv"].train_path).read_text()
    assert text.endswith("\n")
    lines = text[:-1].split("\n")
    assert len(lines) == ROWS  # no header
    empty_ints = empty_cats = negatives = 0
    for ln in lines:
        fields = ln.split("\t")
        assert len(fields) == 40
        assert fields[0] in ("0", "1")
        for v in fields[1 : 1 + NUM_DENSE]:
            assert re.fullmatch(r"-?[0-9]*", v), v
            empty_ints += v == ""
            negatives += v.startswith("-")
        for v in fields[1 + NUM_DENSE :]:
            assert re.fullmatch(r"([0-9a-f]{8})?", v), v
            empty_cats += v == ""
    assert empty_ints > 0 and empty_cats > 0 and negatives > 0


def test_reader_values_match_a_plain_python_parse(generated):
    batch, _, _ = read_all([generated["tsv"].train_path])
    lines = Path(generated["tsv"].train_path).read_text().splitlines()
    for i in range(0, ROWS, 37):
        fields = lines[i].split("\t")
        assert batch.labels[i] == float(fields[0])
        expected_dense = [math.log1p(max(int(v), 0)) if v else 0.0 for v in fields[1 : 1 + NUM_DENSE]]
        np.testing.assert_allclose(batch.dense[i], expected_dense, rtol=1e-6)
        assert batch.sparse[i].tolist() == [int(v, 16) if v else 0 for v in fields[1 + NUM_DENSE :]]


def test_parquet_has_criteo_columns(generated):
    schema = pq.read_schema(generated["parquet"].train_path)
    assert schema.names == list(COLUMNS)
    assert pa.types.is_integer(schema.field("label").type)
    assert all(schema.field(c).type == pa.int64() for c in COLUMNS[1 : 1 + NUM_DENSE])
    assert all(schema.field(c).type == pa.string() for c in COLUMNS[1 + NUM_DENSE :])
    assert pq.read_metadata(generated["parquet"].train_path).num_rows == ROWS


@pytest.mark.parametrize("fmt", ["tsv", "tsv.gz", "parquet"])
def test_generation_is_deterministic(tmp_path, fmt):
    a = generate(str(tmp_path / "a"), 1500, 300, fmt=fmt, seed=11, vocab_rows=5000, chunk_rows=400)
    b = generate(str(tmp_path / "b"), 1500, 300, fmt=fmt, seed=11, vocab_rows=5000, chunk_rows=400)
    c = generate(str(tmp_path / "c"), 1500, 300, fmt=fmt, seed=12, vocab_rows=5000, chunk_rows=400)
    for attr in ("train_path", "eval_path"):
        same = Path(getattr(a, attr)).read_bytes()
        assert same == Path(getattr(b, attr)).read_bytes()
        assert same != Path(getattr(c, attr)).read_bytes()
    assert (a.ceiling_auc, a.positive_rate) == (b.ceiling_auc, b.positive_rate)
    # eval is a different random stream from train, not a copy of its first rows
    train, _, _ = read_all([a.train_path])
    evaluation, _, _ = read_all([a.eval_path])
    assert not np.array_equal(train.sparse[:300], evaluation.sparse)


def test_summary_file_and_ceiling_auc(tmp_path):
    s = generate(str(tmp_path), 5000, 5000, seed=0)
    assert s.train_path == str(tmp_path / "train.tsv") and s.eval_path == str(tmp_path / "eval.tsv")
    assert (s.train_rows, s.eval_rows) == (5000, 5000)
    assert json.loads((tmp_path / "datagen.json").read_text()) == {
        "train_path": s.train_path,
        "eval_path": s.eval_path,
        "train_rows": 5000,
        "eval_rows": 5000,
        "ceiling_auc": s.ceiling_auc,
        "positive_rate": s.positive_rate,
    }
    assert 0.7 < s.ceiling_auc < 0.9
    assert 0.15 < s.positive_rate < 0.4
    labels, _, _ = read_all([s.train_path])
    assert labels.labels.mean() == pytest.approx(s.positive_rate)
    assert not list(tmp_path.glob("*.tmp*"))


def test_ceiling_auc_is_the_rank_auc(tmp_path):
    from torchmetrics.functional.classification import binary_auroc
    import torch

    rng = np.random.default_rng(0)
    scores = rng.integers(0, 20, 500) / 20.0  # many ties
    labels = (rng.random(500) < scores).astype(np.int8)
    expected = binary_auroc(torch.tensor(scores), torch.tensor(labels)).item()
    assert auc(scores, labels) == pytest.approx(expected, abs=1e-6)
    assert auc(np.array([0.1, 0.4, 0.35, 0.8]), np.array([0, 0, 1, 1])) == pytest.approx(0.75)


def test_categorical_values_are_zipf_skewed(tmp_path):
    vocab = 10_000
    s = generate(str(tmp_path), 20_000, 100, fmt="parquet", seed=3, vocab_rows=vocab)
    batch, _, _ = read_all([s.train_path], batch_rows=20_000)
    for f in range(NUM_SPARSE):
        ids = batch.sparse[:, f]
        counts = Counter(ids[ids != 0].tolist())
        top = sum(c for _, c in counts.most_common(vocab // 100))
        assert top / sum(counts.values()) > 0.5, f"feature {f}"
        assert len(counts) > vocab // 10  # a long tail, not a handful of values
        assert (ids == 0).mean() < 0.1


def test_categorical_features_carry_most_of_the_signal(tmp_path):
    """What a model learns from embeddings must matter: per-value click rates from train
    rank eval rows much better than a linear model on the dense features alone."""
    s = generate(str(tmp_path), 20_000, 10_000, fmt="parquet", seed=1, vocab_rows=1000)
    train, _, _ = read_all([s.train_path], batch_rows=20_000)
    evaluation, _, _ = read_all([s.eval_path], batch_rows=20_000)
    prior = train.labels.mean()
    logit = math.log(prior / (1 - prior))
    cat_score = np.zeros(evaluation.num_rows)
    for f in range(NUM_SPARSE):
        ids, inverse = np.unique(np.concatenate([train.sparse[:, f], evaluation.sparse[:, f]]), return_inverse=True)
        clicks = np.bincount(inverse[: train.num_rows], weights=train.labels, minlength=len(ids))
        shows = np.bincount(inverse[: train.num_rows], minlength=len(ids))
        # shrunk towards the prior by 100 pseudo-shows, so rare values add little noise
        value_logit = np.log((clicks + 100 * prior) / (shows - clicks + 100 * (1 - prior))) - logit
        cat_score += value_logit[inverse[train.num_rows :]]
    mean, std = train.dense.mean(0), train.dense.std(0) + 1e-6
    x = (train.dense - mean) / std
    w, b = np.zeros(NUM_DENSE), 0.0
    for _ in range(300):
        p = 1 / (1 + np.exp(-(x @ w + b)))
        w -= 0.5 * x.T @ (p - train.labels) / len(x)
        b -= 0.5 * float(np.mean(p - train.labels))
    dense_auc = auc((evaluation.dense - mean) / std @ w, evaluation.labels)
    cat_auc = auc(cat_score, evaluation.labels)
    assert dense_auc > 0.55  # the dense features do carry some signal
    assert dense_auc + 0.05 < cat_auc < s.ceiling_auc


def test_generator_rejects_bad_arguments(tmp_path):
    with pytest.raises(ConfigError, match="fmt"):
        generate(str(tmp_path), 10, 10, fmt="csv")
    with pytest.raises(ConfigError, match="train_rows"):
        generate(str(tmp_path), 0, 10)
    with pytest.raises(ConfigError, match="vocab_rows"):
        generate(str(tmp_path), 10, 10, vocab_rows=[100] * 25)


# --- malformed lines: exact path and line, skipping ----------------------------------

BAD_LINES = {
    "too_few": (line()[: line().rindex("\t")], "expected 40 columns, got 39"),
    "too_many": (line() + "\t00000001", "expected 40 columns, got 41"),
    "not_integer": (line(ints=["1", "2", "3", "4", "abc"] + ["0"] * 8), "column I5: 'abc' is not an integer"),
    "hex_integer": (line(ints=["0x1f"] + ["0"] * 12), "column I1: '0x1f' is not an integer"),
    "float_integer": (line(ints=["0"] * 12 + ["1.5"]), "column I13: '1.5' is not an integer"),
    "int_overflow": (
        line(ints=["9223372036854775808"] + ["0"] * 12),
        "column I1: '9223372036854775808' does not fit a 64-bit signed integer",
    ),
    "not_hex": (line(cats=["00000001", "00000002", "xyz"] + ["00000000"] * 23), "column C3: 'xyz' is not 8-digit hex"),
    "hex_too_long": (line(cats=["123456789"] + ["00000000"] * 25), "column C1: '123456789' is not 8-digit hex"),
    "hex_too_short": (line(cats=["00000000"] * 25 + ["a0000"]), "column C26: 'a0000' is not 8-digit hex"),
    "non_ascii": (line(cats=["00000000"] * 25 + ["abcdéf"]), "column C26: 'abcdéf' is not 8-digit hex"),
    "bad_label": (line(label="2"), "label '2' is not 0 or 1"),
    "empty_label": (line(label=""), "label '' is not 0 or 1"),
    "empty_line": ("", "record is empty"),
}


@pytest.mark.parametrize("kind", sorted(BAD_LINES))
@pytest.mark.parametrize("suffix", [".tsv", ".tsv.gz"])
def test_malformed_line_raises_with_exact_line(tmp_path, kind, suffix):
    bad, reason = BAD_LINES[kind]
    lines = numbered_lines(3000)
    lines[1233] = bad
    path = write_tsv(tmp_path / f"data{suffix}", lines)
    reader = CriteoReader([str(path)], batch_rows=100)
    seen = []
    with pytest.raises(DataFormatError) as info:
        for batch in reader:
            seen.extend(line_numbers_read(batch))
    err = info.value
    assert (err.path, err.line) == (str(path), 1234)
    assert reason in err.reason
    assert str(err).startswith(f"{path}:1234: ")
    # batches before the bad line were delivered in order; none held it or anything after
    assert len(seen) >= 500 and seen == list(range(1, len(seen) + 1)) and seen[-1] < 1234


def test_no_row_after_a_bad_line_is_delivered_before_its_error(tmp_path):
    """A wrong-width line is dropped by the parser; the row after it may end a parser block
    (64 KiB of text at this batch size). Try bad lines around that block end."""
    lines = numbered_lines(1500)
    ends = np.cumsum([len(x) + 1 for x in lines])
    block_end = int(np.searchsorted(ends, 64 << 10, side="right"))  # lines wholly in the first block
    for bad_line in range(block_end - 4, block_end + 3):
        broken = list(lines)
        broken[bad_line - 1] = BAD_LINES["too_few"][0]
        path = write_tsv(tmp_path / f"data{bad_line}.tsv", broken)
        seen = []
        with pytest.raises(DataFormatError) as info:
            for batch in CriteoReader([str(path)], batch_rows=1):
                seen.extend(line_numbers_read(batch))
        assert info.value.line == bad_line
        assert seen == list(range(1, len(seen) + 1)) and len(seen) < bad_line


@pytest.mark.parametrize("suffix", [".tsv", ".tsv.gz"])
def test_skip_bad_lines_counts_and_keeps_every_good_line(tmp_path, suffix):
    lines = numbered_lines(3000)
    bad_at = {1: "too_few", 7: "not_hex", 8: "too_many", 1234: "not_integer", 1235: "empty_line", 2999: "bad_label",
              3000: "too_many"}
    for n, kind in bad_at.items():
        lines[n - 1] = BAD_LINES[kind][0]
    path = write_tsv(tmp_path / f"data{suffix}", lines)
    batch, sizes, reader = read_all([path], batch_rows=100, skip_bad_lines=True)
    assert reader.bad_lines == len(bad_at)
    assert sizes == [100] * 29 + [100 - len(bad_at)]
    assert line_numbers_read(batch) == [n for n in range(1, 3001) if n not in bad_at]
    assert batch.labels.tolist() == [float(n % 2) for n in range(1, 3001) if n not in bad_at]
    list(reader)  # a second pass counts afresh
    assert reader.bad_lines == len(bad_at)


@pytest.mark.parametrize("trial", range(4))
def test_random_bad_lines_are_all_found(tmp_path, trial):
    """Bad lines of every kind, in runs and at block and file ends, against both modes."""
    rnd = np.random.default_rng(trial)
    total = int(rnd.choice([800, 4000]))
    bad_at = sorted(set(rnd.choice(np.arange(1, total + 1), size=int(rnd.choice([3, 60, 400]))).tolist()) | {total})
    lines = numbered_lines(total)
    kinds = sorted(BAD_LINES)
    for n in bad_at:
        lines[n - 1] = BAD_LINES[kinds[rnd.integers(len(kinds))]][0]
    path = write_tsv(tmp_path / ("data.tsv.gz" if trial % 2 else "data.tsv"), lines)
    batch_rows = int(rnd.choice([1, 37, 1000]))
    batch, _, reader = read_all([path], batch_rows=batch_rows, skip_bad_lines=True)
    assert reader.bad_lines == len(bad_at)
    assert line_numbers_read(batch) == sorted(set(range(1, total + 1)) - set(bad_at))
    seen = []
    with pytest.raises(DataFormatError) as info:
        for good in CriteoReader([str(path)], batch_rows=batch_rows):
            seen.extend(line_numbers_read(good))
    assert info.value.line == bad_at[0]
    assert seen == list(range(1, len(seen) + 1)) and len(seen) < bad_at[0]


@pytest.mark.parametrize(
    ("first", "second"), [("too_few", "not_integer"), ("not_integer", "too_few"), ("not_hex", "too_many")]
)
def test_earliest_of_several_errors_is_raised(tmp_path, first, second):
    lines = numbered_lines(2000)
    lines[1233] = BAD_LINES[first][0]
    lines[1299] = BAD_LINES[second][0]
    path = write_tsv(tmp_path / "data.tsv", lines)
    with pytest.raises(DataFormatError) as info:
        list(CriteoReader([str(path)], batch_rows=50))
    assert info.value.line == 1234 and BAD_LINES[first][1] in info.value.reason


def criteo_table(rows: int) -> pa.Table:
    """A valid Criteo table: label i % 2, I<k> = k - 1, every id 0x0000abcd."""
    return pa.table(
        {"label": pa.array([i % 2 for i in range(rows)], pa.int64())}
        | {c: pa.array([i] * rows, pa.int64()) for i, c in enumerate(COLUMNS[1 : 1 + NUM_DENSE])}
        | {c: pa.array(["0000abcd"] * rows) for c in COLUMNS[1 + NUM_DENSE :]}
    )


def bad_parquet_rows(table: pa.Table, path, line: int, reason: str, bad_lines: int) -> RawBatch:
    """``table`` written as Parquet (row groups of 700) at ``path``: read strictly, the first bad
    row raises at ``line`` with ``reason``; skipping, ``bad_lines`` rows go. Returns the rest."""
    pq.write_table(table, path, row_group_size=700)
    with pytest.raises(DataFormatError) as info:
        list(CriteoReader([str(path)], batch_rows=100))
    assert (info.value.path, info.value.line) == (str(path), line)
    assert info.value.reason == reason
    batch, _, reader = read_all([path], batch_rows=100, skip_bad_lines=True)
    assert reader.bad_lines == bad_lines and batch.num_rows == table.num_rows - bad_lines
    return batch


def test_parquet_errors_name_the_row(tmp_path):
    table = criteo_table(3000)
    c3 = table.column("C3").to_pylist()
    c3[1233] = "xyz"
    labels = table.column("label").to_pylist()
    labels[2500] = 2
    table = table.set_column(COLUMNS.index("C3"), "C3", pa.array(c3))
    table = table.set_column(0, "label", pa.array(labels, pa.int64()))
    path = tmp_path / "data.parquet"
    batch = bad_parquet_rows(table, path, 1234, "column C3: 'xyz' is not 8-digit hex", bad_lines=2)
    assert (batch.sparse == 0xABCD).all()

    pq.write_table(table.drop_columns(["I7"]), path)
    with pytest.raises(DataFormatError, match="missing column.*I7"):
        list(CriteoReader([str(path)]))

    pq.write_table(table.set_column(3, "I3", pa.array([0.5] * 3000)), path)
    with pytest.raises(DataFormatError, match="column I3: type double is not supported"):
        list(CriteoReader([str(path)]))


def test_parquet_column_named_twice_is_refused_at_row_1(tmp_path):
    """Columns are taken by name: a second ``label`` would shift every column after it."""
    table = criteo_table(100)
    path = tmp_path / "d.parquet"
    twice = pa.table([pa.array([7] * 100), *table.columns, table.column("C5")], names=["label", *COLUMNS, "C5"])
    pq.write_table(twice, path)
    for skip in (False, True):
        with pytest.raises(DataFormatError) as info:
            list(CriteoReader([str(path)], skip_bad_lines=skip))
        assert (info.value.path, info.value.line) == (str(path), 1)
        assert info.value.reason == "column label appears 2 times; column C5 appears 2 times"
    # a column of another name, even twice, is not read and does no harm
    extra = pa.table([*table.columns, pa.array([1] * 100), pa.array([2] * 100)], names=[*COLUMNS, "day", "day"])
    pq.write_table(extra, path)
    batch, _, _ = read_all([path])
    assert batch.num_rows == 100 and (batch.sparse == 0xABCD).all()


def test_parquet_uint64_beyond_int64_is_a_bad_row(tmp_path):
    table = criteo_table(3000)
    i3 = [2] * 3000
    i3[1233], i3[2000], i3[2001] = 2**64 - 1, 2**63, 2**63 - 1  # the last one fits
    labels = [i % 2 for i in range(3000)]
    labels[2500] = 2**64 - 1
    table = table.set_column(3, "I3", pa.array(i3, pa.uint64())).set_column(0, "label", pa.array(labels, pa.uint64()))
    path = tmp_path / "d.parquet"
    batch = bad_parquet_rows(table, path, 1234, "column I3: 18446744073709551615 does not fit a 64-bit signed integer",
                             bad_lines=3)
    assert batch.dense[:, 2].max() == np.float32(math.log1p(2**63 - 1))
    with pytest.raises(DataFormatError) as info:
        list(CriteoReader([str(path)], batch_rows=2000, skip_bad_lines=False))
    assert info.value.line == 1234  # the first of several bad rows in one batch

    table = criteo_table(3000).set_column(0, "label", pa.array(labels, pa.uint64()))
    pq.write_table(table, path)
    with pytest.raises(DataFormatError) as info:
        list(CriteoReader([str(path)]))
    assert (info.value.line, info.value.reason) == (2501, "label 18446744073709551615 is not 0 or 1")


def test_parquet_float_labels_other_than_0_and_1_are_bad_rows(tmp_path):
    values = [0.0, 1.0, float("nan"), float("inf"), -0.0, 0.5, 1.0, None]
    table = criteo_table(len(values)).set_column(0, "label", pa.array(values, pa.float32()))
    path = tmp_path / "d.parquet"
    pq.write_table(table, path)
    batch, _, reader = read_all([path], skip_bad_lines=True)
    assert reader.bad_lines == 4 and batch.labels.tolist() == [0.0, 1.0, 0.0, 1.0]
    with pytest.raises(DataFormatError) as info:
        list(CriteoReader([str(path)]))
    assert (info.value.line, info.value.reason) == (3, "label nan is not 0 or 1")


def test_parquet_with_a_broken_footer_or_cut_short_is_one_data_format_error(tmp_path):
    path = tmp_path / "d.parquet"
    pq.write_table(criteo_table(1000), path, row_group_size=300)
    good = path.read_bytes()
    garbage = good[:-200] + np.random.default_rng(0).bytes(192) + good[-8:]  # footer length and magic kept
    cuts = [good[:n] for n in (4, 8, 100, len(good) // 2, len(good) - 1)]
    for data in [garbage, *cuts]:
        path.write_bytes(data)
        for skip in (False, True):
            with pytest.raises(DataFormatError) as info:
                list(CriteoReader([str(path)], skip_bad_lines=skip))
            err = info.value
            assert (err.path, err.line) == (str(path), 1)
            assert err.reason.startswith("not a Parquet file: ") and str(err).isprintable(), str(err)
    path.write_bytes(garbage)
    with pytest.raises(DataFormatError, match="not a Parquet file: Couldn't deserialize thrift"):
        list(CriteoReader([str(path)]))


# --- values ---------------------------------------------------------------------------


def test_empty_and_negative_fields(tmp_path):
    ints = ["", "-5", "0", "1", "", "10", "-1", "", "", "", "", "", "7"]
    cats = ["", "ffffffff", "00000001", "0000001f", "ABCDEF01"] + [""] * 21
    path = write_tsv(tmp_path / "d.tsv", [line("1", ints, cats)])
    batch, sizes, _ = read_all([path])
    assert sizes == [1]
    assert batch.labels.tolist() == [1.0]
    np.testing.assert_array_equal(
        batch.dense[0], np.log1p(np.array([0, 0, 0, 1, 0, 10, 0, 0, 0, 0, 0, 0, 7], np.float64)).astype(np.float32)
    )
    assert batch.sparse[0, :5].tolist() == [0, 4294967295, 1, 31, 0xABCDEF01]
    assert (batch.sparse[0, 5:] == 0).all()


@pytest.mark.parametrize("width", [1, 2, 3, 4, 5, 6, 7, 9, 12, 16])
def test_an_id_of_any_width_but_8_is_a_bad_line(tmp_path, width):
    value = "a" * width
    lines = numbered_lines(20)
    lines[9] = line(cats=["00000001"] * 6 + [value] + ["00000001"] * 19)
    tsv = write_tsv(tmp_path / "d.tsv", lines)
    rows = criteo_table(20).column("C7").to_pylist()
    rows[9] = value
    parquet = tmp_path / "d.parquet"
    pq.write_table(criteo_table(20).set_column(COLUMNS.index("C7"), "C7", pa.array(rows)), parquet)
    for path in (tsv, parquet):
        with pytest.raises(DataFormatError) as info:
            list(CriteoReader([str(path)]))
        assert (info.value.line, info.value.reason) == (10, f"column C7: {value!r} is not 8-digit hex")
        batch, _, reader = read_all([path], skip_bad_lines=True)
        assert reader.bad_lines == 1 and batch.num_rows == 19


@pytest.mark.parametrize("suffix", [".tsv", ".tsv.gz"])
def test_a_file_cut_inside_its_last_id_is_a_bad_last_line(tmp_path, suffix):
    """A download cut short ends in part of an id: 'a000' is no id, not 0xa000."""
    text = "\n".join(numbered_lines(300))
    assert text.endswith("\ta0000019")
    data = text[:-4].encode()
    path = tmp_path / f"cut{suffix}"
    path.write_bytes(gzip.compress(data, mtime=0) if suffix.endswith(".gz") else data)
    with pytest.raises(DataFormatError) as info:
        list(CriteoReader([str(path)], batch_rows=100))
    assert str(info.value) == f"{path}:300: column C26: 'a000' is not 8-digit hex"
    batch, _, reader = read_all([path], batch_rows=100, skip_bad_lines=True)
    assert reader.bad_lines == 1 and line_numbers_read(batch) == list(range(1, 300))


def test_preprocess_dense_exact():
    ints = np.array([[0, 1, -7, 9, 2**40] + [0] * 8, [-1] * 13], dtype=np.int64)
    out = preprocess_dense(ints)
    assert out.dtype == np.float32 and out.shape == (2, 13)
    expected = [0.0, math.log(2), 0.0, math.log(10), 40 * math.log(2)]
    assert out[0, :5].tolist() == [float(np.float32(v)) for v in expected]
    assert (out[1] == 0).all()


def test_sparse_to_rows_exact():
    sparse = np.zeros((2, NUM_SPARSE), dtype=np.uint32)
    sparse[0, 0] = 0xFFFFFFFF
    sparse[0, 1] = 12345
    sparse[1, 25] = 999
    table_rows = [1000, 100] + [7] * 23 + [10**9]
    rows = sparse_to_rows(sparse, table_rows)
    assert rows.dtype == np.int64
    assert rows[0, :3].tolist() == [295, 45, 0]
    assert rows[1, 25] == 999
    with pytest.raises(ConfigError):
        sparse_to_rows(sparse, [10] * 25)
    with pytest.raises(ConfigError):
        sparse_to_rows(sparse, [0] * 26)


def test_batches_do_not_cross_files(tmp_path):
    a = write_tsv(tmp_path / "a.tsv", numbered_lines(250))
    b = write_tsv(tmp_path / "b.tsv.gz", numbered_lines(130))
    batch, sizes, _ = read_all([a, b], batch_rows=100)
    assert sizes == [100, 100, 50, 100, 30]
    assert line_numbers_read(batch) == list(range(1, 251)) + list(range(1, 131))
    empty = tmp_path / "empty.tsv"
    empty.write_bytes(b"")
    assert read_all([empty])[1] == []


def test_corrupt_gzip_is_a_data_format_error(tmp_path):
    data = ("\n".join(numbered_lines(2000)) + "\n").encode()
    path = tmp_path / "cut.tsv.gz"
    path.write_bytes(gzip.compress(data)[:3000])
    with pytest.raises(DataFormatError) as info:
        list(CriteoReader([str(path)]))
    assert info.value.path == str(path) and "unreadable" in info.value.reason


# --- unreadable files: one error with file:line, nothing printed on the side -----------------


@pytest.fixture
def unraisable(monkeypatch) -> list:
    """What would be printed as "Exception ignored in: ..." (e.g. by pyarrow's CSV callbacks
    or a finalizer) while the test runs."""
    seen: list = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: seen.append(f"{u.object!r}: {u.exc_value!r}"))
    return seen


def not_utf8_files(tmp_path: Path) -> dict[str, tuple[Path, int]]:
    """name -> (file, line of its first undecodable byte)."""
    good = [line().encode() for _ in range(3000)]
    wrong_width = list(good)
    wrong_width[1233] = b"ab\xff\xfe\tc"
    full_width = list(good)
    full_width[1233] = line(cats=["\xe9" * 8] + ["00000000"] * 25).encode("latin-1")
    files = {
        "random_bytes": (np.random.default_rng(3).bytes(200_000), 1),
        "wrong_width_line": (b"\n".join(wrong_width) + b"\n", 1234),
        "full_width_line": (b"\n".join(full_width) + b"\n", 1234),
    }
    out = {}
    for name, (data, first_bad) in files.items():
        path = tmp_path / f"{name}.tsv"
        path.write_bytes(data)
        out[name] = (path, first_bad)
        gz = tmp_path / f"{name}.tsv.gz"
        gz.write_bytes(gzip.compress(data, mtime=0))
        out[name + ".gz"] = (gz, first_bad)
    return out


@pytest.mark.parametrize("skip_bad_lines", [False, True])
def test_binary_or_non_utf8_file_is_one_error_naming_its_line(tmp_path, unraisable, skip_bad_lines):
    for name, (path, first_bad) in not_utf8_files(tmp_path).items():
        with pytest.raises(DataFormatError) as info:
            list(CriteoReader([str(path)], batch_rows=100, skip_bad_lines=skip_bad_lines))
        err = info.value
        assert (err.path, err.line) == (str(path), first_bad), name
        assert str(err).startswith(f"{path}:{first_bad}: not UTF-8 text"), name
        assert "\ufffd" not in str(err)  # the line's bytes are not quoted
    gc.collect()  # finalizers of anything left behind run now, under the fixture's hook
    assert unraisable == []


def test_wrong_width_line_before_undecodable_text_is_reported_first(tmp_path, unraisable):
    lines = [line().encode() for _ in range(50)]
    lines[9] = b"a\tb"
    lines[19] = b"\xff\xfe\x00"
    path = tmp_path / "d.tsv"
    path.write_bytes(b"\n".join(lines) + b"\n")
    with pytest.raises(DataFormatError) as info:
        list(CriteoReader([str(path)]))
    assert info.value.line == 10 and info.value.reason == "expected 40 columns, got 2"
    with pytest.raises(DataFormatError) as info:  # a skipped line does not hide the undecodable one
        list(CriteoReader([str(path)], skip_bad_lines=True))
    assert info.value.line == 20 and "not UTF-8" in info.value.reason
    assert unraisable == []


def test_file_that_is_not_parquet_is_a_data_format_error(tmp_path):
    for data in (b"", "\n".join(numbered_lines(10)).encode()):
        path = tmp_path / "d.parquet"
        path.write_bytes(data)
        with pytest.raises(DataFormatError) as info:
            list(CriteoReader([str(path)]))
        assert (info.value.path, info.value.line) == (str(path), 1)
        assert info.value.reason.startswith("not a Parquet file")


def build(tmp_path: Path, train: list, eval_: list | None = None, rows: int = 64, skip: bool = False) -> dict:
    """The train and eval stores of these files, built in this process (no Ray)."""
    if eval_ is None:
        eval_ = [write_tsv(tmp_path / "good-eval.tsv", numbered_lines(300))]
    cfg = config_from_dict({
        "run_dir": str(tmp_path / "run"),
        "data": {"train": [str(p) for p in train], "eval": [str(p) for p in eval_], "skip_bad_lines": skip,
                 "cache_dir": str(tmp_path / "cache")},
        "model": {"table_rows": 1000}, "training": {"microbatch_rows": rows},
    })
    return build_stores(cfg, resolve_data(cfg), LocalEngine())


def _good_train(tmp_path: Path) -> Path:
    return write_tsv(tmp_path / "good-train.tsv", numbered_lines(300))


def test_cache_of_a_binary_file_raises_and_leaves_no_cache(tmp_path, unraisable):
    path = tmp_path / "train.tsv"
    path.write_bytes(np.random.default_rng(5).bytes(50_000))
    with pytest.raises(DataFormatError) as info:
        build(tmp_path, [path])
    assert (info.value.path, info.value.line) == (str(path), 1)
    assert not list((tmp_path / "cache").rglob("store.json"))
    gc.collect()
    assert unraisable == []


# --- data without usable rows stops the run before training ----------------------------------


def test_empty_training_file_is_insufficient_data(tmp_path):
    empty = tmp_path / "empty.tsv"
    empty.write_bytes(b"")
    good = write_tsv(tmp_path / "good.tsv", numbered_lines(300))
    for paths in ([empty], [good, empty]):
        with pytest.raises(InsufficientData) as info:
            build(tmp_path, paths)
        assert f"{empty}: empty (0 lines)" in str(info.value)
        assert str(info.value).startswith(f"train data: 1 of {len(paths)} file(s) hold no usable row")
    assert not list((tmp_path / "cache").rglob("store.json"))


def test_training_file_with_every_line_skipped_is_insufficient_data(tmp_path):
    path = write_tsv(tmp_path / "bad.tsv", [BAD_LINES["too_few"][0], BAD_LINES["not_hex"][0], ""])
    with pytest.raises(InsufficientData) as info:
        build(tmp_path, [path], skip=True)
    assert f"{path}: 3 lines read, 3 skipped as malformed, 0 usable" in str(info.value)
    assert str(pickle.loads(pickle.dumps(info.value))) == str(info.value)  # crosses Ray actors intact


def test_fewer_rows_than_one_microbatch_is_insufficient_data(tmp_path):
    a = write_tsv(tmp_path / "a.tsv", numbered_lines(30) + [BAD_LINES["too_few"][0]])
    b = write_tsv(tmp_path / "b.tsv", numbered_lines(20))
    with pytest.raises(InsufficientData) as info:
        build(tmp_path, [a, b], skip=True)
    message = str(info.value)
    assert message.startswith("train data: 50 usable rows, fewer than one microbatch of 64 rows")
    assert f"{a}: 31 lines read, 1 skipped as malformed, 30 usable" in message
    assert f"{b}: 20 lines read, 0 skipped as malformed, 20 usable" in message
    # evaluation keeps a short tail: the same rows make one microbatch there
    info_eval = build(tmp_path, [_good_train(tmp_path)], [a, b], skip=True)["eval"]
    assert (info_eval.rows, info_eval.microbatches, info_eval.bad_lines) == (50, 1, 1)


def test_eval_file_without_rows_is_insufficient_data(tmp_path):
    path = write_tsv(tmp_path / "eval.tsv", [BAD_LINES["bad_label"][0]] * 4)
    with pytest.raises(InsufficientData, match=r"^eval data: 1 of 1 file\(s\) hold no usable row"):
        build(tmp_path, [_good_train(tmp_path)], [path], skip=True)


def test_microbatches_span_files_and_count_every_skipped_line(tmp_path):
    a = write_tsv(tmp_path / "a.tsv", numbered_lines(100) + [BAD_LINES["too_many"][0]])
    b = write_tsv(tmp_path / "b.tsv.gz", numbered_lines(60) + [BAD_LINES["not_integer"][0]])
    info = build(tmp_path, [a, b], skip=True)["train"]
    assert (info.rows, info.microbatches, info.bad_lines, info.reused) == (128, 2, 2, False)
    again = build(tmp_path, [a, b], skip=True)["train"]
    assert (again.rows, again.microbatches, again.bad_lines, again.reused) == (128, 2, 2, True)


# --- end to end: `cpr train` on bad data of one chunk fails in preprocessing, before Ray ----


def run_cpr_train(tmp_path: Path, train: Path, eval_: Path, *args: str) -> subprocess.CompletedProcess:
    config = tmp_path / "run.yaml"
    config.write_text(
        json.dumps(  # JSON is YAML
            {
                "run_dir": str(tmp_path / "run"),
                "data": {"train": [str(train)], "eval": [str(eval_)]},
                "model": {"table_rows": 1000},
                "training": {"microbatch_rows": 64},
            }
        )
    )
    # Data of one chunk is preprocessed by the driver before it starts its own Ray.
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}
    env["PYTHONWARNINGS"] = "default"  # shows ResourceWarnings
    return subprocess.run(
        [sys.executable, "-m", "app", "train", "--config", str(config), "--no-progress", *args],
        capture_output=True, text=True, timeout=120, env=env, cwd=Path(__file__).resolve().parents[2],
    )


def assert_one_error_line(result: subprocess.CompletedProcess, expected_start: str) -> None:
    output = result.stdout + result.stderr
    assert result.returncode == 2, output
    errors = [x for x in result.stderr.splitlines() if x.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(expected_start), output
    noises = ("Exception ignored", "Traceback", "ResourceWarning", "Started a local Ray", "Connecting to existing Ray")
    for noise in noises:
        assert noise not in output, output


@pytest.mark.timeout(150)
def test_cpr_train_on_a_binary_file_fails_before_ray_with_one_error(tmp_path):
    train = tmp_path / "train.tsv"
    train.write_bytes(np.random.default_rng(11).bytes(100_000))
    eval_ = write_tsv(tmp_path / "eval.tsv", numbered_lines(100))
    result = run_cpr_train(tmp_path, train, eval_)
    assert_one_error_line(result, f"error: {train}:1: not UTF-8 text")
    assert not (tmp_path / "run" / "checkpoints").exists()
    assert not (tmp_path / "run" / "events.jsonl").exists()  # no supervisor, no shard, no trainer


@pytest.mark.timeout(150)
def test_cpr_train_with_every_line_skipped_fails_before_ray(tmp_path):
    train = write_tsv(tmp_path / "train.tsv", [BAD_LINES["too_few"][0]] * 5)
    eval_ = write_tsv(tmp_path / "eval.tsv", numbered_lines(100))
    result = run_cpr_train(tmp_path, train, eval_, "--skip-bad-lines")
    expected = f"error: train data: 1 of 1 file(s) hold no usable row; {train}: 5 lines read, 5 skipped as malformed"
    assert_one_error_line(result, expected)


def test_the_old_name_of_auc_still_imports():
    from core.data import _auc  # benchmarks/ddp_baseline.py imports it by this name

    assert _auc is auc
