"""Checkpoint files of sharded DLRM training on any ``pyarrow.fs`` storage URI.

Shard actors write their own Arrow IPC shard files; the coordinator commits a manifest
(sizes and checksums, written last) that makes a checkpoint exist, then applies retention.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import re
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs

from core.errors import CheckpointCorrupt, CheckpointNotFound, ConfigError

__all__ = [
    "CHECKSUM_ALGO",
    "DATA_POSITION_FILE",
    "DENSE_FILE",
    "FULL",
    "INCREMENTAL",
    "MANIFEST_FILE",
    "CheckpointInfo",
    "CheckpointStore",
    "FileEntry",
    "ShardRows",
    "local_path",
    "merge_shard_rows",
    "shard_file_name",
    "step_dir_name",
    "warm_up",
    "write_blob",
    "write_shard_file",
]

logger = logging.getLogger(__name__)

FULL = "full"
INCREMENTAL = "incremental"
MANIFEST_FILE = "manifest.json"
DENSE_FILE = "dense.pt"
DATA_POSITION_FILE = "data_position.json"

# sha256 runs at ~1.4 GB/s on CPUs with SHA-NI (blake2b ~0.6 GB/s there); the algorithm
# is part of every checksum string, so readers keep working if it ever changes.
CHECKSUM_ALGO = "sha256"

_FORMAT_VERSION = 1
_STEP_DIR_RE = re.compile(r"^ckpt-(\d{12})$")
_SHARD_FILE_RE = re.compile(r"^shard-(\d+)\.arrow$")
_MANIFEST_TMP_PREFIX = f".{MANIFEST_FILE}.tmp-"
# Object stores have no directories and no atomic rename, but a single PUT is atomic.
_OBJECT_STORE_TYPES = frozenset({"s3", "gcs", "abfs"})
# Below this, handing a chunk to the hashing thread costs more than hashing it inline.
_PARALLEL_HASH_MIN_BYTES = 1 << 20
_VERIFY_CHUNK_BYTES = 16 << 20
_SCHEMA_NAMES = ("table", "row", "weights", "momentum")


@dataclass(frozen=True)
class FileEntry:
    """One file of a checkpoint as its writer produced it."""

    name: str
    size_bytes: int
    checksum: str  # "<algo>:<hex digest>"


@dataclass(frozen=True)
class ShardRows:
    """Embedding rows of one shard: row i is ``(tables[i], rows[i])`` with its weights and momentum.

    ``momentum`` is the one float per row that fbgemm's row-wise Adagrad keeps.
    """

    tables: np.ndarray  # int32 [n]
    rows: np.ndarray  # int64 [n], global row id within its table
    weights: np.ndarray  # float32 [n, D]
    momentum: np.ndarray  # float32 [n]

    def __post_init__(self) -> None:
        expected = (
            ("tables", np.int32, 1),
            ("rows", np.int64, 1),
            ("weights", np.float32, 2),
            ("momentum", np.float32, 1),
        )
        for name, dtype, ndim in expected:
            value = getattr(self, name)
            if not isinstance(value, np.ndarray):
                raise TypeError(f"ShardRows.{name} must be a numpy array, got {type(value).__name__}")
            if value.dtype != dtype or value.ndim != ndim:
                raise ValueError(
                    f"ShardRows.{name} must be {np.dtype(dtype).name} with {ndim} dims, "
                    f"got {value.dtype.name} with shape {value.shape}"
                )
        n = len(self.tables)
        if not (len(self.rows) == len(self.weights) == len(self.momentum) == n):
            raise ValueError(
                f"ShardRows lengths differ: tables {n}, rows {len(self.rows)}, "
                f"weights {len(self.weights)}, momentum {len(self.momentum)}"
            )

    def __len__(self) -> int:
        return len(self.tables)

    @property
    def dim(self) -> int:
        return int(self.weights.shape[1])


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


# --------------------------------------------------------------------------- writing


def write_shard_file(uri: str, step: int, shard_id: int, data: ShardRows) -> FileEntry:
    """Write one shard's rows of checkpoint ``step`` under ``uri``; returns the entry to commit.

    Called by the shard actor that owns the rows, so they never travel through the
    coordinator. The arrays are handed to Arrow without copies and hashed as they are written.
    """
    step = _check_step(step)
    if shard_id < 0:
        raise ValueError(f"shard_id must be >= 0, got {shard_id}")
    batch = _to_record_batch(data)

    def produce(sink: _HashingWriter) -> None:
        # Arrow passes its large buffers to the Python sink as pa.Buffer, without copies.
        stream = pa.PythonFile(sink, mode="w")
        with pa.ipc.new_file(stream, batch.schema) as writer:
            writer.write_batch(batch)
        stream.close()

    return _write_file(uri, step, shard_file_name(shard_id), produce)


def write_blob(uri: str, step: int, name: str, payload: bytes | bytearray | memoryview) -> FileEntry:
    """Write opaque bytes (e.g. ``DENSE_FILE`` from torch.save, ``DATA_POSITION_FILE`` JSON)."""
    step = _check_step(step)
    _check_blob_name(name)
    return _write_file(uri, step, name, lambda sink: sink.write(payload))


def _to_record_batch(data: ShardRows) -> pa.RecordBatch:
    # pa.array over contiguous numpy buffers is zero-copy; only a non-contiguous
    # weights view forces one copy.
    flat_weights = np.ascontiguousarray(data.weights).reshape(-1)
    weights = pa.FixedSizeListArray.from_arrays(pa.array(flat_weights), data.dim)
    return pa.record_batch(
        [
            pa.array(np.ascontiguousarray(data.tables)),
            pa.array(np.ascontiguousarray(data.rows)),
            weights,
            pa.array(np.ascontiguousarray(data.momentum)),
        ],
        names=list(_SCHEMA_NAMES),
    )


class _HashingWriter:
    """Python file object for ``pa.PythonFile`` that forwards writes and hashes them.

    Large chunks are hashed on a helper thread while the same chunk is written; both
    release the GIL, so the checksum adds little wall time and no re-read of the file.
    """

    def __init__(self, out: pa.NativeFile, pool: ThreadPoolExecutor) -> None:
        self._out = out
        self._pool = pool
        self._hash = hashlib.new(CHECKSUM_ALGO)
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
    fs, root = _resolve(uri)
    directory = _join(root, step_dir_name(step))
    if fs.type_name not in _OBJECT_STORE_TYPES:
        fs.create_dir(directory, recursive=True)
    if _exists(fs, _join(directory, MANIFEST_FILE)):
        # Rewriting a file of a committed checkpoint would silently corrupt it.
        raise FileExistsError(f"checkpoint step {step} under {uri} is already committed")
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-hash") as pool:
        # compression=None: the default "detect" would compress by file extension.
        with fs.open_output_stream(_join(directory, name), compression=None) as out:
            writer = _HashingWriter(out, pool)
            produce(writer)
    _sync(fs, _join(directory, name))
    return FileEntry(name=name, size_bytes=writer.size_bytes, checksum=writer.checksum())


def _sync(fs: pafs.FileSystem, path: str, directory: bool = False) -> None:
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


def warm_up() -> None:
    """Runs a tiny shard file through the write and read paths in memory, so the modules
    they pull in lazily (pyarrow.compute, pandas through it: 0.2 s) are loaded ahead of a
    recovery (a warm spare calls it)."""
    data = ShardRows(np.zeros(2, np.int32), np.arange(2, dtype=np.int64), np.zeros((2, 4), np.float32),
                     np.zeros(2, np.float32))
    batch = _to_record_batch(data)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, batch.schema) as writer:
        writer.write_batch(batch)
    reader = pa.ipc.open_file(sink.getvalue())
    _rows_from_batch(reader.get_batch(0), 0, "warm-up")


# --------------------------------------------------------------------------- merging


def merge_shard_rows(parts: Sequence[ShardRows]) -> ShardRows:
    """Rows of ``parts`` applied in order: a later value wins for the same (table, row).

    The result holds each (table, row) once, sorted by table then row.
    """
    if not parts:
        raise ValueError("merge_shard_rows needs at least one part")
    dims = {part.dim for part in parts}
    if len(dims) > 1:
        raise ValueError(f"cannot merge rows of different embedding dims {sorted(dims)}")
    tables = np.concatenate([p.tables for p in parts])
    rows = np.concatenate([p.rows for p in parts])
    # lexsort is stable, so within one (table, row) the parts stay in application order
    # and the last of each run is the newest value.
    order = np.lexsort((rows, tables))
    sorted_tables, sorted_rows = tables[order], rows[order]
    is_last = np.ones(len(order), dtype=bool)
    is_last[:-1] = (sorted_tables[1:] != sorted_tables[:-1]) | (sorted_rows[1:] != sorted_rows[:-1])
    keep = order[is_last]
    return ShardRows(
        tables=tables[keep],
        rows=rows[keep],
        weights=np.concatenate([p.weights for p in parts])[keep],
        momentum=np.concatenate([p.momentum for p in parts])[keep],
    )


# --------------------------------------------------------------------------- store


class CheckpointStore:
    """Commits, verifies, reads, restores and garbage-collects the checkpoints under ``uri``.

    Args:
        uri: a local path, ``file://``, ``s3://``, ``gs://``, ``hdfs://`` ... URI.
        keep_last: number of newest FULL checkpoints that retention keeps (>= 1).

    Corrupt checkpoints skipped by ``latest_valid`` and ``chain_steps`` are logged and
    appended to ``fallbacks`` as ``(step, reason)``.
    """

    def __init__(self, uri: str, keep_last: int = 3) -> None:
        if keep_last < 1:
            raise ConfigError(f"keep_last must be >= 1, got {keep_last}")
        self.uri = uri
        self.keep_last = keep_last
        self.fallbacks: list[tuple[int, str]] = []
        self._fs, self._root = _resolve(uri)
        # Steps gc may treat as valid without re-reading them: committed by this instance
        # (sizes checked, checksums taken from the bytes as written) or verified by gc.
        # Public verify/latest_valid/chain_steps never use it.
        self._trusted: set[int] = set()

    # ----------------------------------------------------------------- commit

    def commit(
        self,
        step: int,
        files: Sequence[FileEntry],
        kind: str = FULL,
        base_step: int | None = None,
        meta: dict[str, Any] | None = None,
    ) -> CheckpointInfo:
        """Write the manifest of ``step`` (after checking every file is there), then run gc.

        A failing gc is logged, not raised: the checkpoint is committed by then.

        Raises:
            CheckpointCorrupt: a listed file is missing or has another size than its entry.
            CheckpointNotFound: an incremental's ``base_step`` is not a committed full checkpoint.
            FileExistsError: ``step`` is already committed.
        """
        step = _check_step(step)
        if kind == FULL:
            if base_step is not None:
                raise ValueError(f"a full checkpoint has no base_step, got {base_step}")
        elif kind == INCREMENTAL:
            if base_step is None or not 0 <= base_step < step:
                raise ValueError(f"incremental step {step} needs a base_step in [0, {step}), got {base_step}")
            base_step = int(base_step)
        else:
            raise ValueError(f"kind must be {FULL!r} or {INCREMENTAL!r}, got {kind!r}")
        names = [entry.name for entry in files]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate file names in commit of step {step}: {sorted(names)}")
        for name in names:
            _check_file_name(name)
        info = CheckpointInfo(
            step=step,
            kind=kind,
            base_step=base_step,
            files={entry.name: entry for entry in files},
            meta=dict(meta or {}),
            created_s=time.time(),
        )
        manifest_bytes = _manifest_to_json(info)  # fails on non-JSON meta before anything is written

        manifest_path = self._path(step, MANIFEST_FILE)
        if _exists(self._fs, manifest_path):
            raise FileExistsError(f"checkpoint step {step} under {self.uri} is already committed")
        if base_step is not None:
            base = self.info(base_step)
            if base.kind != FULL:
                raise CheckpointNotFound(f"base_step {base_step} of step {step} is {base.kind}, not {FULL}")
        # A metadata check only (no re-read): the writers hashed the bytes as they wrote them.
        for entry, file_info in zip(files, self._fs.get_file_info([self._path(step, n) for n in names])):
            self._check_size(step, entry, file_info)

        if self._fs.type_name in _OBJECT_STORE_TYPES:
            self._put(manifest_path, manifest_bytes)
        else:
            tmp_path = self._path(step, f"{_MANIFEST_TMP_PREFIX}{uuid.uuid4().hex}")
            self._put(tmp_path, manifest_bytes)
            _sync(self._fs, tmp_path)
            self._fs.move(tmp_path, manifest_path)
            _sync(self._fs, _join(self._root, step_dir_name(step)), directory=True)
        self._trusted.add(step)
        try:
            self.gc()
        except OSError as exc:
            # The checkpoint is committed; a failed deletion must not make the save look failed.
            logger.warning("checkpoint gc under %s failed after committing step %d: %s", self.uri, step, exc)
        return info

    # ----------------------------------------------------------------- inspect

    def list_committed(self) -> list[int]:
        """Steps that have a manifest, ascending; their files are not verified."""
        return self._scan()[0]

    def info(self, step: int) -> CheckpointInfo:
        """The manifest of ``step``, parsed but not verified against the files."""
        path = self._path(step, MANIFEST_FILE)
        try:
            with self._fs.open_input_file(path) as f:
                raw = f.read()
        except FileNotFoundError:
            raise CheckpointNotFound(f"checkpoint step {step} is not committed under {self.uri}") from None
        return _manifest_from_json(raw, step)

    def verify(self, step: int) -> CheckpointInfo:
        """Check every file of ``step`` exists with the size and checksum of its manifest.

        Raises:
            CheckpointNotFound: ``step`` has no manifest.
            CheckpointCorrupt: naming the file and the expected and actual value.
        """
        info = self.info(step)
        names = sorted(info.files)
        # Metadata first: a missing or truncated file is found without reading anything.
        for name, file_info in zip(names, self._fs.get_file_info([self._path(step, n) for n in names])):
            self._check_size(step, info.files[name], file_info)
        for name in names:
            entry = info.files[name]
            hasher = hashlib.new(_algo_of(step, entry))
            try:
                with self._fs.open_input_stream(self._path(step, name), compression=None) as f:
                    while chunk := f.read_buffer(_VERIFY_CHUNK_BYTES):
                        hasher.update(chunk)
            except FileNotFoundError:
                raise CheckpointCorrupt(f"checkpoint step {step}: file {name} is missing") from None
            self._check_checksum(step, entry, hasher)
        return info

    def latest_valid(self, kind: str | None = None) -> CheckpointInfo | None:
        """The newest checkpoint (of ``kind`` if given) that verifies, or None.

        An incremental is returned on its own merits; use ``chain_steps`` for the newest
        restorable state.
        """
        skipped: list[tuple[int, str]] = []
        found: CheckpointInfo | None = None
        for step in reversed(self.list_committed()):
            try:
                if kind is not None and self.info(step).kind != kind:
                    continue
                found = self.verify(step)
                break
            except CheckpointCorrupt as exc:
                skipped.append((step, str(exc)))
        self._report(skipped, found.step if found else None)
        return found

    # ----------------------------------------------------------------- read

    def read_shard(self, step: int, shard_id: int) -> ShardRows:
        """Rows of one shard file of ``step``, after checking that file's size and checksum.

        The arrays are read-only views over the bytes read; copy them to modify.
        """
        name = shard_file_name(shard_id)
        buffer = self._read_verified(step, name)
        try:
            reader = pa.ipc.open_file(buffer)
            batches = [reader.get_batch(i) for i in range(reader.num_record_batches)]
        except pa.ArrowInvalid as exc:
            raise CheckpointCorrupt(f"checkpoint step {step}: file {name} is not Arrow IPC: {exc}") from None
        if not batches:
            raise CheckpointCorrupt(f"checkpoint step {step}: file {name} holds no record batch")
        # One batch is what write_shard_file produces; several would need one concatenating copy.
        batch = batches[0] if len(batches) == 1 else pa.concat_batches(batches)
        return _rows_from_batch(batch, step, name)

    def read_blob(self, step: int, name: str) -> bytes:
        """The bytes of blob ``name`` of ``step``, after checking its size and checksum."""
        return self._read_verified(step, name).to_pybytes()

    # ----------------------------------------------------------------- restore

    def chain_steps(self, upto_step: int | None = None) -> list[int]:
        """Steps of the newest valid state at or before ``upto_step``: a full, then incrementals.

        The full is the newest one at or before ``upto_step`` that verifies (all files).
        Then come the committed incrementals whose ``base_step`` is that full, in step order,
        each verified. The chain STOPS before the first corrupt incremental (or unreadable
        manifest) after the full: applying later incrementals without it would skip the rows
        that only it saved. Even a whole chain is one step's state only where every changed
        row was saved; MFU/SSU incrementals save just their prioritized rows, so the
        supervisor restores a chain into a respawned shard (partial recovery) but rolls
        everything back to the full checkpoint alone.
        The last step returned is the one whose dense and data-position blobs to load.
        Returns [] when no full checkpoint verifies.
        """
        return self._chain(upto_step, self.verify, record=True)

    def read_chain(self, shard_id: int, steps: Sequence[int]) -> ShardRows:
        """One shard's rows after applying the shard files of ``steps`` in order.

        Each file's checksum is checked. For a multi-shard restore, let the coordinator call
        ``chain_steps`` once and each shard actor ``read_chain`` with that list, so that
        every shard restores the same steps and no actor re-reads the others' files.
        """
        if not steps:
            raise CheckpointNotFound(f"no checkpoint steps given to restore shard {shard_id} from")
        parts = [self.read_shard(step, shard_id) for step in steps]
        dims = {step: part.dim for step, part in zip(steps, parts)}
        if len(set(dims.values())) > 1:
            raise CheckpointCorrupt(f"shard {shard_id} has different embedding dims across steps: {dims}")
        return merge_shard_rows(parts)

    def shard_chain(self, shard_id: int, upto_step: int | None = None) -> tuple[list[int], list[ShardRows]]:
        """The newest restorable state of ONE shard, reading and verifying only that shard's
        files: each file is read once, its checksum checked on the bytes read, and used.

        ``chain_steps``'s rule (newest valid full at or before ``upto_step``, then its
        incrementals, stopping before the first bad one), except that only ``shard_id``'s
        file of each step is verified: another shard's corrupt file, or the dense blob, does
        not stop this shard's recovery. Skipped fulls are recorded in ``fallbacks``.
        Returns ``([], [])`` when no full holds a valid file of this shard.
        """
        parts: dict[int, ShardRows] = {}

        def read(step: int) -> None:
            parts[step] = self.read_shard(step, shard_id)

        steps = self._chain(upto_step, read, record=True)
        return steps, [parts[s] for s in steps]

    def chain_candidates(self, upto_step: int | None = None) -> list[int]:
        """``chain_steps`` from the manifests alone, reading no data file: what a partial
        recovery will try (the shard itself then reads and verifies its own files through
        ``shard_chain``, falling back past a corrupt one)."""
        return self._chain(upto_step, self.info, record=False)

    def restore_chain(self, shard_id: int, upto_step: int | None = None) -> tuple[list[int], ShardRows]:
        """``chain_steps(upto_step)`` and the merged rows of ``shard_id`` over them.

        Rows come back unique per (table, row), sorted by table then row.

        Raises:
            CheckpointNotFound: no valid full checkpoint exists at or before ``upto_step``.
        """
        steps = self.chain_steps(upto_step)
        if not steps:
            raise CheckpointNotFound(f"no valid full checkpoint at or before step {upto_step} under {self.uri}")
        return steps, self.read_chain(shard_id, steps)

    # ----------------------------------------------------------------- retention

    def fence_after(self, step: int) -> list[int]:
        """Remove every checkpoint newer than ``step``, committed or not: after a rollback to
        ``step`` they belong to an abandoned timeline and must never be loaded. Manifests go
        first, so a crash midway leaves uncommitted directories, never a half-deleted
        checkpoint. Idempotent; returns the steps removed."""
        committed, uncommitted = self._scan()
        doomed = sorted(s for s in committed + uncommitted if s > step)
        for s in doomed:
            manifest_path = self._path(s, MANIFEST_FILE)
            if _exists(self._fs, manifest_path):
                self._fs.delete_file(manifest_path)
        for s in doomed:
            self._fs.delete_dir(_join(self._root, step_dir_name(s)))
            self._trusted.discard(s)
        if doomed:
            logger.warning("checkpoints %s under %s fenced: newer than the rollback to step %d", doomed, self.uri, step)
        return doomed

    def gc(self) -> list[int]:
        """Delete what retention no longer needs; returns the deleted steps, ascending.

        Keeps the newest ``keep_last`` full checkpoints (corrupt ones count: they are left
        for inspection, not deleted) and every later checkpoint except incrementals built on
        an older full; older checkpoints are deleted.
        Never deletes the newest valid checkpoint nor the chain of the newest valid state.
        Uncommitted directories older than the newest committed step are crashed saves and
        are deleted; newer ones may be saves in progress and are left.

        Checkpoints this instance committed are trusted as valid; any other one that gc
        must rely on is fully verified (read back) once per instance.
        """
        committed, uncommitted = self._scan()
        doomed = [s for s in uncommitted if committed and s < committed[-1]]

        infos: dict[int, CheckpointInfo | None] = {}
        for step in committed:
            try:
                infos[step] = self.info(step)
            except CheckpointCorrupt:
                infos[step] = None
        fulls = [s for s in committed if (i := infos[s]) is not None and i.kind == FULL]
        if len(fulls) > self.keep_last:
            oldest_kept = fulls[-self.keep_last]

            def expired(step: int) -> bool:
                info = infos[step]
                if step < oldest_kept:
                    return True
                return info is not None and info.base_step is not None and info.base_step < oldest_kept

            candidates = [s for s in committed if expired(s)]
            if candidates:
                protected = self._protected(infos)
                doomed += [s for s in candidates if s not in protected]

        for step in sorted(doomed):
            directory = _join(self._root, step_dir_name(step))
            # Manifest first: a crash mid-delete leaves an uncommitted directory, not a
            # committed checkpoint with files missing.
            manifest_path = _join(directory, MANIFEST_FILE)
            if _exists(self._fs, manifest_path):
                self._fs.delete_file(manifest_path)
            self._fs.delete_dir(directory)
            self._trusted.discard(step)
        if doomed:
            logger.info("checkpoint gc under %s deleted steps %s", self.uri, sorted(doomed))
        return sorted(doomed)

    def _protected(self, infos: dict[int, CheckpointInfo | None]) -> set[int]:
        """The newest valid state's chain, plus the newest valid checkpoint and what it builds on.

        ``infos`` maps every committed step to its manifest (None if unreadable).
        """
        protected = set(self._chain(None, self._verify_trusted, record=False))
        for step in sorted(infos, reverse=True):
            try:
                newest = self._verify_trusted(step)
            except CheckpointCorrupt:
                continue
            protected.add(step)
            if newest.base_step is not None:
                # Unreadable manifests in between might be part of its chain: keep them too.
                protected.update(
                    other
                    for other, info in infos.items()
                    if newest.base_step <= other < step and (info is None or info.base_step == newest.base_step)
                )
                protected.add(newest.base_step)
            break
        return protected

    def _verify_trusted(self, step: int) -> CheckpointInfo:
        if step in self._trusted:
            return self.info(step)
        info = self.verify(step)
        self._trusted.add(step)
        return info

    # ----------------------------------------------------------------- internals

    def _chain(self, upto_step: int | None, verify: Callable[[int], object], record: bool) -> list[int]:
        committed = [s for s in self.list_committed() if upto_step is None or s <= upto_step]
        skipped: list[tuple[int, str]] = []
        full_step: int | None = None
        for step in reversed(committed):
            try:
                if self.info(step).kind != FULL:
                    continue
                verify(step)
            except CheckpointCorrupt as exc:
                skipped.append((step, str(exc)))
                continue
            except CheckpointNotFound:
                continue  # removed since the listing (fenced by a rollback, or retention)
            full_step = step
            break
        if record:
            self._report(skipped, full_step)
        if full_step is None:
            return []

        chain = [full_step]
        for step in committed:
            if step <= full_step:
                continue
            try:
                info = self.info(step)
                if info.kind != INCREMENTAL or info.base_step != full_step:
                    continue
                verify(step)
            except CheckpointNotFound:
                break  # removed since the listing: fenced, and so is everything after it
            except CheckpointCorrupt as exc:
                if record:
                    self._report([(step, f"{exc} (restore chain stops before it)")], chain[-1])
                break
            chain.append(step)
        return chain

    def _report(self, skipped: list[tuple[int, str]], fallback_step: int | None) -> None:
        target = f"falling back to step {fallback_step}" if fallback_step is not None else "no older valid checkpoint"
        for step, reason in skipped:
            logger.warning("checkpoint step %d is corrupt: %s; %s", step, reason, target)
            self.fallbacks.append((step, reason))

    def _scan(self) -> tuple[list[int], list[int]]:
        """(committed steps, uncommitted step directories), each ascending."""
        selector = pafs.FileSelector(self._root, allow_not_found=True, recursive=False)
        steps = sorted(
            int(m.group(1))
            for entry in self._fs.get_file_info(selector)
            if entry.type == pafs.FileType.Directory and (m := _STEP_DIR_RE.match(entry.base_name))
        )
        manifests = self._fs.get_file_info([self._path(s, MANIFEST_FILE) for s in steps])
        committed = [s for s, m in zip(steps, manifests) if m.type == pafs.FileType.File]
        uncommitted = [s for s, m in zip(steps, manifests) if m.type != pafs.FileType.File]
        return committed, uncommitted

    def _read_verified(self, step: int, name: str) -> pa.Buffer:
        info = self.info(step)
        entry = info.files.get(name)
        if entry is None:
            raise CheckpointNotFound(f"checkpoint step {step} has no file {name}; it has {sorted(info.files)}")
        algo = _algo_of(step, entry)
        try:
            if self._fs.type_name == "local":
                # Mapped, not copied: the page cache's pages are used as they are (a fresh
                # 100 MB buffer costs more in page faults than reading it).
                with pa.memory_map(self._path(step, name)) as f:
                    buffer = f.read_buffer()
            else:
                with self._fs.open_input_file(self._path(step, name)) as f:
                    buffer = f.read_buffer()
        except FileNotFoundError:
            raise CheckpointCorrupt(f"checkpoint step {step}: file {name} is missing") from None
        if buffer.size != entry.size_bytes:
            raise CheckpointCorrupt(
                f"checkpoint step {step}: file {name} is {buffer.size} bytes, expected {entry.size_bytes}"
            )
        self._check_checksum(step, entry, hashlib.new(algo, memoryview(buffer)))
        return buffer

    @staticmethod
    def _check_size(step: int, entry: FileEntry, file_info: pafs.FileInfo) -> None:
        if file_info.type != pafs.FileType.File:
            raise CheckpointCorrupt(f"checkpoint step {step}: file {entry.name} is missing")
        if file_info.size != entry.size_bytes:
            raise CheckpointCorrupt(
                f"checkpoint step {step}: file {entry.name} is {file_info.size} bytes, expected {entry.size_bytes}"
            )

    @staticmethod
    def _check_checksum(step: int, entry: FileEntry, hasher: Any) -> None:
        actual = f"{hasher.name}:{hasher.hexdigest()}"
        if actual != entry.checksum:
            raise CheckpointCorrupt(
                f"checkpoint step {step}: file {entry.name} has checksum {actual}, expected {entry.checksum}"
            )

    def _path(self, step: int, name: str) -> str:
        return _join(self._root, step_dir_name(step), name)

    def _put(self, path: str, payload: bytes) -> None:
        with self._fs.open_output_stream(path, compression=None) as out:
            out.write(payload)


# --------------------------------------------------------------------------- helpers


@functools.lru_cache(maxsize=32)
def _resolve(uri: str) -> tuple[pafs.FileSystem, str]:
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


def _join(*parts: str) -> str:
    return "/".join(p.rstrip("/") for p in parts if p)


def _exists(fs: pafs.FileSystem, path: str) -> bool:
    return fs.get_file_info(path).type != pafs.FileType.NotFound


def _check_step(step: int) -> int:
    # 12 digits keep the directory names sorting in step order
    if isinstance(step, bool) or not isinstance(step, int | np.integer) or not 0 <= step < 10**12:
        raise ValueError(f"step must be an int in [0, 1e12), got {step!r}")
    return int(step)


def _check_file_name(name: str) -> None:
    if not name or name in (".", "..") or "/" in name or "\\" in name or "\0" in name:
        raise ValueError(f"checkpoint file name must be a plain file name, got {name!r}")
    if name == MANIFEST_FILE or name.startswith(_MANIFEST_TMP_PREFIX):
        raise ValueError(f"{name!r} is reserved for the manifest")


def _check_blob_name(name: str) -> None:
    _check_file_name(name)
    if _SHARD_FILE_RE.match(name):
        raise ValueError(f"{name!r} is reserved for shard files; use write_shard_file")


def _algo_of(step: int, entry: FileEntry) -> str:
    algo = entry.checksum.partition(":")[0]
    if algo not in hashlib.algorithms_available:
        raise CheckpointCorrupt(f"checkpoint step {step}: file {entry.name} has unknown checksum {entry.checksum!r}")
    return algo


def _rows_from_batch(batch: pa.RecordBatch, step: int, name: str) -> ShardRows:
    where = f"checkpoint step {step}: file {name}"
    if tuple(batch.schema.names) != _SCHEMA_NAMES:
        raise CheckpointCorrupt(f"{where} has columns {batch.schema.names}, expected {list(_SCHEMA_NAMES)}")
    weights = batch.column("weights")
    if not pa.types.is_fixed_size_list(weights.type) or weights.type.value_type != pa.float32():
        raise CheckpointCorrupt(f"{where} has weights of type {weights.type}, expected fixed_size_list<float>")
    if any(column.null_count for column in batch.columns) or weights.flatten().null_count:
        raise CheckpointCorrupt(f"{where} has null values")
    dim = weights.type.list_size
    try:
        return ShardRows(
            tables=batch.column("table").to_numpy(zero_copy_only=True),
            rows=batch.column("row").to_numpy(zero_copy_only=True),
            # flatten() honours the array offset, .values would not
            weights=weights.flatten().to_numpy(zero_copy_only=True).reshape(len(weights), dim),
            momentum=batch.column("momentum").to_numpy(zero_copy_only=True),
        )
    except (TypeError, ValueError) as exc:
        raise CheckpointCorrupt(f"{where} has unexpected column types: {exc}") from None


def _manifest_to_json(info: CheckpointInfo) -> bytes:
    document = {
        "format": _FORMAT_VERSION,
        "step": info.step,
        "kind": info.kind,
        "base_step": info.base_step,
        "created_s": info.created_s,
        "files": {
            name: {"size_bytes": e.size_bytes, "checksum": e.checksum} for name, e in sorted(info.files.items())
        },
        "meta": info.meta,
    }
    try:
        return json.dumps(document, indent=1, allow_nan=False).encode()
    except (TypeError, ValueError) as exc:
        raise ValueError(f"checkpoint meta of step {info.step} is not JSON-serializable: {exc}") from None


def _manifest_from_json(raw: bytes, step: int) -> CheckpointInfo:
    where = f"checkpoint step {step}: {MANIFEST_FILE}"
    try:
        document = json.loads(raw)
        if document["format"] != _FORMAT_VERSION:
            raise CheckpointCorrupt(f"{where} has format {document['format']}, expected {_FORMAT_VERSION}")
        info = CheckpointInfo(
            step=int(document["step"]),
            kind=str(document["kind"]),
            base_step=None if document["base_step"] is None else int(document["base_step"]),
            files={
                name: FileEntry(name=name, size_bytes=int(e["size_bytes"]), checksum=str(e["checksum"]))
                for name, e in document["files"].items()
            },
            meta=dict(document["meta"]),
            created_s=float(document["created_s"]),
        )
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        # json.JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise CheckpointCorrupt(f"{where} is unreadable: {type(exc).__name__}: {exc}") from None
    if info.step != step:
        raise CheckpointCorrupt(f"{where} names step {info.step}, expected {step}")
    for name in info.files:
        # A crafted manifest must not make a reader open anything outside this checkpoint.
        try:
            _check_file_name(name)
        except ValueError as exc:
            raise CheckpointCorrupt(f"{where} lists an unsafe file name: {exc}") from None
    if info.kind not in (FULL, INCREMENTAL) or (info.kind == INCREMENTAL) != (info.base_step is not None):
        raise CheckpointCorrupt(f"{where} has kind {info.kind!r} with base_step {info.base_step}")
    return info
