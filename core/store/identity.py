"""What a store's inputs are: a cheap fingerprint of each input file, taken whenever a run
resolves its inputs, and the digest of every chunk's bytes, taken while the build reads them.

A store's key covers each file's name, size, modification time and fingerprint (a digest of
its first and last blocks): a file rewritten with other bytes at either end, or another size,
or another time, is another store. A change that keeps all four (bytes rewritten in the
middle, the size and the time restored, as ``cp -p``, ``rsync -a`` or ``tar`` leave them) is
caught by the chunk digests, which the manifest keeps, when the run is asked to read every
byte again (``data.verify_data``, ``cpr train --verify-data``).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from core.data.chunks import Chunk, open_chunk
from core.data.sources import InputFile, open_filesystem

__all__ = [
    "EDGE_BYTES", "TIME_ONLY", "Source", "changed_sources", "chunk_digest", "fingerprint", "new_digest", "parquet_digest",
]

TIME_ONLY = "modified since (same size and ends)"
EDGE_BYTES = 64 << 10  # read at each end of a file for its fingerprint: two ranged reads of an object
_READ = 8 << 20


def new_digest():
    return hashlib.blake2b(digest_size=16)


@dataclass(frozen=True)
class Source:
    """One input file as a store (and a checkpoint's data position) records it."""

    name: str
    size: int
    mtime_ns: int
    edges: str  # digest of the first and last EDGE_BYTES

    def as_dict(self) -> dict:
        return {"name": self.name, "size": self.size, "mtime_ns": self.mtime_ns, "edges": self.edges}

    @classmethod
    def of(cls, raw: dict) -> "Source":
        return cls(str(raw["name"]), int(raw["size"]), int(raw["mtime_ns"]), str(raw["edges"]))


def fingerprint(file: InputFile) -> Source:
    """``file`` as its store's key takes it: size, time, and the digest of its two ends."""
    fs, path = open_filesystem(file.uri)
    h = new_digest()
    with fs.open_input_file(path) as f:
        size = f.size()
        h.update(f.read_at(min(EDGE_BYTES, size), 0))
        if size > EDGE_BYTES:
            tail = min(EDGE_BYTES, size - EDGE_BYTES)
            h.update(f.read_at(tail, size - tail))
    return Source(file.name, size, file.mtime_ns, h.hexdigest())


def chunk_digest(chunk: Chunk) -> str:
    """The digest of the bytes a build reads for ``chunk``: a text chunk's lines (a compressed
    file's text, decompressed), a Parquet file's bytes. The build takes the same digest while
    it parses (core.store.build.write_chunk); this reads the chunk again to check it."""
    if chunk.file.parquet:
        return parquet_digest(chunk.file)
    h = new_digest()
    with open_chunk(chunk, h) as stream:
        while stream.read(_READ):
            pass
    return h.hexdigest()


def parquet_digest(file: InputFile) -> str:
    """A Parquet file's digest: its bytes, read for it (its reader reads by ranges)."""
    h = new_digest()
    fs, path = open_filesystem(file.uri)
    with fs.open_input_stream(path, compression=None) as f:
        while block := f.read(_READ):
            h.update(block)
    return h.hexdigest()


def changed_sources(recorded: list[Source], now: list[Source]) -> list[str]:
    """What differs between the inputs a store (or a checkpoint) recorded and those resolved
    now, one phrase per file: ``data/train.tsv: size 1200 -> 1000``."""
    before, after = {s.name: s for s in recorded}, {s.name: s for s in now}
    out = [f"{name}: no longer an input" for name in before if name not in after]
    out += [f"{name}: a new input" for name in after if name not in before]
    for name in (n for n in after if n in before):
        a, b = before[name], after[name]
        if a.size != b.size:
            out.append(f"{name}: size {a.size} -> {b.size}")
        elif a.edges != b.edges:
            out.append(f"{name}: its first or last {EDGE_BYTES >> 10} KiB changed")
        elif a.mtime_ns != b.mtime_ns:
            out.append(f"{name}: {TIME_ONLY}")
    if not out and [s.name for s in recorded] != [s.name for s in now]:
        out.append("the same files in another order: " + ", ".join(s.name for s in now))
    return out
