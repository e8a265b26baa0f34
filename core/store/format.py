"""The store's files: the microbatch schema, the key that says which inputs and options a
store holds, its manifest, and the writing of a chunk's rows into whole microbatches (what a
preprocessing task runs; no Ray here).
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from dataclasses import asdict, dataclass, field, replace

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs

from core.data.criteo import NUM_DENSE, NUM_SPARSE, RawBatch
from core.data.sources import open_filesystem, shown
from core.errors import ConfigError
from core.store.identity import Source

__all__ = [
    "MANIFEST_FILE", "SCHEMA", "Mapping", "PartWriter", "StoreManifest", "join", "manifest_exists", "publish_manifest",
    "read_manifest", "record_batch", "store_key", "unpack",
]

FORMAT_VERSION = 4  # 4: each build in a directory of its own with its own manifest, inputs by content
MANIFEST_FILE = "store.json"
SCHEMA = pa.schema([
    ("label", pa.float32()), ("dense", pa.list_(pa.float32(), NUM_DENSE)), ("sparse", pa.list_(pa.uint32(), NUM_SPARSE)),
])


def join(base: str, name: str) -> str:
    return f"{base.rstrip('/')}/{name}"


@dataclass(frozen=True)
class Mapping:
    """How a raw categorical id becomes a row of its table.

    ``hash``: ``id mod table_rows[f]`` (DLRM's ``max_ind_range``). ``vocab``: values seen at
    least ``min_count`` times in the training data get rows 1..K of their table in value
    order, every other value (rare, or unseen in training) shares row 0; ``table_rows`` is
    then K + 1 per feature, known once the training data is counted."""

    kind: str
    table_rows: tuple[int, ...] = ()
    min_count: int = 0

    def map_ids(self, sparse: np.ndarray) -> np.ndarray:
        """Raw ids -> rows (hash only; a vocabulary maps through core.store.vocab)."""
        rows = np.asarray(self.table_rows, dtype=np.uint64)
        return (sparse.astype(np.uint64) % rows).astype(np.uint32)


@dataclass(frozen=True)
class StoreManifest:
    """What ``store.json`` says: the parts in order with their microbatch counts, and how the
    store was made. A build writes its files into a directory of its own (``dir``, inside the
    store's), with a manifest there that names them from there; the store's manifest, which
    publishes the build, names them from the store's directory (``under``). A run reads the
    build it started with (its own manifest): no file a reader may hold is ever rewritten."""

    key: str
    microbatch_rows: int
    rows: int
    parts: list[dict]  # {"file", "microbatches"}: the file relative to the manifest
    bad_lines: int
    mapping: dict
    sources: list[str]  # the input files' names, in order
    dir: str = ""  # the build's directory, in the store's
    vocab: str | None = None  # the vocabulary's file, relative to the manifest (mapping vocab)
    inputs: list[dict] = field(default_factory=list)  # Source.as_dict() of each input, in order
    chunks: list[dict] = field(default_factory=list)  # {"file", "start", "stop", "digest"} in order
    build: dict = field(default_factory=dict)  # seconds, rows/s, per-host work: for the report
    replaced: list[dict] = field(default_factory=list)  # {"dir", "at"}: builds of older bytes, kept for their readers

    @property
    def microbatches(self) -> int:
        return sum(p["microbatches"] for p in self.parts)

    @property
    def content(self) -> str:
        """A digest of the bytes the store was built from (its chunks' digests, in order): two
        builds of the same bytes have the same content, whatever their files' times."""
        h = hashlib.blake2b(digest_size=10)
        for c in self.chunks:
            h.update(f"{c['start']}|{c['stop']}|{c['digest']};".encode())
        return h.hexdigest()

    def under(self, prefix: str) -> "StoreManifest":
        """This manifest as a directory ``prefix`` above its own reads it: every path prefixed."""
        return replace(self, parts=[{**p, "file": f"{prefix}/{p['file']}"} for p in self.parts],
                       vocab=f"{prefix}/{self.vocab}" if self.vocab else None)


def store_key(sources: list[Source], options: dict) -> str:
    """Names a store by its inputs (name, size, modification time and the digest of each
    file's ends, core.store.identity) and the options that shape its contents: changed data or
    options make another store."""
    h = hashlib.blake2b(digest_size=10)
    h.update(json.dumps([FORMAT_VERSION, options], sort_keys=True).encode())
    for s in sources:
        h.update(f"{s.name}|{s.size}|{s.mtime_ns}|{s.edges}".encode())
    return h.hexdigest()


def publish_manifest(uri: str, manifest: StoreManifest, replace: bool = False) -> bool:
    """Publishes the store at ``uri``: its manifest written whole (a store exists once its
    manifest does). Without ``replace``, only if no build published one first: True if this
    one is the store now, False if another was (the caller then uses that one). A local file is
    linked into place, which fails if one exists (atomic); an object store has no such PUT
    here, so the check before it leaves a window, in which the last writer wins (both stores
    hold the same rows: the key is the same)."""
    fs, path = open_filesystem(uri, "data.cache_dir")
    target = join(path, MANIFEST_FILE)
    payload = json.dumps({"version": FORMAT_VERSION, **asdict(manifest)}, indent=1).encode()
    if not isinstance(fs, pafs.LocalFileSystem):
        if not replace and fs.get_file_info(target).type == pafs.FileType.File:
            return False
        with fs.open_output_stream(target, compression=None) as f:
            f.write(payload)
        return True
    os.makedirs(path, exist_ok=True)
    tmp = f"{target}.tmp{os.getpid()}-{uuid.uuid4().hex[:8]}"
    with open(tmp, "wb") as f:
        f.write(payload)
    try:
        if replace:
            os.replace(tmp, target)
            return True
        try:
            os.link(tmp, target)
        except FileExistsError:
            return False
        return True
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def manifest_exists(uri: str) -> bool:
    """Whether the store at ``uri`` has a manifest, of any version."""
    fs, path = open_filesystem(uri, "data.cache_dir")
    return fs.get_file_info(join(path, MANIFEST_FILE)).type == pafs.FileType.File


def read_manifest(uri: str) -> StoreManifest | None:
    """The manifest of the store at ``uri``, None if there is none (or an older format)."""
    fs, path = open_filesystem(uri, "data.cache_dir")
    try:
        with fs.open_input_stream(join(path, MANIFEST_FILE), compression=None) as f:
            raw = json.loads(f.read())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        where = join(shown(uri), MANIFEST_FILE)
        raise ConfigError(f"data.cache_dir: the store manifest {where} is unreadable: {exc}") from None
    if not isinstance(raw, dict) or raw.get("version") != FORMAT_VERSION:
        return None
    raw.pop("version", None)
    try:
        return StoreManifest(**raw)
    except TypeError:  # fields of another build of this version: rebuilt
        return None


def unpack(rb: pa.RecordBatch) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A microbatch's arrays: labels float32 [B], dense float32 [B, 13], sparse uint32 [B, 26]."""
    return (rb.column(0).to_numpy(), rb.column(1).values.to_numpy().reshape(-1, NUM_DENSE),
            rb.column(2).values.to_numpy().reshape(-1, NUM_SPARSE))


def record_batch(labels: np.ndarray, dense: np.ndarray, sparse: np.ndarray) -> pa.RecordBatch:
    return pa.record_batch(
        [
            pa.array(labels, type=pa.float32()),
            pa.FixedSizeListArray.from_arrays(pa.array(dense.reshape(-1), type=pa.float32()), NUM_DENSE),
            pa.FixedSizeListArray.from_arrays(pa.array(sparse.reshape(-1), type=pa.uint32()), NUM_SPARSE),
        ],
        schema=SCHEMA,
    )


class PartWriter:
    """Cuts the rows it is given into whole microbatches of ``microbatch_rows``, written as the
    record batches of one IPC file (opened at the first whole one); ``close`` returns the
    rows left over, fewer than one microbatch."""

    def __init__(self, fs: pafs.FileSystem, path: str, microbatch_rows: int):
        self._fs, self._path, self._rows = fs, path, microbatch_rows
        self._sink = self._writer = None
        self._carry: RawBatch | None = None
        self.microbatches = 0

    def add(self, batch: RawBatch) -> None:
        parts = (batch.labels, batch.dense, batch.sparse)
        if self._carry is not None:
            parts = tuple(np.concatenate([c, p]) for c, p in zip(
                (self._carry.labels, self._carry.dense, self._carry.sparse), parts))
            self._carry = None
        n = len(parts[0])
        full = n - n % self._rows
        for start in range(0, full, self._rows):
            sl = slice(start, start + self._rows)
            self._write(record_batch(*(p[sl] for p in parts)))
        if full < n:
            self._carry = RawBatch(*(p[full:] for p in parts))

    def write_short(self, batch: RawBatch) -> None:
        """A last microbatch shorter than the others (evaluation data keeps its tail)."""
        self._write(record_batch(batch.labels, batch.dense, batch.sparse))

    def _write(self, rb: pa.RecordBatch) -> None:
        if self._writer is None:
            if isinstance(self._fs, pafs.LocalFileSystem):
                os.makedirs(os.path.dirname(self._path), exist_ok=True)
            self._sink = self._fs.open_output_stream(self._path, compression=None)
            self._writer = pa.ipc.new_file(self._sink, SCHEMA)
        self._writer.write_batch(rb)
        self.microbatches += 1

    def close(self, keep_short: bool = False) -> RawBatch | None:
        """Closes the file; ``keep_short`` first writes the rows left over as a last, shorter
        microbatch (evaluation data keeps its tail), else they are returned."""
        if keep_short and self._carry is not None:
            self.write_short(self._carry)
            self._carry = None
        if self._writer is not None:
            self._writer.close()
            self._sink.close()
        carry, self._carry = self._carry, None
        return carry
