"""A seeded fuzzer of the Criteo TSV reader: small random files of good and bad lines (LF and
CRLF endings, with and without a final newline, empty lines, wrong widths, bad labels,
integers and ids) read in many chunkings and batch sizes, each checked against a plain
Python reading of the format; and corrupted Parquet files, which must read or fail in one
DataFormatError, never another exception.

Everything is drawn from fixed seeds, so a failure names a seed that reproduces it.
"""

from __future__ import annotations

import random
import re
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from core.data import COLUMNS, NUM_DENSE, NUM_SPARSE, CriteoReader, preprocess_dense
from core.data.chunks import plan_chunks
from core.data.sources import InputFile, resolve_inputs
from core.errors import DataFormatError

pytestmark = pytest.mark.timeout(60)

FILES = 60
COMBINATIONS = 32  # chunkings x batch sizes per file: about 2,000 in all

# --- the reference: the format, read line by line in plain Python ---------------------

_INTEGER = re.compile(r"-?[0-9]+")
_HEX8 = re.compile(r"[0-9a-fA-F]{8}")


@dataclass
class Reference:
    """What a correct reader returns for a file: its good rows in order and its bad lines."""

    labels: np.ndarray  # float32 [n]
    dense: np.ndarray  # float32 [n, 13], preprocessed as the reader does
    sparse: np.ndarray  # uint32 [n, 26]
    good_lines: list[int]
    bad_lines: list[int]


def _integer(field: str) -> int | None:
    """A dense value: missing is 0; None if the field is not a decimal 64-bit integer."""
    if field == "":
        return 0
    if not _INTEGER.fullmatch(field):
        return None
    value = int(field)
    return value if -(2**63) <= value < 2**63 else None


def _hex_id(field: str) -> int | None:
    """A categorical id: missing is 0; None unless exactly 8 hex digits."""
    if field == "":
        return 0
    return int(field, 16) if _HEX8.fullmatch(field) else None


def _parse_line(line: str) -> tuple[float, list[int], list[int]] | None:
    """(label, 13 integers, 26 ids) of one line without its line end, or None if it is bad."""
    fields = line.split("\t")
    if len(fields) != len(COLUMNS) or fields[0] not in ("0", "1"):
        return None  # an empty line is one empty field: a wrong width
    ints = [_integer(f) for f in fields[1 : 1 + NUM_DENSE]]
    ids = [_hex_id(f) for f in fields[1 + NUM_DENSE :]]
    if None in ints or None in ids:
        return None
    return float(fields[0]), ints, ids


def reference(data: bytes) -> Reference:
    """Lines end at LF; a CR before the LF (or at the end of the file) is part of the line end.
    A final line without a line end is a line; nothing after the last line end is none."""
    text = data.decode()
    lines = text.split("\n")
    if lines[-1] == "":
        lines.pop()
    rows, good, bad = [], [], []
    for number, line in enumerate(lines, start=1):
        parsed = _parse_line(line[:-1] if line.endswith("\r") else line)
        if parsed is None:
            bad.append(number)
        else:
            rows.append(parsed)
            good.append(number)
    return Reference(
        np.array([r[0] for r in rows], dtype=np.float32),
        preprocess_dense(np.array([r[1] for r in rows], dtype=np.int64).reshape(-1, NUM_DENSE)),
        np.array([r[2] for r in rows], dtype=np.uint32).reshape(-1, NUM_SPARSE),
        good,
        bad,
    )


def test_the_reference_reads_lines_as_documented():
    """The reference's own rules, on a file whose every line it is sure of."""
    good = "\t".join(["1"] + ["5"] * NUM_DENSE + ["a0000019"] * NUM_SPARSE)
    data = f"{good}\r\n\n{good}\n\r\n{good[:-3]}\n{good}\r".encode()
    ref = reference(data)
    assert ref.good_lines == [1, 3, 6] and ref.bad_lines == [2, 4, 5]


# --- random files ------------------------------------------------------------------------

_GOOD_INTEGERS = ["", "0", "-0", "1", "7", "007", "-5", "123456", "9223372036854775807", "-9223372036854775808"]
_BAD_INTEGERS = ["abc", "1.5", "0x1f", "1e3", "+5", " 5", "5 ", "-", "--1", "9223372036854775808",
                 "-9223372036854775809", "99999999999999999999", "é", '"7"']
_BAD_LABELS = ["", "2", "-1", "01", "1.0", " 1", "x", "true", "é"]


def _good_hex(rnd: random.Random) -> str:
    if rnd.random() < 0.1:
        return ""
    value = f"{rnd.getrandbits(32):08x}"
    return value.upper() if rnd.random() < 0.2 else value


def _bad_hex(rnd: random.Random) -> str:
    width = rnd.choice([1, 2, 3, 5, 7, 9, 12, 16])  # never 8: only 8 digits make an id
    digits = "".join(rnd.choice("0123456789abcdef") for _ in range(width))
    return rnd.choice([digits, digits, "0000000g", "0x123456", "xyz", "abcdéf", "ééééé", '"a0000"', " a000000"])


def _good_integer(rnd: random.Random) -> str:
    return rnd.choice(_GOOD_INTEGERS) if rnd.random() < 0.5 else str(rnd.randint(-50, 10**6))


def _line(rnd: random.Random, bad: bool) -> str:
    """A record of 40 fields, with one to three bad fields when ``bad``."""
    fields = [rnd.choice("01")]
    fields += [_good_integer(rnd) for _ in range(NUM_DENSE)]
    fields += [_good_hex(rnd) for _ in range(NUM_SPARSE)]
    for _ in range(rnd.randint(1, 3) if bad else 0):
        column = rnd.randrange(len(COLUMNS))
        if column == 0:
            fields[0] = rnd.choice(_BAD_LABELS)
        elif column <= NUM_DENSE:
            fields[column] = rnd.choice(_BAD_INTEGERS)
        else:
            fields[column] = _bad_hex(rnd)
    return "\t".join(fields)


def _any_line(rnd: random.Random) -> str:
    kind = rnd.random()
    if kind < 0.6:
        return _line(rnd, bad=False)
    if kind < 0.8:
        return _line(rnd, bad=True)
    if kind < 0.87:
        return ""
    if kind < 0.9:
        return "\t" * (len(COLUMNS) - 1)  # every field missing, the label too
    fields = _line(rnd, bad=False).split("\t")
    width = rnd.choice([1, 2, len(COLUMNS) - 1, len(COLUMNS) + 1, len(COLUMNS) + 5])
    return "\t".join((fields * 2)[:width])


def random_file(seed: int) -> bytes:
    """A small TSV file; every tenth or so long enough to span several parser blocks."""
    rnd = random.Random(seed)
    count = rnd.randint(300, 400) if seed % 10 == 9 else rnd.randint(0, 30)
    crlf_share = rnd.choice([0.0, 0.5, 1.0])
    text = ""
    for i in range(count):
        text += _any_line(rnd)
        if i < count - 1:
            text += "\r\n" if rnd.random() < crlf_share else "\n"
    if count:
        text += rnd.choice(["\n", "\r\n", "", "\r"])  # the last line's end, or none
    return text.encode()


def _plans(rnd: random.Random, size: int) -> list[tuple[int, int]]:
    """(chunk_bytes, batch_rows) pairs: whole files and cuts into up to ~16 chunks."""
    out = []
    for _ in range(COMBINATIONS):
        cut_anywhere = rnd.randint(max(1, size // 16), size + 1)
        chunk_bytes = rnd.choice([size + 1, max(1, size // 2), max(1, size // 3), cut_anywhere])
        batch_rows = rnd.choice([1, 2, 3, 5, 7, 16, 64, 65536])
        out.append((chunk_bytes, batch_rows))
    return out


def _read(chunks, batch_rows: int, skip_bad_lines: bool):
    """(labels, dense, sparse) of every row read, the reader, and the error that stopped it."""
    reader = CriteoReader(chunks, batch_rows=batch_rows, skip_bad_lines=skip_bad_lines)
    batches, error = [], None
    try:
        for batch in reader:
            assert 0 < batch.num_rows <= batch_rows
            batches.append(batch)
    except DataFormatError as exc:
        error = exc
    labels = np.concatenate([b.labels for b in batches]) if batches else np.zeros(0, np.float32)
    dense = np.concatenate([b.dense for b in batches]) if batches else np.zeros((0, NUM_DENSE), np.float32)
    sparse = np.concatenate([b.sparse for b in batches]) if batches else np.zeros((0, NUM_SPARSE), np.uint32)
    return (labels, dense, sparse), reader, error


def _assert_rows(rows, ref: Reference, count: int, where: str) -> None:
    """``rows`` are the reference's first ``count`` good rows, exactly."""
    labels, dense, sparse = rows
    assert labels.shape[0] == count, where
    np.testing.assert_array_equal(labels, ref.labels[:count], err_msg=where)
    np.testing.assert_array_equal(dense, ref.dense[:count], err_msg=where)
    np.testing.assert_array_equal(sparse, ref.sparse[:count], err_msg=where)


@pytest.mark.parametrize("seed", range(FILES))
def test_reader_agrees_with_the_reference(tmp_path, seed):
    data = random_file(seed)
    path = tmp_path / f"fuzz{seed}.tsv"
    path.write_bytes(data)
    ref = reference(data)
    files = resolve_inputs([str(path)], "data.train")
    rnd = random.Random(1000 + seed)
    for chunk_bytes, batch_rows in _plans(rnd, len(data)):
        chunks = plan_chunks(files, chunk_bytes)
        where = f"seed {seed}, chunk_bytes {chunk_bytes} ({len(chunks)} chunks), batch_rows {batch_rows}"

        rows, reader, error = _read(chunks, batch_rows, skip_bad_lines=True)
        assert error is None, f"{where}: {error}"
        assert reader.bad_lines == len(ref.bad_lines), where
        _assert_rows(rows, ref, len(ref.good_lines), where)

        rows, reader, error = _read(chunks, batch_rows, skip_bad_lines=False)
        if not ref.bad_lines:
            assert error is None, f"{where}: {error}"
            _assert_rows(rows, ref, len(ref.good_lines), where)
            continue
        assert error is not None, where
        assert (error.path, error.line) == (str(path), ref.bad_lines[0]), f"{where}: {error}"
        # rows delivered before the error all come before the bad line, in order
        before = sum(1 for n in ref.good_lines if n < ref.bad_lines[0])
        assert rows[0].shape[0] <= before, where
        _assert_rows(rows, ref, rows[0].shape[0], where)


def test_fuzz_files_hold_every_kind_of_line():
    """The generator does make what the fuzzer claims to try."""
    files = [random_file(seed) for seed in range(FILES)]
    refs = [reference(data) for data in files]
    joined = b"".join(files)
    assert b"\r\n" in joined and b"\n\n" in joined and b"\r\n\r\n" in joined
    assert sum(len(r.bad_lines) for r in refs) > 200 and sum(len(r.good_lines) for r in refs) > 1000
    ends = [data[-2:] for data in files if data]
    assert any(e.endswith(b"\r\n") for e in ends)
    assert any(e.endswith(b"\n") and not e.endswith(b"\r\n") for e in ends)
    assert any(e.endswith(b"\r") for e in ends)
    assert any(not e.endswith((b"\n", b"\r")) for e in ends)
    assert any(not data for data in files)  # an empty file
    assert any(len(data) > 64 << 10 for data in files)  # several parser blocks


# --- corrupted Parquet files: read, or one DataFormatError ----------------------------------


def _parquet_bytes(tmp_path: Path) -> bytes:
    n = 500
    rng = np.random.default_rng(0)
    table = pa.table(
        {"label": pa.array(rng.integers(0, 2, n), pa.int64())}
        | {c: pa.array(rng.integers(-5, 1000, n), pa.int64()) for c in COLUMNS[1 : 1 + NUM_DENSE]}
        | {c: pa.array([f"{v:08x}" for v in rng.integers(0, 2**32, n)]) for c in COLUMNS[1 + NUM_DENSE :]}
    )
    path = tmp_path / "good.parquet"
    pq.write_table(table, path, row_group_size=200)
    return path.read_bytes()


@pytest.mark.parametrize("skip_bad_lines", [False, True])
def test_corrupt_parquet_is_read_or_one_data_format_error(tmp_path, skip_bad_lines):
    good = _parquet_bytes(tmp_path)
    footer = struct.unpack("<I", good[-8:-4])[0]
    rnd = random.Random(7)
    variants = [good[:cut] for cut in range(0, len(good), max(1, len(good) // 40))]
    variants += [good[:cut] + good[-(footer + 8) :] for cut in (4, 100, len(good) // 2)]  # body cut, footer kept
    for _ in range(150):  # bytes of the footer changed
        data = bytearray(good)
        for _ in range(rnd.randint(1, 3)):
            data[len(good) - 8 - rnd.randint(1, footer)] = rnd.randrange(256)
        variants.append(bytes(data))
    path = tmp_path / "corrupt.parquet"
    failures = 0
    for i, data in enumerate(variants):
        path.write_bytes(data)
        try:
            for batch in CriteoReader([InputFile(str(path), str(path), len(data), 0)], batch_rows=128,
                                      skip_bad_lines=skip_bad_lines):
                assert batch.sparse.shape[1] == NUM_SPARSE
        except DataFormatError as exc:
            failures += 1
            assert exc.path == str(path) and exc.line >= 1, f"variant {i}: {exc}"
            assert str(exc).isprintable(), f"variant {i}: {exc!r}"  # one line, no raw bytes
    assert failures > len(variants) // 2
