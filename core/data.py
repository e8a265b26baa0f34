"""Criteo click logs: a streaming reader of TSV, TSV.gz and Parquet files into model-ready
batches, with exact line numbers for malformed records, and a seeded generator of
Criteo-shaped synthetic data drawn from a hidden click model whose best AUC is known.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import json
import math
import os
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from core.errors import ConfigError, DataFormatError

__all__ = [
    "NUM_DENSE",
    "NUM_SPARSE",
    "COLUMNS",
    "RawBatch",
    "preprocess_dense",
    "sparse_to_rows",
    "CriteoReader",
    "GeneratorSummary",
    "generate",
]

NUM_DENSE = 13
NUM_SPARSE = 26
DENSE_COLUMNS = tuple(f"I{i}" for i in range(1, NUM_DENSE + 1))
SPARSE_COLUMNS = tuple(f"C{i}" for i in range(1, NUM_SPARSE + 1))
COLUMNS = ("label", *DENSE_COLUMNS, *SPARSE_COLUMNS)

_INT64_MIN = -(2**63)
_INT64_MAX = 2**63 - 1
_UINT32_MAX = 2**32 - 1

# ASCII byte -> hex nibble; 0xFF marks a byte that is not a hex digit, so a row holds
# one exactly when some byte of its nibbles has a high bit set.
_HEX_NIBBLE = np.full(256, 0xFF, dtype=np.uint8)
for _i, _c in enumerate(b"0123456789abcdef"):
    _HEX_NIBBLE[_c] = _i
for _i, _c in enumerate(b"ABCDEF"):
    _HEX_NIBBLE[_c] = 10 + _i
_HEX_DIGITS = np.frombuffer(b"0123456789abcdef", dtype=np.uint8)
_NOT_NIBBLE_BITS = np.uint64(0xF0F0F0F0F0F0F0F0)


@dataclass(frozen=True)
class RawBatch:
    """Rows of Criteo data, converted but not yet mapped to embedding rows.

    labels: float32 [n], 0.0 or 1.0.
    dense: float32 [n, 13], ``log(1 + max(x, 0))``; a missing value is 0.
    sparse: uint32 [n, 26], the raw 32-bit categorical ids; a missing value is 0.
    """

    labels: np.ndarray
    dense: np.ndarray
    sparse: np.ndarray

    @property
    def num_rows(self) -> int:
        return int(self.labels.shape[0])


def preprocess_dense(ints: np.ndarray) -> np.ndarray:
    """int64 [n, 13] (missing already 0) -> float32 ``log1p(max(x, 0))``, as DLRM does."""
    clipped = np.maximum(np.asarray(ints, dtype=np.int64), 0)
    # float64 first: float32 cannot hold large counts exactly, and the log is then rounded once
    return np.log1p(clipped.astype(np.float64)).astype(np.float32)


def sparse_to_rows(sparse: np.ndarray, table_rows: Sequence[int]) -> np.ndarray:
    """uint32 [n, 26] raw ids -> int64 [n, 26] embedding rows: column f modulo ``table_rows[f]``.

    This is DLRM's ``max_ind_range`` hashing: ids are folded into tables of fixed size.
    """
    rows = np.asarray(table_rows, dtype=np.int64)
    if sparse.ndim != 2 or rows.shape != (sparse.shape[1],):
        raise ConfigError(f"table_rows has {rows.size} entries; sparse has shape {sparse.shape}, needs one per column")
    if (rows < 1).any():
        bad = int(np.flatnonzero(rows < 1)[0])
        raise ConfigError(f"table_rows[{bad}] = {int(rows[bad])}, must be >= 1")
    return sparse.astype(np.int64) % rows


# ---------------------------------------------------------------------------------------
# Column conversion: vectorized, producing a bad-row mask; reasons are built only on error


def _show(value: object) -> str:
    """A record value for an error message, short enough to read."""
    if value is None:
        value = ""
    if isinstance(value, str) and len(value) > 32:
        value = value[:32] + "..."
    return repr(value)


class _UnsupportedType(Exception):
    """A Parquet column's Arrow type that cannot hold the column's values."""


def _as_strings(col: pa.Array) -> pa.Array | None:
    """The column as string/large_string, or None if its type holds no strings."""
    if pa.types.is_dictionary(col.type):
        col = col.dictionary_decode()
    if pa.types.is_string(col.type) or pa.types.is_large_string(col.type):
        return col
    if pa.types.is_string_view(col.type):
        return col.cast(pa.large_string())
    return None


def _mask(values: pa.Array, fill: bool) -> np.ndarray:
    """A boolean Arrow array as numpy, nulls replaced by ``fill``."""
    return pc.fill_null(values, fill).to_numpy(zero_copy_only=False)


def _parse_labels(col: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """-> (float32 labels, bad mask). Only 0 and 1 are labels; missing is bad."""
    strings = _as_strings(col)
    if strings is not None:
        ones = _mask(pc.equal(strings, "1"), False)
        zeros = _mask(pc.equal(strings, "0"), False)
        return ones.astype(np.float32), ~(ones | zeros)
    if not (pa.types.is_integer(col.type) or pa.types.is_floating(col.type) or pa.types.is_boolean(col.type)):
        raise _UnsupportedType(f"type {col.type} is not supported, expected integer or string")
    values = pc.fill_null(pc.cast(col, pa.float64()), -1.0).to_numpy(zero_copy_only=False)
    return (values == 1.0).astype(np.float32), (values != 0.0) & (values != 1.0)


def _bad_integer_mask(strings: pa.Array) -> np.ndarray:
    """Rows of a string column that are neither missing nor a decimal int64."""
    bad = ~_mask(pc.match_substring_regex(strings, r"^-?[0-9]+$"), True)
    # Well-formed digits can still overflow int64; there are few such candidates, so
    # they are checked one by one.
    long_digits = _mask(pc.match_substring_regex(strings, r"^-?0*[1-9][0-9]{18,}$"), False)
    for i in np.flatnonzero(long_digits):
        if not _INT64_MIN <= int(strings[int(i)].as_py()) <= _INT64_MAX:
            bad[i] = True
    return bad


def _parse_integers(col: pa.Array) -> tuple[np.ndarray, np.ndarray | None]:
    """-> (int64 values with missing as 0, bad mask or None if every value is fine)."""
    if pa.types.is_integer(col.type):
        return pc.fill_null(pc.cast(col, pa.int64()), 0).to_numpy(zero_copy_only=False), None
    strings = _as_strings(col)
    if strings is None:
        raise _UnsupportedType(f"type {col.type} is not supported, expected integer or string")
    try:
        values = pc.cast(strings, pa.int64())
        # Arrow's cast also accepts hex such as '0x1f', which no Criteo count is.
        if not (pc.any(pc.match_substring(strings, "x")).as_py() or pc.any(pc.match_substring(strings, "X")).as_py()):
            return pc.fill_null(values, 0).to_numpy(zero_copy_only=False), None
    except pa.ArrowInvalid:
        pass
    bad = _bad_integer_mask(strings)
    cleaned = pc.if_else(pa.array(bad), pa.scalar(None, strings.type), strings)
    return pc.fill_null(pc.cast(cleaned, pa.int64()), 0).to_numpy(zero_copy_only=False), bad


def _fixed_width_bytes(strings: pa.Array, width: int) -> np.ndarray | None:
    """uint8 [n, width] view of a string column whose values are all ``width`` bytes long,
    or None if some value has another length."""
    n = len(strings)
    offset_type = np.int64 if pa.types.is_large_string(strings.type) else np.int32
    _, offsets_buf, data_buf = strings.buffers()
    offsets = np.frombuffer(offsets_buf, dtype=offset_type)[strings.offset : strings.offset + n + 1]
    start, end = int(offsets[0]), int(offsets[-1])
    if end - start != width * n:
        return None
    if n == 0:
        return np.zeros((0, width), dtype=np.uint8)
    return np.frombuffer(data_buf, dtype=np.uint8)[start:end].reshape(n, width)


def _parse_hex(col: pa.Array) -> tuple[np.ndarray, np.ndarray | None]:
    """-> (uint32 ids with missing as 0, bad mask or None). Values are up to 8 hex digits."""
    strings = _as_strings(col)
    if strings is None:
        raise _UnsupportedType(f"type {col.type} is not supported, expected string")
    strings = pc.fill_null(strings, "")
    bad = pc.greater(pc.binary_length(strings), 8).to_numpy(zero_copy_only=False)
    if bad.any():
        strings = pc.if_else(pa.array(bad), "", strings)
    # Left-padding makes every valid value exactly 8 bytes, so the values lie back to back
    # in one buffer and decode as an [n, 8] byte matrix; missing ('') becomes '00000000' = 0.
    chars = _fixed_width_bytes(pc.utf8_lpad(strings, 8, padding="0"), 8)
    if chars is None:
        # Some value has a multi-byte character, which pads past 8 bytes; none is hex.
        not_ascii = ~pc.string_is_ascii(strings).to_numpy(zero_copy_only=False)
        bad |= not_ascii
        strings = pc.if_else(pa.array(not_ascii), "", strings)
        chars = _fixed_width_bytes(pc.utf8_lpad(strings, 8, padding="0"), 8)
        assert chars is not None
    nibbles = np.take(_HEX_NIBBLE, chars)
    bad |= (np.ascontiguousarray(nibbles).view(np.uint64).ravel() & _NOT_NIBBLE_BITS) != 0
    packed = (nibbles[:, 0::2] << 4) | nibbles[:, 1::2]  # [n, 4] bytes, most significant first
    ids = packed.view(">u4")[:, 0].astype(np.uint32)
    return ids, (bad if bad.any() else None)


@dataclass
class _Parsed:
    """One Arrow batch converted, with the columns that hold a malformed value."""

    labels: np.ndarray
    dense: np.ndarray
    sparse: np.ndarray
    bad_by_column: dict[int, np.ndarray]  # column index in COLUMNS -> bad-row mask

    def bad_rows(self) -> np.ndarray | None:
        if not self.bad_by_column:
            return None
        return np.logical_or.reduce(list(self.bad_by_column.values()))

    def good(self, bad: np.ndarray | None) -> RawBatch:
        if bad is None:
            return RawBatch(self.labels, self.dense, self.sparse)
        keep = ~bad
        return RawBatch(self.labels[keep], self.dense[keep], self.sparse[keep])


def _parse_batch(batch: pa.RecordBatch, path: str, first_line: int) -> _Parsed:
    n = batch.num_rows
    labels = np.empty(n, dtype=np.float32)
    dense_ints = np.empty((n, NUM_DENSE), dtype=np.int64)
    sparse = np.empty((n, NUM_SPARSE), dtype=np.uint32)
    bad_by_column: dict[int, np.ndarray] = {}
    for i, name in enumerate(COLUMNS):
        col = batch.column(i)
        try:
            if i == 0:
                labels, bad = _parse_labels(col)
            elif i <= NUM_DENSE:
                dense_ints[:, i - 1], bad = _parse_integers(col)
            else:
                sparse[:, i - 1 - NUM_DENSE], bad = _parse_hex(col)
        except _UnsupportedType as exc:
            # Only Parquet columns have types; a wrong one concerns the whole file.
            raise DataFormatError(path, first_line, f"column {name}: {exc}") from None
        if bad is not None and bad.any():
            bad_by_column[i] = bad
    return _Parsed(labels, preprocess_dense(dense_ints), sparse, bad_by_column)


def _reason(batch: pa.RecordBatch, parsed: _Parsed, row: int) -> str:
    """What is wrong with ``row`` of ``batch`` (which ``parsed`` marked bad)."""
    values = [batch.column(i)[row].as_py() for i in range(len(COLUMNS))]
    if all(v is None or v == "" for v in values):
        return f"record is empty (all {len(COLUMNS)} fields missing)"
    column = min(i for i, mask in parsed.bad_by_column.items() if mask[row])
    value = _show(values[column])
    if column == 0:
        return f"label {value} is not 0 or 1"
    if column <= NUM_DENSE:
        return f"column {COLUMNS[column]}: {value} is not an integer"
    return f"column {COLUMNS[column]}: {value} is not 8-digit hex"


# ---------------------------------------------------------------------------------------
# Reader


def _is_parquet(path: str) -> bool:
    return path.lower().endswith((".parquet", ".pq"))


class CriteoReader:
    """Streams Criteo records from TSV, TSV.gz or Parquet files with pyarrow, never the whole file in memory.

    Iterating yields RawBatch of ``batch_rows`` rows; the last batch of each file may be
    shorter. A malformed record raises DataFormatError naming its file and 1-based line
    (Parquet: row) number, unless ``skip_bad_lines``: then it is dropped and counted in
    ``bad_lines`` (reset at the start of each pass over the files). Text that is not UTF-8
    (a binary file, another encoding) stops the parser: a DataFormatError naming the line,
    whether or not bad lines are skipped.
    """

    def __init__(self, paths: Sequence[str], batch_rows: int = 65536, skip_bad_lines: bool = False):
        if isinstance(paths, (str, os.PathLike)):
            paths = [paths]
        if batch_rows < 1:
            raise ConfigError(f"batch_rows = {batch_rows}, must be >= 1")
        self._paths = [os.fspath(p) for p in paths]
        self._batch_rows = batch_rows
        self._skip_bad_lines = skip_bad_lines
        # About one batch of text per parser block; never so small that a long but valid
        # line straddles blocks, never so large that a block costs much memory.
        self._block_bytes = int(min(max(batch_rows * 200, 64 << 10), 32 << 20))
        self.bad_lines = 0

    def __iter__(self) -> Iterator[RawBatch]:
        self.bad_lines = 0
        for path in self._paths:
            chunks = self._read_parquet(path) if _is_parquet(path) else self._read_tsv(path)
            yield from self._rebatch(chunks)

    def _rebatch(self, chunks: Iterator[RawBatch]) -> Iterator[RawBatch]:
        """Cuts a file's chunks of good rows into batches of exactly batch_rows (but the last)."""
        pending: list[RawBatch] = []
        pending_rows = 0
        for chunk in chunks:
            if chunk.num_rows == 0:
                continue
            pending.append(chunk)
            pending_rows += chunk.num_rows
            while pending_rows >= self._batch_rows:
                merged = _concat(pending)
                yield _slice(merged, 0, self._batch_rows)
                pending_rows -= self._batch_rows
                pending = [_slice(merged, self._batch_rows, merged.num_rows)] if pending_rows else []
        if pending_rows:
            yield _concat(pending)

    def _read_parquet(self, path: str) -> Iterator[RawBatch]:
        try:
            pf = pq.ParquetFile(path)
        except pa.ArrowInvalid as exc:  # e.g. a TSV or an empty file named .parquet
            raise DataFormatError(path, 1, f"not a Parquet file: {exc}") from None
        with pf:
            names = pf.schema_arrow.names
            missing = [c for c in COLUMNS if c not in names]
            if missing:
                raise DataFormatError(path, 1, f"missing column(s) {', '.join(missing)}")
            rows_before = 0
            batches = pf.iter_batches(batch_size=self._batch_rows, columns=list(COLUMNS))
            while True:
                try:
                    batch = next(batches)
                except StopIteration:
                    break
                except (pa.ArrowInvalid, OSError) as exc:  # a corrupt page or column chunk
                    raise DataFormatError(path, rows_before + 1, f"unreadable at or after this row: {exc}") from None
                parsed = _parse_batch(batch, path, rows_before + 1)
                bad = parsed.bad_rows()
                if bad is not None:
                    first = int(np.argmax(bad))
                    if not self._skip_bad_lines:
                        raise DataFormatError(path, rows_before + first + 1, _reason(batch, parsed, first))
                    self.bad_lines += int(bad.sum())
                yield parsed.good(bad)
                rows_before += batch.num_rows

    def _read_tsv(self, path: str) -> Iterator[RawBatch]:
        # Lines with the wrong number of fields never reach a batch: the parser reports
        # them to the handler, with their physical line number, and drops them. A key
        # per such line, ``line - 1 - (such lines before it)``, is the count of parsed rows
        # before it, which maps parsed row g to its line: g + 1 + (keys <= g).
        wrong_width: list[tuple[int, int]] = []  # (line, fields)
        keys: list[int] = []

        def on_invalid_row(row: pacsv.InvalidRow) -> str:
            keys.append(row.number - 1 - len(wrong_width))
            wrong_width.append((row.number, row.actual_columns))
            return "skip"  # raised or counted later, in line order with the other errors

        def line_of(parsed_row: int) -> int:
            return parsed_row + 1 + bisect.bisect_right(keys, parsed_row)

        read_options = pacsv.ReadOptions(
            column_names=list(COLUMNS), use_threads=False, block_size=self._block_bytes
        )  # serial parsing is what makes InvalidRow.number known
        parse_options = pacsv.ParseOptions(
            delimiter="\t",
            quote_char=False,
            double_quote=False,
            escape_char=False,
            newlines_in_values=False,
            ignore_empty_lines=False,  # an empty line is a malformed record, and still a line
            invalid_row_handler=on_invalid_row,
        )
        convert_options = pacsv.ConvertOptions(
            column_types={c: pa.string() for c in COLUMNS}, strings_can_be_null=True, null_values=[""]
        )
        parsed_rows = 0
        reported = 0  # wrong-width lines already raised or counted

        def wrong_width_error(k: int) -> DataFormatError:
            line, fields = wrong_width[k]
            return DataFormatError(path, line, f"expected {len(COLUMNS)} columns, got {fields}")

        # A wrong-width line that is not UTF-8 never reaches on_invalid_row: pyarrow fails to
        # decode it for the handler, can only print that, and then stops with a parse error.
        not_utf8: list[UnicodeDecodeError] = []

        def unreadable(exc: Exception, stream: pa.NativeFile) -> Exception:
            error = _unreadable(path, line_of(parsed_rows), exc, stream, bool(not_utf8))
            earlier = not self._skip_bad_lines and reported < len(wrong_width)
            if earlier and isinstance(error, DataFormatError) and wrong_width[reported][0] < error.line:
                return wrong_width_error(reported)  # errors are raised in line order
            return error

        with pa.input_stream(path, compression="detect") as stream:
            try:
                with _decode_errors_of(on_invalid_row, not_utf8):
                    reader = pacsv.open_csv(
                        stream, read_options=read_options, parse_options=parse_options, convert_options=convert_options
                    )
            except (pa.ArrowInvalid, OSError) as exc:
                if str(exc).startswith("Empty CSV file"):
                    return  # no records is a valid, if useless, file
                raise unreadable(exc, stream) from None
            while True:
                try:
                    with _decode_errors_of(on_invalid_row, not_utf8):
                        batch = reader.read_next_batch()
                except StopIteration:
                    break
                except (pa.ArrowInvalid, OSError) as exc:
                    raise unreadable(exc, stream) from None
                n = batch.num_rows
                if n == 0:
                    continue
                parsed = _parse_batch(batch, path, line_of(parsed_rows))
                last_line = line_of(parsed_rows + n - 1)
                upto = reported
                while upto < len(wrong_width) and wrong_width[upto][0] < last_line:
                    upto += 1
                bad = parsed.bad_rows()
                if not self._skip_bad_lines:
                    first_bad = int(np.argmax(bad)) if bad is not None else None
                    first_bad_line = line_of(parsed_rows + first_bad) if first_bad is not None else None
                    if upto > reported and (first_bad_line is None or wrong_width[reported][0] < first_bad_line):
                        raise wrong_width_error(reported)
                    if first_bad is not None:
                        raise DataFormatError(path, first_bad_line, _reason(batch, parsed, first_bad))
                else:
                    self.bad_lines += (upto - reported) + (int(bad.sum()) if bad is not None else 0)
                reported = upto
                parsed_rows += n
                yield parsed.good(bad)
            if reported < len(wrong_width):
                if not self._skip_bad_lines:
                    raise wrong_width_error(reported)
                self.bad_lines += len(wrong_width) - reported


@contextlib.contextmanager
def _decode_errors_of(handler: Callable, caught: list[UnicodeDecodeError]) -> Iterator[None]:
    """Collects into ``caught``, instead of printing "Exception ignored in: ...", the
    UnicodeDecodeError that pyarrow hits, and can only report as unraisable, when it decodes
    a non-UTF-8 line for the invalid-row ``handler``; anything else goes to the usual hook.

    Installed only around the parser calls that run the handler, never across a yield, so
    the interpreter-wide hook is back as it was whenever the reader's caller runs."""
    previous = sys.unraisablehook

    def hook(unraisable) -> None:
        if unraisable.object is handler and isinstance(unraisable.exc_value, UnicodeDecodeError):
            caught.append(unraisable.exc_value)
        else:
            previous(unraisable)

    sys.unraisablehook = hook
    try:
        yield
    finally:
        if sys.unraisablehook is hook:
            sys.unraisablehook = previous


_ROW_NUMBER = re.compile(r"\bRow #(\d+)")  # in pyarrow's CSV errors: the physical line, when parsing serially


def _unreadable(path: str, line: int, exc: Exception, stream: pa.NativeFile, not_utf8: bool = False) -> Exception:
    """What to raise when text cannot be read: bad data, or on a plain file a real I/O error.

    ``line`` is the first line of the block that failed; ``not_utf8`` that the parser met a
    wrong-width line it could not decode (pyarrow's message then quotes its bytes: left out)."""
    message = str(exc)
    if not_utf8 or "invalid UTF8" in message:
        row = _ROW_NUMBER.search(message)
        return DataFormatError(
            path,
            int(row.group(1)) if row else line,
            "not UTF-8 text (binary data or another encoding; is this a Criteo TSV file?); "
            "reading stops here, skip_bad_lines cannot skip it",
        )
    if isinstance(exc, pa.ArrowInvalid) or isinstance(stream, pa.CompressedInputStream):
        # e.g. a line longer than a parser block, a corrupt or truncated .gz
        return DataFormatError(path, line, f"unreadable at or after this line: {message}")
    return exc


def _concat(batches: list[RawBatch]) -> RawBatch:
    if len(batches) == 1:
        return batches[0]
    return RawBatch(
        np.concatenate([b.labels for b in batches]),
        np.concatenate([b.dense for b in batches]),
        np.concatenate([b.sparse for b in batches]),
    )


def _slice(batch: RawBatch, start: int, stop: int) -> RawBatch:
    return RawBatch(batch.labels[start:stop], batch.dense[start:stop], batch.sparse[start:stop])


# ---------------------------------------------------------------------------------------
# Synthetic data


@dataclass(frozen=True)
class GeneratorSummary:
    """What ``generate`` wrote, and how well the hidden click model itself scores."""

    train_path: str
    eval_path: str
    train_rows: int
    eval_rows: int
    ceiling_auc: float  # AUC of the hidden model's click probabilities on the eval split
    positive_rate: float  # fraction of clicks in the train split


_SUFFIXES = {"tsv": ".tsv", "tsv.gz": ".tsv.gz", "parquet": ".parquet"}
_TARGET_POSITIVE_RATE = 0.26
_SPARSE_LOGIT_STD = 1.3  # the categorical effects: the dominant signal
_DENSE_LOGIT_STD = 0.5
_SPARSE_MISSING_MAX = 0.08
_DENSE_MISSING_MAX = 0.3
_NEGATIVE_RATE = 0.005  # of I2 values, which are the only negative ones, as in Criteo
_EFFECT_STATS_RANKS = 1 << 16  # the head of each Zipf law, which holds most of its mass
_CALIBRATION_ROWS = 8192
_STREAM_MODEL, _STREAM_TRAIN, _STREAM_EVAL = 0, 1, 2


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """A well-mixed 64-bit hash of each uint64 (wrapping arithmetic is intended)."""
    z = x + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def _hashed_normal(key: np.ndarray, ranks: np.ndarray) -> np.ndarray:
    """A standard normal per (key, rank), by Box-Muller on the two halves of a hash."""
    h = _splitmix64(key + ranks.astype(np.uint64))
    u1 = ((h >> np.uint64(32)).astype(np.float64) + 0.5) / 2.0**32
    u2 = ((h & np.uint64(0xFFFFFFFF)).astype(np.float64) + 0.5) / 2.0**32
    return np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * np.pi * u2)


def _zipf_mass(ranks: np.ndarray, vocab_rows: int, a: float) -> np.ndarray:
    """P(rank) under the truncated power law that ``_HiddenModel.draw_ranks`` samples."""
    if abs(a - 1.0) < 1e-9:
        cdf = lambda y: np.log(y) / math.log(vocab_rows + 1.0)  # noqa: E731
    else:
        top = (vocab_rows + 1.0) ** (1.0 - a) - 1.0
        cdf = lambda y: (y ** (1.0 - a) - 1.0) / top  # noqa: E731
    return cdf(ranks + 2.0) - cdf(ranks + 1.0)


@dataclass(frozen=True)
class _HiddenModel:
    """The ground truth behind the synthetic data: feature distributions and click model.

    logit = bias + sum_j dense_weight[j] * (pp_j - dense_center[j])
                 + sum_f sparse_scale[f] * (effect(f, rank) - effect_mean[f]) / effect_std[f]
    with pp = log1p(max(x, 0)) as the reader computes it and effect a hashed normal, so no
    table per value is needed. Missing fields contribute 0 (pp = 0 for dense).
    """

    vocab_rows: np.ndarray  # int64 [26]
    zipf_a: float
    sparse_missing: np.ndarray  # [26] probability that a categorical field is empty
    id_keys: np.ndarray  # uint32 [26, 3] odd multipliers of the rank -> id permutation
    effect_keys: np.ndarray  # uint64 [26]
    effect_mean: np.ndarray  # [26] over the feature's Zipf law, so that its term is centred
    effect_std: np.ndarray  # [26]
    sparse_scale: np.ndarray  # [26]
    dense_missing: np.ndarray  # [13]
    dense_log_mean: np.ndarray  # [13] x = floor(exp(N(mean, std))): heavy-tailed counts
    dense_log_std: np.ndarray  # [13]
    dense_center: np.ndarray  # [13]
    dense_weight: np.ndarray  # [13]
    bias: float

    @classmethod
    def create(cls, seed: int, vocab_rows: np.ndarray, zipf_a: float) -> _HiddenModel:
        rng = np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(_STREAM_MODEL,)))
        sparse_missing = rng.uniform(0.0, _SPARSE_MISSING_MAX, NUM_SPARSE)
        id_keys = (rng.integers(0, 2**32, (NUM_SPARSE, 3), dtype=np.uint64) | np.uint64(1)).astype(np.uint32)
        effect_keys = rng.integers(0, 2**64, NUM_SPARSE, dtype=np.uint64, endpoint=False)
        # Exponential strengths: a few features matter a lot, most a little, as in real logs.
        strength = rng.exponential(1.0, NUM_SPARSE)
        sparse_scale = strength * _SPARSE_LOGIT_STD / np.sqrt(np.sum(strength**2 * (1.0 - sparse_missing)))
        effect_mean = np.empty(NUM_SPARSE)
        effect_std = np.empty(NUM_SPARSE)
        for f in range(NUM_SPARSE):
            # Moments over the Zipf law: the head exactly, the thin tail as a standard normal.
            ranks = np.arange(min(int(vocab_rows[f]), _EFFECT_STATS_RANKS))
            mass = _zipf_mass(ranks, int(vocab_rows[f]), zipf_a)
            effect = _hashed_normal(effect_keys[f], ranks)
            tail = max(0.0, 1.0 - float(mass.sum()))
            effect_mean[f] = float(mass @ effect)
            second = float(mass @ effect**2) + tail
            effect_std[f] = math.sqrt(max(second - effect_mean[f] ** 2, 1e-12))
        dense_missing = rng.uniform(0.0, _DENSE_MISSING_MAX, NUM_DENSE)
        dense_log_mean = rng.uniform(0.0, 4.0, NUM_DENSE)
        dense_log_std = rng.uniform(0.8, 2.0, NUM_DENSE)
        dense_weight = rng.normal(0.0, 1.0, NUM_DENSE)
        model = cls(
            vocab_rows=vocab_rows,
            zipf_a=zipf_a,
            sparse_missing=sparse_missing,
            id_keys=id_keys,
            effect_keys=effect_keys,
            effect_mean=effect_mean,
            effect_std=effect_std,
            sparse_scale=sparse_scale,
            dense_missing=dense_missing,
            dense_log_mean=dense_log_mean,
            dense_log_std=dense_log_std,
            dense_center=np.zeros(NUM_DENSE),
            dense_weight=np.ones(NUM_DENSE),
            bias=0.0,
        )
        # Standardize the dense term on a sample of the model's own dense features.
        ints, _ = model.draw_dense(rng, _CALIBRATION_ROWS)
        pp = preprocess_dense(ints).astype(np.float64)
        dense_weight *= _DENSE_LOGIT_STD / np.sqrt(np.sum(dense_weight**2)) / np.maximum(pp.std(axis=0), 1e-6)
        # For logit ~ N(b, s^2), E[sigmoid] ~ sigmoid(b / sqrt(1 + pi s^2 / 8)).
        logit_std = math.hypot(_SPARSE_LOGIT_STD, _DENSE_LOGIT_STD)
        target = _TARGET_POSITIVE_RATE
        bias = math.log(target / (1.0 - target)) * math.sqrt(1.0 + math.pi * logit_std**2 / 8.0)
        return dataclasses.replace(model, dense_center=pp.mean(axis=0), dense_weight=dense_weight, bias=bias)

    def draw_dense(self, rng: np.random.Generator, n_rows: int) -> tuple[np.ndarray, np.ndarray]:
        """-> (int64 [n, 13] values with missing as 0, bool [n, 13] missing)."""
        logs = rng.normal(self.dense_log_mean, self.dense_log_std, (n_rows, NUM_DENSE))
        values = np.floor(np.exp(np.minimum(logs, 20.0))).astype(np.int64)
        negative = rng.random(n_rows) < _NEGATIVE_RATE
        values[:, 1] = np.where(negative, -rng.integers(1, 4, n_rows), values[:, 1])
        missing = rng.random((n_rows, NUM_DENSE)) < self.dense_missing
        values[missing] = 0
        return values, missing

    def draw_ranks(self, rng: np.random.Generator, n_rows: int) -> np.ndarray:
        """int64 [n, 26] value ranks, rank r having probability ~ (r + 1)^-a (inverse CDF)."""
        u = rng.random((n_rows, NUM_SPARSE))
        top = self.vocab_rows.astype(np.float64) + 1.0
        a = self.zipf_a
        if abs(a - 1.0) < 1e-9:
            x = top**u
        else:
            x = (1.0 + u * (top ** (1.0 - a) - 1.0)) ** (1.0 / (1.0 - a))
        return np.clip(np.floor(x).astype(np.int64) - 1, 0, self.vocab_rows - 1)

    def ids(self, ranks: np.ndarray) -> np.ndarray:
        """uint32 ids of ranks: a keyed bijection of rank + 1 that keeps 0 for 'missing'.

        Multiplying by an odd number and xor-shifting are both invertible mod 2^32 and
        both map 0 to 0, so distinct ranks get distinct, non-zero, hash-like ids.
        """
        x = (ranks + 1).astype(np.uint32)
        for k, shift in enumerate((16, 13, 16)):
            x = x * self.id_keys[:, k]
            x ^= x >> np.uint32(shift)
        return x

    def sparse_logits(self, ranks: np.ndarray) -> np.ndarray:
        """float64 [n, 26] each categorical value's contribution to the logit."""
        effect = _hashed_normal(self.effect_keys, ranks)
        return self.sparse_scale * (effect - self.effect_mean) / self.effect_std

    def draw_chunk(self, rng: np.random.Generator, n_rows: int) -> tuple[pa.Table, np.ndarray, np.ndarray]:
        """-> (the rows as a Criteo table, int8 labels, float64 click probabilities)."""
        dense, dense_missing = self.draw_dense(rng, n_rows)
        ranks = self.draw_ranks(rng, n_rows)
        sparse_missing = rng.random((n_rows, NUM_SPARSE)) < self.sparse_missing
        logits = np.where(sparse_missing, 0.0, self.sparse_logits(ranks)).sum(axis=1)
        pp = preprocess_dense(dense).astype(np.float64)
        logits += self.bias + (pp - self.dense_center) @ self.dense_weight
        probs = 1.0 / (1.0 + np.exp(-logits))
        labels = (rng.random(n_rows) < probs).astype(np.int8)
        ids = self.ids(ranks)
        arrays = [pa.array(labels)]
        arrays += [pa.array(dense[:, j], mask=dense_missing[:, j]) for j in range(NUM_DENSE)]
        arrays += [_hex_strings(ids[:, f], sparse_missing[:, f]) for f in range(NUM_SPARSE)]
        return pa.Table.from_arrays(arrays, names=list(COLUMNS)), labels, probs


def _hex_strings(ids: np.ndarray, missing: np.ndarray) -> pa.Array:
    """uint32 ids -> Arrow strings of 8 lowercase hex digits, null where missing."""
    n = len(ids)
    be_bytes = ids.astype(">u4").view(np.uint8).reshape(n, 4)
    chars = np.empty((n, 8), dtype=np.uint8)
    chars[:, 0::2] = _HEX_DIGITS[be_bytes >> 4]
    chars[:, 1::2] = _HEX_DIGITS[be_bytes & 15]
    offsets = np.arange(0, 8 * n + 1, 8, dtype=np.int32)
    null_count = int(missing.sum())
    validity = pa.array(~missing).buffers()[1] if null_count else None
    return pa.Array.from_buffers(
        pa.string(), n, [validity, pa.py_buffer(offsets), pa.py_buffer(chars)], null_count=null_count
    )


_SCHEMA = pa.schema(
    [("label", pa.int8())] + [(c, pa.int64()) for c in DENSE_COLUMNS] + [(c, pa.string()) for c in SPARSE_COLUMNS]
)


def _write_split(
    path: str, fmt: str, model: _HiddenModel, rows: int, chunk_rows: int, rng: np.random.Generator, keep_probs: bool
) -> tuple[int, np.ndarray | None, np.ndarray | None]:
    """Streams ``rows`` rows to ``path`` (atomically) -> (positives, probs, labels if kept)."""
    tmp = f"{path}.tmp{os.getpid()}"
    positives = 0
    probs_kept: list[np.ndarray] = []
    labels_kept: list[np.ndarray] = []
    try:
        if fmt == "parquet":
            sink = pq.ParquetWriter(tmp, _SCHEMA)
            stream = None
        else:
            # Arrow's gzip stream writes mtime 0, which keeps .gz output byte-identical.
            stream = pa.output_stream(tmp, compression="gzip" if fmt == "tsv.gz" else None)
            options = pacsv.WriteOptions(include_header=False, delimiter="\t", quoting_style="none")
            sink = pacsv.CSVWriter(stream, _SCHEMA, write_options=options)
        try:
            for start in range(0, rows, chunk_rows):
                table, labels, probs = model.draw_chunk(rng, min(chunk_rows, rows - start))
                sink.write_table(table)
                positives += int(labels.sum())
                if keep_probs:
                    probs_kept.append(probs)
                    labels_kept.append(labels)
        finally:
            sink.close()
            if stream is not None:
                stream.close()
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    if not keep_probs:
        return positives, None, None
    return positives, np.concatenate(probs_kept), np.concatenate(labels_kept)


def _auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """ROC AUC by the rank-sum (Mann-Whitney) formula, ties given their average rank."""
    positive = labels.astype(bool)
    n_pos = int(positive.sum())
    n_neg = len(positive) - n_pos
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    _, inverse, counts = np.unique(scores, return_inverse=True, return_counts=True)
    mid_ranks = np.cumsum(counts) - (counts - 1) / 2.0
    rank_sum = float(mid_ranks[inverse][positive].sum())
    return (rank_sum - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg)


def generate(
    out_dir: str,
    train_rows: int,
    eval_rows: int,
    fmt: str = "tsv",
    seed: int = 0,
    vocab_rows: Sequence[int] | int = 100_000,
    zipf_a: float = 1.2,
    chunk_rows: int = 100_000,
) -> GeneratorSummary:
    """Writes synthetic Criteo data drawn from a hidden click model, deterministically from ``seed``.

    Files: ``out_dir/train<ext>``, ``out_dir/eval<ext>`` (ext by ``fmt``: .tsv, .tsv.gz,
    .parquet) and ``out_dir/datagen.json`` (the summary, written last). Categorical values
    follow a Zipf law of exponent ``zipf_a`` over ``vocab_rows`` values per feature.
    Train and eval come from the same model through independent random streams.
    """
    if fmt not in _SUFFIXES:
        raise ConfigError(f"fmt = {fmt!r}, must be one of {sorted(_SUFFIXES)}")
    for name, value in (("train_rows", train_rows), ("eval_rows", eval_rows), ("chunk_rows", chunk_rows)):
        if value < 1:
            raise ConfigError(f"{name} = {value}, must be >= 1")
    if not (math.isfinite(zipf_a) and zipf_a > 0):
        raise ConfigError(f"zipf_a = {zipf_a}, must be > 0")
    if isinstance(vocab_rows, (int, np.integer)):
        vocab = np.full(NUM_SPARSE, int(vocab_rows), dtype=np.int64)
    else:
        vocab = np.asarray(vocab_rows, dtype=np.int64)
    if vocab.shape != (NUM_SPARSE,):
        raise ConfigError(f"vocab_rows has {vocab.size} entries, must have {NUM_SPARSE}")
    if (vocab < 1).any() or (vocab > _UINT32_MAX).any():
        raise ConfigError(f"vocab_rows = {vocab.tolist()}, each must be in [1, {_UINT32_MAX}]")

    os.makedirs(out_dir, exist_ok=True)
    model = _HiddenModel.create(seed, vocab, zipf_a)
    train_path = os.path.join(out_dir, "train" + _SUFFIXES[fmt])
    eval_path = os.path.join(out_dir, "eval" + _SUFFIXES[fmt])

    def stream(which: int) -> np.random.Generator:
        return np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(which,)))

    train_positives, _, _ = _write_split(train_path, fmt, model, train_rows, chunk_rows, stream(_STREAM_TRAIN), False)
    _, probs, labels = _write_split(eval_path, fmt, model, eval_rows, chunk_rows, stream(_STREAM_EVAL), True)
    assert probs is not None and labels is not None
    summary = GeneratorSummary(
        train_path=train_path,
        eval_path=eval_path,
        train_rows=train_rows,
        eval_rows=eval_rows,
        ceiling_auc=_auc(probs, labels),
        positive_rate=train_positives / train_rows,
    )
    summary_path = os.path.join(out_dir, "datagen.json")
    with open(f"{summary_path}.tmp{os.getpid()}", "w") as f:
        json.dump(dataclasses.asdict(summary), f, indent=2, sort_keys=True)
        f.write("\n")
    os.replace(f"{summary_path}.tmp{os.getpid()}", summary_path)
    return summary
