"""Criteo's record layout (a label, 13 integer and 26 categorical columns) and the vectorized
conversion of Arrow columns into model-ready arrays, with a bad-row mask per column from
which exact error messages are built only when a record is malformed.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from core.errors import ConfigError, DataFormatError

__all__ = [
    "COLUMNS",
    "DENSE_COLUMNS",
    "NUM_DENSE",
    "NUM_SPARSE",
    "SPARSE_COLUMNS",
    "ParsedBatch",
    "RawBatch",
    "bad_row_reason",
    "parse_batch",
    "preprocess_dense",
    "sparse_to_rows",
]

NUM_DENSE = 13
NUM_SPARSE = 26
DENSE_COLUMNS = tuple(f"I{i}" for i in range(1, NUM_DENSE + 1))
SPARSE_COLUMNS = tuple(f"C{i}" for i in range(1, NUM_SPARSE + 1))
COLUMNS = ("label", *DENSE_COLUMNS, *SPARSE_COLUMNS)

_INT64_MIN = -(2**63)
_INT64_MAX = 2**63 - 1

# ASCII byte -> hex nibble; 0xFF marks a byte that is not a hex digit, so a row holds
# one exactly when some byte of its nibbles has a high bit set.
_HEX_NIBBLE = np.full(256, 0xFF, dtype=np.uint8)
for _i, _c in enumerate(b"0123456789abcdef"):
    _HEX_NIBBLE[_c] = _i
for _i, _c in enumerate(b"ABCDEF"):
    _HEX_NIBBLE[_c] = 10 + _i
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


def _one_byte_each(strings: pa.Array) -> np.ndarray | None:
    """uint8 [n, 1] of a string column whose every value is one byte long, else None."""
    offset_type = np.int64 if pa.types.is_large_string(strings.type) else np.int32
    offsets = np.frombuffer(strings.buffers()[1], dtype=offset_type)[strings.offset : strings.offset + len(strings) + 1]
    if len(strings) == 0 or not (np.diff(offsets) == 1).all():
        return None
    return _fixed_width_bytes(strings, 1)


def _mask(values: pa.Array, fill: bool) -> np.ndarray:
    """A boolean Arrow array as numpy, nulls replaced by ``fill``."""
    return pc.fill_null(values, fill).to_numpy(zero_copy_only=False)


def _zeros_and_ones(col: pa.Array, zero: object, one: object) -> tuple[np.ndarray, np.ndarray]:
    """-> (float32 labels, bad mask): values equal to ``one`` are 1, to ``zero`` 0, any other bad."""
    ones = _mask(pc.equal(col, one), False)
    zeros = _mask(pc.equal(col, zero), False)
    return ones.astype(np.float32), ~(ones | zeros)


def _parse_labels(col: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """-> (float32 labels, bad mask). Only 0 and 1 are labels; missing is bad."""
    strings = _as_strings(col)
    if strings is not None:
        chars = _one_byte_each(strings) if strings.null_count == 0 else None
        if chars is not None:  # every label one character: compared as bytes, without Arrow kernels
            ones, zeros = chars[:, 0] == ord("1"), chars[:, 0] == ord("0")
            return ones.astype(np.float32), ~(ones | zeros)
        return _zeros_and_ones(strings, "0", "1")
    if pa.types.is_boolean(col.type):
        return _zeros_and_ones(col, False, True)
    if pa.types.is_integer(col.type):
        # compared in the column's own type: a cast to float64 fails on a uint64 above 2**53
        return _zeros_and_ones(col, pa.scalar(0, col.type), pa.scalar(1, col.type))
    if pa.types.is_floating(col.type):
        return _zeros_and_ones(col, 0.0, 1.0)  # NaN and infinities equal neither: bad
    raise _UnsupportedType(f"type {col.type} is not supported, expected integer or string")


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


def _from_integer_type(col: pa.Array) -> tuple[np.ndarray, np.ndarray | None]:
    """A Parquet integer column as int64 (missing as 0): only uint64 can hold values that do
    not fit, and those are bad rows, as an overflowing count in a TSV line is."""
    bad = None
    if pa.types.is_uint64(col.type):
        too_big = _mask(pc.greater(col, pa.scalar(_INT64_MAX, col.type)), False)
        if too_big.any():
            col = pc.if_else(pa.array(too_big), pa.scalar(None, col.type), col)
            bad = too_big
    return pc.fill_null(pc.cast(col, pa.int64()), 0).to_numpy(zero_copy_only=False), bad


def _parse_integers(col: pa.Array) -> tuple[np.ndarray, np.ndarray | None]:
    """-> (int64 values with missing as 0, bad mask or None if every value is fine)."""
    if pa.types.is_integer(col.type):
        return _from_integer_type(col)
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


def _decode_hex8(chars: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """uint8 [n, 8] ASCII -> (uint32 ids, mask of rows holding a byte that is not a hex digit)."""
    nibbles = np.take(_HEX_NIBBLE, chars)
    bad = (np.ascontiguousarray(nibbles).view(np.uint64).ravel() & _NOT_NIBBLE_BITS) != 0
    packed = (nibbles[:, 0::2] << 4) | nibbles[:, 1::2]  # [n, 4] bytes, most significant first
    return packed.view(">u4")[:, 0].astype(np.uint32), bad


def _hex_of_full_width(strings: pa.Array) -> tuple[np.ndarray, np.ndarray | None] | None:
    """The common case, decoded straight from the column's buffers: every value 8 bytes or
    missing (null or empty). None when some value has another length."""
    n = len(strings)
    offset_type = np.int64 if pa.types.is_large_string(strings.type) else np.int32
    _, offsets_buf, data_buf = strings.buffers()
    offsets = np.frombuffer(offsets_buf, dtype=offset_type)[strings.offset : strings.offset + n + 1]
    lengths = np.diff(offsets)
    present = lengths == 8
    if not (present | (lengths == 0)).all():
        return None
    if strings.null_count and (lengths[~_mask(pc.is_valid(strings), False)] != 0).any():
        return None  # a null slot holding bytes (Arrow allows it): the general path
    ids = np.zeros(n, dtype=np.uint32)
    if not present.any():
        return ids, None
    # Missing values take no bytes: the present ones lie back to back, 8 bytes each.
    chars = np.frombuffer(data_buf, dtype=np.uint8)[int(offsets[0]) : int(offsets[-1])].reshape(-1, 8)
    values, bad = _decode_hex8(chars)
    ids[present] = values
    if not bad.any():
        return ids, None
    mask = np.zeros(n, dtype=bool)
    mask[present] = bad
    return ids, mask


def _parse_hex(col: pa.Array) -> tuple[np.ndarray, np.ndarray | None]:
    """-> (uint32 ids with missing as 0, bad mask or None). An id is exactly 8 hex digits:
    a shorter value is no id but, e.g., the last field of a file cut short."""
    strings = _as_strings(col)
    if strings is None:
        raise _UnsupportedType(f"type {col.type} is not supported, expected string")
    fast = _hex_of_full_width(strings)
    if fast is not None:
        return fast
    # Some value has another width (in bytes: a multi-byte character never makes a hex digit),
    # or a null slot holds bytes. Such values are bad; as missing, they leave the fast path's layout.
    strings = pc.fill_null(strings, "")
    lengths = pc.binary_length(strings).to_numpy(zero_copy_only=False)
    wrong_width = (lengths != 0) & (lengths != 8)
    if wrong_width.any():
        strings = pc.if_else(pa.array(wrong_width), "", strings)
    decoded = _hex_of_full_width(strings)
    assert decoded is not None
    ids, not_hex = decoded
    bad = wrong_width if not_hex is None else wrong_width | not_hex
    return ids, (bad if bad.any() else None)


@dataclass(frozen=True)
class ParsedBatch:
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


def parse_batch(batch: pa.RecordBatch, path: str, first_line: int) -> ParsedBatch:
    """Converts every column of ``batch``; ``first_line`` is its first record's line (Parquet: row)."""
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
    return ParsedBatch(labels, preprocess_dense(dense_ints), sparse, bad_by_column)


def _beyond_int64(value: object) -> bool:
    """Whether a dense value is a whole number (a Parquet integer, or decimal digits) out of int64's range."""
    if isinstance(value, str):
        if not re.fullmatch(r"-?[0-9]+", value):
            return False
        value = int(value)
    return isinstance(value, int) and not _INT64_MIN <= value <= _INT64_MAX


def bad_row_reason(batch: pa.RecordBatch, parsed: ParsedBatch, row: int) -> str:
    """What is wrong with ``row`` of ``batch`` (which ``parsed`` marked bad)."""
    values = [batch.column(i)[row].as_py() for i in range(len(COLUMNS))]
    if all(v is None or v == "" for v in values):
        return f"record is empty (all {len(COLUMNS)} fields missing)"
    column = min(i for i, mask in parsed.bad_by_column.items() if mask[row])
    value = _show(values[column])
    if column == 0:
        return f"label {value} is not 0 or 1"
    if column <= NUM_DENSE:
        if _beyond_int64(values[column]):
            return f"column {COLUMNS[column]}: {value} does not fit a 64-bit signed integer"
        return f"column {COLUMNS[column]}: {value} is not an integer"
    return f"column {COLUMNS[column]}: {value} is not 8-digit hex"

