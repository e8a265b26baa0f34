"""The streaming reader of Criteo click logs: TSV, TSV.gz and Parquet files into batches of
model-ready rows, never a whole file in memory, with the exact line (Parquet: row) of
each malformed record.
"""

from __future__ import annotations

import bisect
import contextlib
import os
import re
import sys
from collections.abc import Callable, Iterator, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from core.data.chunks import Chunk, lines_before, open_chunk, whole_file
from core.data.criteo import COLUMNS, RawBatch, bad_row_reason, parse_batch
from core.data.sources import InputFile, open_filesystem
from core.errors import ConfigError, DataFormatError

__all__ = ["CriteoReader"]


class CriteoReader:
    """Streams Criteo records from TSV, TSV.gz or Parquet files with pyarrow, never the whole file in memory.

    ``paths`` are local paths or ``pyarrow.fs`` URIs (core.data.sources), resolved files or
    chunks of them (core.data.chunks); messages name a file by its URI without options. Iterating yields RawBatch of ``batch_rows`` rows; the last batch of each file may be
    shorter. A malformed record raises DataFormatError naming its file and 1-based line
    (Parquet: row) number, unless ``skip_bad_lines``: then it is dropped and counted in
    ``bad_lines`` (reset at the start of each pass over the files). Text that is not UTF-8
    (a binary file, another encoding) stops the parser: a DataFormatError naming the line,
    whether or not bad lines are skipped.
    """

    def __init__(self, paths: Sequence[str | InputFile | Chunk] | str, batch_rows: int = 65536,
                 skip_bad_lines: bool = False, digest=None):
        if isinstance(paths, (str, os.PathLike, InputFile, Chunk)):
            paths = [paths]
        if batch_rows < 1:
            raise ConfigError(f"batch_rows = {batch_rows}, must be >= 1")
        self._chunks = [_as_chunk(p) for p in paths]
        self._batch_rows = batch_rows
        self._skip_bad_lines = skip_bad_lines
        self._digest = digest  # a hashlib object fed the text of every TSV chunk read (core.store.build)
        # About one batch of text per parser block; never so small that a long but valid
        # line straddles blocks, never so large that a block costs much memory.
        self._block_bytes = int(min(max(batch_rows * 200, 64 << 10), 32 << 20))
        self.bad_lines = 0

    def __iter__(self) -> Iterator[RawBatch]:
        self.bad_lines = 0
        for chunk in self._chunks:
            parts = self._read_parquet(chunk.file) if chunk.file.parquet else self._read_tsv(chunk)
            try:
                yield from self._rebatch(parts)
            except DataFormatError as err:
                if chunk.start == 0:
                    raise
                # a chunk's lines are numbered from its start: the message names the file's line
                raise DataFormatError(err.path, err.line + lines_before(chunk), err.reason) from None

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

    def _read_parquet(self, file: InputFile) -> Iterator[RawBatch]:
        path = file.name
        fs, fs_path = open_filesystem(file.uri)
        stream = fs.open_input_file(fs_path)  # a missing or unreadable file is an OSError, not bad data
        try:
            pf = pq.ParquetFile(stream)
            names = pf.schema_arrow.names
        except _PARQUET_ERRORS as exc:  # e.g. a TSV, an empty or truncated file, a garbage footer
            stream.close()
            _raise_unless_os_error(exc)
            raise DataFormatError(path, 1, f"not a Parquet file: {_one_line(exc)}") from None
        with pf:
            _check_columns(path, names)
            rows_before = 0
            batches = pf.iter_batches(batch_size=self._batch_rows, columns=list(COLUMNS))
            while True:
                try:
                    batch = next(batches)
                except StopIteration:
                    break
                except _PARQUET_ERRORS as exc:  # a corrupt page or column chunk
                    _raise_unless_os_error(exc)
                    raise DataFormatError(
                        path, rows_before + 1, f"unreadable at or after this row: {_one_line(exc)}"
                    ) from None
                parsed = parse_batch(batch, path, rows_before + 1)
                bad = parsed.bad_rows()
                if bad is not None:
                    first = int(np.argmax(bad))
                    if not self._skip_bad_lines:
                        raise DataFormatError(path, rows_before + first + 1, bad_row_reason(batch, parsed, first))
                    self.bad_lines += int(bad.sum())
                yield parsed.good(bad)
                rows_before += batch.num_rows

    def _read_tsv(self, chunk: Chunk) -> Iterator[RawBatch]:
        path = chunk.file.name
        tsv = _TsvFile(path, self._skip_bad_lines)
        # serial parsing is what makes InvalidRow.number known
        read_options = pacsv.ReadOptions(column_names=list(COLUMNS), use_threads=False, block_size=self._block_bytes)
        with open_chunk(chunk, self._digest) as stream:
            try:
                with _decode_errors_of(tsv.handler, tsv.not_utf8):
                    reader = pacsv.open_csv(
                        stream, read_options=read_options, parse_options=tsv.parse_options(),
                        convert_options=_CONVERT_OPTIONS,
                    )
            except (pa.ArrowInvalid, OSError) as exc:
                if str(exc).startswith("Empty CSV file"):
                    return  # no records is a valid, if useless, file
                raise tsv.unreadable(exc, chunk.file.compressed) from None
            while True:
                try:
                    with _decode_errors_of(tsv.handler, tsv.not_utf8):
                        batch = reader.read_next_batch()
                except StopIteration:
                    break
                except (pa.ArrowInvalid, OSError) as exc:
                    raise tsv.unreadable(exc, chunk.file.compressed) from None
                if batch.num_rows == 0:
                    continue
                good, dropped = tsv.take(batch)
                self.bad_lines += dropped
                yield good
            self.bad_lines += tsv.finish()


# What pyarrow raises on a Parquet file's corrupt bytes: its own errors (a thrift decoding
# error is an OSError), and a UnicodeDecodeError on names or metadata that are not UTF-8.
_PARQUET_ERRORS = (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError, OSError, UnicodeDecodeError)


def _raise_unless_os_error(exc: Exception) -> None:
    """Re-raises an OSError that carries an errno: the operating system's (a disk, a
    permission), not the file's content; pyarrow's own errors about the bytes carry none."""
    if isinstance(exc, OSError) and exc.errno is not None:
        raise exc


def _one_line(exc: Exception) -> str:
    """pyarrow's message on one line and printable: thrift's end in a newline, and some
    quote the file's bytes, which are escaped."""
    text = " ".join(str(exc).split())
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)


def _check_columns(path: str, names: list[str]) -> None:
    """Every Criteo column, each once: the reader takes columns by name, and a name twice
    would shift every column after it. Other columns are allowed and not read."""
    missing = [c for c in COLUMNS if c not in names]
    if missing:
        raise DataFormatError(path, 1, f"missing column(s) {', '.join(missing)}")
    repeated = [f"column {c} appears {names.count(c)} times" for c in COLUMNS if names.count(c) > 1]
    if repeated:
        raise DataFormatError(path, 1, "; ".join(repeated))


_CONVERT_OPTIONS = pacsv.ConvertOptions(
    column_types={c: pa.string() for c in COLUMNS}, strings_can_be_null=True, null_values=[""]
)


class _TsvFile:
    """One pass over a TSV file: the lines the parser dropped, and each parsed row's line.

    Lines with the wrong number of fields never reach a batch: the parser reports them to
    ``handler``, with their physical line number, and drops them. A key per such line,
    ``line - 1 - (such lines before it)``, is the count of parsed rows before it, which maps
    parsed row g to its line: g + 1 + (keys <= g). They are raised (or counted) in line
    order with the malformed records the batches hold.
    """

    def __init__(self, path: str, skip_bad_lines: bool) -> None:
        self.path = path
        self._skip_bad_lines = skip_bad_lines
        self._wrong_width: list[tuple[int, int]] = []  # (line, fields)
        self._keys: list[int] = []
        self._parsed_rows = 0
        self._reported = 0  # wrong-width lines already raised or counted
        # A wrong-width line that is not UTF-8 never reaches the handler: pyarrow fails to
        # decode it for the handler, can only print that, and then stops with a parse error.
        self.not_utf8: list[UnicodeDecodeError] = []
        # Bound once: _decode_errors_of tells the handler's errors apart by identity.
        self.handler = self._on_invalid_row

    def parse_options(self) -> pacsv.ParseOptions:
        return pacsv.ParseOptions(
            delimiter="\t",
            quote_char=False,
            double_quote=False,
            escape_char=False,
            newlines_in_values=False,
            ignore_empty_lines=False,  # an empty line is a malformed record, and still a line
            invalid_row_handler=self.handler,
        )

    def _on_invalid_row(self, row: pacsv.InvalidRow) -> str:
        self._keys.append(row.number - 1 - len(self._wrong_width))
        self._wrong_width.append((row.number, row.actual_columns))
        return "skip"  # raised or counted later, in line order with the other errors

    def _line_of(self, parsed_row: int) -> int:
        return parsed_row + 1 + bisect.bisect_right(self._keys, parsed_row)

    def _wrong_width_error(self, k: int) -> DataFormatError:
        line, fields = self._wrong_width[k]
        return DataFormatError(self.path, line, f"expected {len(COLUMNS)} columns, got {fields}")

    def unreadable(self, exc: Exception, compressed: bool) -> Exception:
        """What to raise when the parser fails: its error, or a wrong-width line before it."""
        error = _unreadable(self.path, self._line_of(self._parsed_rows), exc, compressed, bool(self.not_utf8))
        earlier = not self._skip_bad_lines and self._reported < len(self._wrong_width)
        if earlier and isinstance(error, DataFormatError) and self._wrong_width[self._reported][0] < error.line:
            return self._wrong_width_error(self._reported)  # errors are raised in line order
        return error

    def take(self, batch: pa.RecordBatch) -> tuple[RawBatch, int]:
        """(the good rows of the next non-empty ``batch``, bad lines dropped up to its last row).

        Raises the first bad line's DataFormatError instead, unless bad lines are skipped."""
        n = batch.num_rows
        parsed = parse_batch(batch, self.path, self._line_of(self._parsed_rows))
        last_line = self._line_of(self._parsed_rows + n - 1)
        upto = self._reported
        while upto < len(self._wrong_width) and self._wrong_width[upto][0] < last_line:
            upto += 1
        bad = parsed.bad_rows()
        dropped = 0
        if not self._skip_bad_lines:
            first_bad = int(np.argmax(bad)) if bad is not None else None
            first_bad_line = self._line_of(self._parsed_rows + first_bad) if first_bad is not None else None
            wrong_width_first = upto > self._reported and (
                first_bad_line is None or self._wrong_width[self._reported][0] < first_bad_line
            )
            if wrong_width_first:
                raise self._wrong_width_error(self._reported)
            if first_bad is not None:
                raise DataFormatError(self.path, first_bad_line, bad_row_reason(batch, parsed, first_bad))
        else:
            dropped = (upto - self._reported) + (int(bad.sum()) if bad is not None else 0)
        self._reported = upto
        self._parsed_rows += n
        return parsed.good(bad), dropped

    def finish(self) -> int:
        """The wrong-width lines after the last batch: the first raised, or their count if skipped."""
        if self._reported < len(self._wrong_width) and not self._skip_bad_lines:
            raise self._wrong_width_error(self._reported)
        return len(self._wrong_width) - self._reported


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


def _unreadable(path: str, line: int, exc: Exception, compressed: bool, not_utf8: bool = False) -> Exception:
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
    if isinstance(exc, pa.ArrowInvalid) or compressed:
        # e.g. a line longer than a parser block, a corrupt or truncated .gz
        return DataFormatError(path, line, f"unreadable at or after this line: {message}")
    return exc


def _as_chunk(source: str | os.PathLike | InputFile | Chunk) -> Chunk:
    if isinstance(source, Chunk):
        return source
    if isinstance(source, InputFile):
        return Chunk(source)
    return whole_file(os.fspath(source))


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

