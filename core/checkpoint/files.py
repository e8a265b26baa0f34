"""The files of a checkpoint on any ``pyarrow.fs`` storage URI: names, the records a manifest
keeps of them, and their writers, which hash the bytes as they write them and make them
durable before a manifest may commit them.
"""

from __future__ import annotations

import functools
import json
import os
import re
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs

from core.checkpoint.checksum import WRITE_ALGO, new_hasher
from core.checkpoint.rows import ShardRows, to_record_batch

__all__ = [
    "CHECKSUM_ALGO",
    "DATA_POSITION_FILE",
    "DENSE_FILE",
    "FULL",
    "INCREMENTAL",
    "MANIFEST_FILE",
    "MANIFEST_TMP_PREFIX",
    "OBJECT_STORE_TYPES",
    "STEP_DIR_RE",
    "CheckpointInfo",
    "FileEntry",
    "check_file_name",
    "check_step",
    "exists",
    "join",
    "local_path",
    "resolve",
    "shard_file_name",
    "step_dir_name",
    "sync",
    "write_blob",
    "write_shard_file",
]

FULL = "full"
INCREMENTAL = "incremental"
MANIFEST_FILE = "manifest.json"
DENSE_FILE = "dense.pt"
DATA_POSITION_FILE = "data_position.json"

# sha256 runs at ~1.4 GB/s a core on CPUs with SHA-NI (blake2b ~0.6 GB/s there), over 16 MiB
# chunks so that a reader verifies on every core (core.checkpoint.checksum); the algorithm is
# part of every checksum string, so readers keep reading files written with another.
CHECKSUM_ALGO = WRITE_ALGO

STEP_DIR_RE = re.compile(r"^ckpt-(\d{12})$")
_SHARD_FILE_RE = re.compile(r"^shard-(\d+)\.arrow$")
MANIFEST_TMP_PREFIX = f".{MANIFEST_FILE}.tmp-"
# Object stores have no directories and no atomic rename, but a single PUT is atomic.
OBJECT_STORE_TYPES = frozenset({"s3", "gcs", "abfs"})
# Below this, handing a chunk to the hashing thread costs more than hashing it inline.
_PARALLEL_HASH_MIN_BYTES = 1 << 20


@dataclass(frozen=True)
class FileEntry:
    """One file of a checkpoint as its writer produced it."""

    name: str
    size_bytes: int
    checksum: str  # "<algo>:<hex digest>"


@dataclass(frozen=True)
class CheckpointInfo:
    """What a manifest says about one committed checkpoint."""

    step: int
    kind: str  # FULL or INCREMENTAL
    base_step: int | None  # the full checkpoint an incremental builds on
    files: dict[str, FileEntry]
    meta: dict[str, Any] = field(default_factory=dict)
    created_s: float = 0.0  # wall clock, seconds since the epoch

    @property
    def total_bytes(self) -> int:
        return sum(entry.size_bytes for entry in self.files.values())

    @property
    def shard_ids(self) -> list[int]:
        return sorted(int(m.group(1)) for name in self.files if (m := _SHARD_FILE_RE.match(name)))


def step_dir_name(step: int) -> str:
    return f"ckpt-{step:012d}"


def shard_file_name(shard_id: int) -> str:
    return f"shard-{shard_id}.arrow"


def write_shard_file(uri: str, step: int, shard_id: int, data: ShardRows) -> FileEntry:
    """Write one shard's rows of checkpoint ``step`` under ``uri``; returns the entry to commit.

    Called by the shard actor that owns the rows, so they never travel through the
    coordinator. The arrays are handed to Arrow without copies and hashed as they are written.
    """
    step = check_step(step)
    if shard_id < 0:
        raise ValueError(f"shard_id must be >= 0, got {shard_id}")
    batch = to_record_batch(data)

    def produce(sink: _HashingWriter) -> None:
        # Arrow passes its large buffers to the Python sink as pa.Buffer, without copies.
        stream = pa.PythonFile(sink, mode="w")
        with pa.ipc.new_file(stream, batch.schema) as writer:
            writer.write_batch(batch)
        stream.close()

    return _write_file(uri, step, shard_file_name(shard_id), produce)


def write_blob(uri: str, step: int, name: str, payload: bytes | bytearray | memoryview) -> FileEntry:
    """Write opaque bytes (e.g. ``DENSE_FILE`` from torch.save, ``DATA_POSITION_FILE`` JSON)."""
    step = check_step(step)
    _check_blob_name(name)
    return _write_file(uri, step, name, lambda sink: sink.write(payload))


class _HashingWriter:
    """Python file object for ``pa.PythonFile`` that forwards writes and hashes them.

    Large chunks are hashed on a helper thread while the same chunk is written; both
    release the GIL, so the checksum adds little wall time and no re-read of the file.
    """

    def __init__(self, out: pa.NativeFile, pool: ThreadPoolExecutor) -> None:
        self._out = out
        self._pool = pool
        self._hash = new_hasher(CHECKSUM_ALGO)
        self.size_bytes = 0
        self.closed = False

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        if view.nbytes >= _PARALLEL_HASH_MIN_BYTES:
            hashed = self._pool.submit(self._hash.update, view)
            self._out.write(view)
            hashed.result()
        else:
            self._hash.update(view)
            self._out.write(view)
        self.size_bytes += view.nbytes
        return view.nbytes

    def flush(self) -> None:
        pass

    def close(self) -> None:
        # The underlying stream belongs to the caller, which closes it.
        self.closed = True

    def checksum(self) -> str:
        return f"{CHECKSUM_ALGO}:{self._hash.hexdigest()}"


def _write_file(uri: str, step: int, name: str, produce: Callable[[_HashingWriter], object]) -> FileEntry:
    fs, root = resolve(uri)
    directory = join(root, step_dir_name(step))
    if fs.type_name not in OBJECT_STORE_TYPES:
        fs.create_dir(directory, recursive=True)
    if exists(fs, join(directory, MANIFEST_FILE)):
        # Rewriting a file of a committed checkpoint would silently corrupt it.
        raise FileExistsError(f"checkpoint step {step} under {uri} is already committed")
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-hash") as pool:
        # compression=None: the default "detect" would compress by file extension.
        with fs.open_output_stream(join(directory, name), compression=None) as out:
            writer = _HashingWriter(out, pool)
            produce(writer)
    pause_if_slow(fs, root)
    sync(fs, join(directory, name))
    return FileEntry(name=name, size_bytes=writer.size_bytes, checksum=writer.checksum())


SLOW_WRITES_FILE = ".cpr-slow-writes.json"


def pause_if_slow(fs: pafs.FileSystem, root: str) -> None:
    """A slow store (``faults.inject`` kind slow_storage, local stores only): while the fault's
    file under the store's root says so, every file written there takes its ``delay_s`` longer.
    One stat of a local file otherwise."""
    if fs.type_name != "local":
        return
    try:
        with open(os.path.join(root, SLOW_WRITES_FILE), "rb") as f:
            doc = json.loads(f.read())
        remaining = float(doc["until"]) - time.time()
        delay = float(doc["delay_s"])
    except (OSError, ValueError, KeyError, TypeError):
        return
    if remaining > 0:
        time.sleep(min(delay, 600.0))


def sync(fs: pafs.FileSystem, path: str, directory: bool = False) -> None:
    """Makes a local file (or a directory's entries) durable: a manifest commits only files
    that are on disk, not in the page cache of a host that may die. Object stores are
    durable when the upload returns."""
    if fs.type_name != "local":
        return
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@functools.lru_cache(maxsize=32)
def resolve(uri: str) -> tuple[pafs.FileSystem, str]:
    """(filesystem, root path) of ``uri``; cached because object-store clients are costly."""
    path = local_path(uri)
    if path is not None:
        return pafs.LocalFileSystem(), path
    fs, path = pafs.FileSystem.from_uri(uri)
    return fs, path.rstrip("/")


def local_path(uri: str) -> str | None:
    """The absolute local path that ``uri`` names (a plain path or ``file://``), None for an
    object store or another remote filesystem (told apart without contacting it)."""
    if uri.startswith("file://"):
        uri = uri[len("file://"):]
    elif "://" in uri:
        return None
    return os.path.abspath(uri)


def join(*parts: str) -> str:
    return "/".join(p.rstrip("/") for p in parts if p)


def exists(fs: pafs.FileSystem, path: str) -> bool:
    return fs.get_file_info(path).type != pafs.FileType.NotFound


def check_step(step: int) -> int:
    # 12 digits keep the directory names sorting in step order
    if isinstance(step, bool) or not isinstance(step, int | np.integer) or not 0 <= step < 10**12:
        raise ValueError(f"step must be an int in [0, 1e12), got {step!r}")
    return int(step)


def check_file_name(name: str) -> None:
    if not name or name in (".", "..") or "/" in name or "\\" in name or "\0" in name:
        raise ValueError(f"checkpoint file name must be a plain file name, got {name!r}")
    if name == MANIFEST_FILE or name.startswith(MANIFEST_TMP_PREFIX):
        raise ValueError(f"{name!r} is reserved for the manifest")


def _check_blob_name(name: str) -> None:
    check_file_name(name)
    if _SHARD_FILE_RE.match(name):
        raise ValueError(f"{name!r} is reserved for shard files; use write_shard_file")

