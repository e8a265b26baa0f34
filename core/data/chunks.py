"""Input files cut into chunks that workers read independently: an uncompressed TSV file into
byte ranges of about ``chunk_bytes`` (a chunk holds the lines that start inside its range), a
compressed TSV (gzip, bz2, zstd, lz4) or a Parquet file whole. A chunk knows its line numbers only relative to its start;
the lines before it are counted only when a message needs the absolute line.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import pyarrow as pa

from core.data.sources import InputFile, open_filesystem

__all__ = ["Chunk", "lines_before", "open_chunk", "plan_chunks", "whole_file"]

_PROBE = 1 << 16  # bytes read at a time when looking for a line's end


@dataclass(frozen=True)
class Chunk:
    file: InputFile
    start: int = 0
    stop: int | None = None
    """Byte range of a TSV file; None: to the end (and the whole file of a gzip or Parquet one)."""

    @property
    def whole(self) -> bool:
        return self.start == 0 and self.stop is None


def whole_file(uri: str) -> Chunk:
    """A chunk of the whole file at ``uri``, without contacting its storage."""
    name = uri.split("?", 1)[0]
    return Chunk(InputFile(uri, name, 0, 0))


def plan_chunks(files: list[InputFile], chunk_bytes: int) -> list[Chunk]:
    """The chunks of ``files`` in order: a plain TSV file larger than ``chunk_bytes`` in
    ranges of about that size, every other file whole."""
    out: list[Chunk] = []
    for f in files:
        if f.compressed or f.parquet or f.size <= chunk_bytes:
            out.append(Chunk(f))
            continue
        n = -(-f.size // chunk_bytes)
        bounds = [f.size * i // n for i in range(n + 1)]
        out.extend(Chunk(f, a, None if b == f.size else b) for a, b in zip(bounds, bounds[1:]))
    return out


def _line_start_at_or_after(raw: pa.NativeFile, offset: int, size: int) -> int:
    """The first byte at or after ``offset`` that begins a line (``size`` if none does)."""
    if offset == 0:
        return 0
    pos = offset - 1  # a line begins at ``offset`` if the byte before it ends one
    while pos < size:
        block = raw.read_at(min(_PROBE, size - pos), pos)
        i = block.find(b"\n")
        if i >= 0:
            return pos + i + 1
        pos += len(block)
    return size


class _Hashing:
    """A read-only stream that feeds every byte read through it to ``digest``: the bytes a
    parser reads anyway are hashed on their way (pyarrow's CSV reader takes a Python stream)."""

    def __init__(self, stream: pa.NativeFile, digest):
        self._stream, self._digest = stream, digest
        self.closed = False

    def read(self, n: int = -1) -> bytes:
        data = self._stream.read() if n is None or n < 0 else self._stream.read(n)
        self._digest.update(data)
        return data

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def close(self) -> None:
        self.closed = True


@contextlib.contextmanager
def open_chunk(chunk: Chunk, digest=None) -> Iterator[pa.NativeFile]:
    """A stream of the chunk's bytes: its whole lines, decompressed if its name says so.
    ``digest`` (a ``hashlib`` object), if given, is fed every byte read from the stream: the
    chunk's text (a compressed file's decompressed text)."""
    fs, path = open_filesystem(chunk.file.uri)
    if chunk.whole:
        with fs.open_input_stream(path, compression=None) as raw:
            if chunk.file.compressed:
                with pa.CompressedInputStream(raw, chunk.file.compression) as stream:
                    yield stream if digest is None else _Hashing(stream, digest)
            else:
                yield raw if digest is None else _Hashing(raw, digest)
        return
    with fs.open_input_file(path) as raw:
        size = raw.size()
        begin = _line_start_at_or_after(raw, chunk.start, size)
        end = size if chunk.stop is None else _line_start_at_or_after(raw, chunk.stop, size)
        stream = raw.get_stream(begin, max(0, end - begin))
        yield stream if digest is None else _Hashing(stream, digest)


def lines_before(chunk: Chunk) -> int:
    """Lines of the file before the chunk's first line (0 for a whole file); reads them."""
    if chunk.start == 0:
        return 0
    fs, path = open_filesystem(chunk.file.uri)
    with fs.open_input_file(path) as raw:
        begin = _line_start_at_or_after(raw, chunk.start, raw.size())
        count, pos = 0, 0
        while pos < begin:
            block = raw.read_at(min(8 << 20, begin - pos), pos)
            count += block.count(b"\n")
            pos += len(block)
        return count
