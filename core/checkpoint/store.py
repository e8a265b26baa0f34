"""The checkpoints under one storage URI as their coordinator sees them: commits a manifest
over the files that shard actors wrote, fences an abandoned timeline and applies
retention, on top of CheckpointReader's verified reads and restore chains.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pyarrow as pa

from core.checkpoint.files import (
    FULL,
    INCREMENTAL,
    MANIFEST_FILE,
    MANIFEST_TMP_PREFIX,
    OBJECT_STORE_TYPES,
    CheckpointInfo,
    FileEntry,
    check_file_name,
    check_step,
    exists,
    join,
    pause_if_slow,
    step_dir_name,
    sync,
)
from core.checkpoint.checksum import new_hasher
from core.checkpoint.manifest import manifest_from_json, manifest_to_json
from core.checkpoint.reader import CheckpointReader
from core.checkpoint.retention import expired_steps, protected_steps, with_bases
from core.errors import CheckpointCorrupt, CheckpointNotFound, ConfigError

__all__ = ["CheckpointStore"]

logger = logging.getLogger(__name__)

_HASH_CHUNK_BYTES = 16 << 20


class CheckpointStore(CheckpointReader):
    """Commits, verifies, reads, restores and garbage-collects the checkpoints under ``uri``.

    Args:
        uri: a local path, ``file://``, ``s3://``, ``gs://``, ``hdfs://`` ... URI.
        keep_last: number of newest FULL checkpoints that retention keeps (>= 1).
        keep: the steps a restore in flight may still load (a replacement trainer was told
            to start there, a recovery or a rollback chose a chain): retention keeps them, and
            what each builds on, whatever ``keep_last`` says. Whoever changes what ``keep``
            returns does so inside ``keep_changing()`` for the change to bind a gc already
            running.
        audit_removal: called with each checkpoint retention is about to remove and what
            ``rehash`` found of it, before its manifest goes (``audit_log``:
            ``core.checkpoint.removal_log``); a failure keeps the checkpoint, for a later gc.
        keep_fenced: with ``audit_log``, a checkpoint a rollback fences is moved to
            ``fenced/ckpt-<step>-<ms since the epoch>`` under the store instead of deleted:
            ``cpr verify --replay`` reads what a load of the abandoned timeline read from it
            (no reader of the store lists that folder).

    Corrupt checkpoints skipped by ``latest_valid``, ``chain_steps``, ``verified_chain`` and
    ``shard_chain`` are logged and appended to ``fallbacks`` as ``(step, reason)``, each
    (step, reason) once per instance. Checkpoints this instance commits count as verified
    (sizes checked, checksums taken from the bytes as written).
    """

    def __init__(self, uri: str, keep_last: int = 3, keep: Callable[[], set[int]] | None = None,
                 audit_removal: Callable[[int, dict], None] | None = None, keep_fenced: bool = False) -> None:
        if keep_last < 1:
            raise ConfigError(f"keep_last must be >= 1, got {keep_last}")
        super().__init__(uri)
        self.keep_last = keep_last
        self.keep = keep or set
        self.audit_removal = audit_removal
        self.keep_fenced = keep_fenced
        # A gc deletes manifests only if ``keep`` did not change since it read it, so a step
        # protected once ``keep_changing`` returns is never deleted by a gc under way. ``keep``
        # may take its owner's lock: it is read without holding this one.
        self._retention = threading.Lock()
        self._keep_version = 0

    @contextlib.contextmanager
    def keep_changing(self) -> Iterator[None]:
        """Wraps a change of what ``keep`` returns: waits for manifest deletions under way, and
        makes a gc that read ``keep`` before read it again."""
        with self._retention:
            yield
            self._keep_version += 1

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
            ValueError: a manifest every reader would refuse (e.g. a malformed checksum, a
                negative ``meta["save_index"]``).
        """
        step = check_step(step)
        base_step = _checked_base(step, kind, base_step)
        names = [entry.name for entry in files]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate file names in commit of step {step}: {sorted(names)}")
        for name in names:
            check_file_name(name)
        info = CheckpointInfo(
            step=step,
            kind=kind,
            base_step=base_step,
            files={entry.name: entry for entry in files},
            meta=dict(meta or {}),
            created_s=time.time(),
        )
        manifest_bytes = manifest_to_json(info)  # fails on non-JSON meta before anything is written

        manifest_path = self._path(step, MANIFEST_FILE)
        if exists(self._fs, manifest_path):
            raise FileExistsError(f"checkpoint step {step} under {self.uri} is already committed")
        if base_step is not None:
            base = self.info(base_step)
            if base.kind != FULL:
                raise CheckpointNotFound(f"base_step {base_step} of step {step} is {base.kind}, not {FULL}")
        # A metadata check only (no re-read): the writers hashed the bytes as they wrote them.
        for entry, file_info in zip(files, self._fs.get_file_info([self._path(step, n) for n in names])):
            self._check_size(step, entry, file_info)
        try:
            as_read = manifest_from_json(manifest_bytes, step)
        except CheckpointCorrupt as exc:
            raise ValueError(f"refusing to commit a manifest its readers refuse: {exc}") from None

        self._write_manifest(step, manifest_bytes)
        self._valid[step] = as_read
        try:
            self.gc()
        except OSError as exc:
            # The checkpoint is committed; a failed deletion must not make the save look failed.
            logger.warning("checkpoint gc under %s failed after committing step %d: %s", self.uri, step, exc)
        return info

    def _write_manifest(self, step: int, manifest_bytes: bytes) -> None:
        manifest_path = self._path(step, MANIFEST_FILE)
        if self._fs.type_name in OBJECT_STORE_TYPES:
            self._put(manifest_path, manifest_bytes)
            return
        tmp_path = self._path(step, f"{MANIFEST_TMP_PREFIX}{uuid.uuid4().hex}")
        self._put(tmp_path, manifest_bytes)
        sync(self._fs, tmp_path)
        self._fs.move(tmp_path, manifest_path)
        sync(self._fs, join(self._root, step_dir_name(step)), directory=True)

    # ----------------------------------------------------------------- retention

    def fence_after(self, step: int) -> list[int]:
        """Remove every checkpoint newer than ``step``, committed or not: after a rollback to
        ``step`` they belong to an abandoned timeline and must never be loaded. Manifests go
        first, so a crash midway leaves uncommitted directories, never a half-deleted
        checkpoint. Idempotent; returns the steps removed."""
        committed, uncommitted = self._scan()
        doomed = sorted(s for s in committed + uncommitted if s > step)
        manifests = {}
        for s in doomed:
            manifest_path = self._path(s, MANIFEST_FILE)
            if exists(self._fs, manifest_path):
                if self.keep_fenced:
                    with self._fs.open_input_stream(manifest_path) as f:
                        manifests[s] = f.read()
                self._fs.delete_file(manifest_path)
        for s in doomed:
            self._remove_fenced(s, manifests.get(s))
            self._forget(s)
        if doomed:
            logger.warning("checkpoints %s under %s fenced: newer than the rollback to step %d", doomed, self.uri, step)
        return doomed

    def _remove_fenced(self, step: int, manifest: bytes | None) -> None:
        """Deletes a fenced checkpoint's directory, or with ``keep_fenced`` moves it aside with
        its manifest (gone from the store already) written back beside its files, so the copy
        reads as the checkpoint it was."""
        path = join(self._root, step_dir_name(step))
        if self.keep_fenced and manifest is not None:
            # the time in ms rounded up: never before the commit it fences, however close (a
            # truncated one fell before a commit of the same millisecond)
            target = join(self._root, "fenced", f"{step_dir_name(step)}-{math.ceil(time.time() * 1000)}")
            try:
                self._fs.create_dir(join(self._root, "fenced"), recursive=True)
                self._fs.move(path, target)
                with self._fs.open_output_stream(join(target, MANIFEST_FILE)) as f:
                    f.write(manifest)
                return
            except (OSError, NotImplementedError, pa.ArrowException) as err:  # an object store that cannot move it
                logger.warning("could not keep fenced checkpoint %d (%r); deleting it", step, err)
        self._fs.delete_dir(path)

    def committed_after(self, step: int) -> list[CheckpointInfo]:
        """The manifests of the checkpoints committed after ``step``, ascending (an unreadable
        one left out)."""
        out = []
        for s in self.list_committed():
            if s > step:
                try:
                    out.append(self.info(s))
                except CheckpointCorrupt:
                    continue
        return out

    def discard(self, step: int) -> bool:
        """Removes what a save of ``step`` that will never commit wrote (its directory, if it
        has no manifest): on a disk that filled up, the files of failed saves would otherwise
        keep it full until a commit's gc, and no commit comes. Returns whether it removed one."""
        step = check_step(step)
        if exists(self._fs, self._path(step, MANIFEST_FILE)):
            return False
        try:
            self._fs.delete_dir(join(self._root, step_dir_name(step)))
        except FileNotFoundError:
            return False
        return True

    def gc(self) -> list[int]:
        """Delete what retention no longer needs; returns the deleted steps, ascending.

        Keeps the newest ``keep_last`` full checkpoints (corrupt ones count: they are left
        for inspection, not deleted) and every later checkpoint except incrementals built on
        an older full; older checkpoints are deleted.
        Never deletes the newest valid checkpoint nor the chain of the newest valid state, nor
        a step ``keep`` names or what it builds on (its base full, the incrementals before it).
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
        candidates = expired_steps(infos, self.keep_last)
        if candidates:
            chain = self._chain(None, self._verify_once, record=False)
            protected = protected_steps(infos, chain, lambda s: self._verify_once(self.info(s)))
            doomed += self._delete_manifests(candidates, protected, infos)
        for step in sorted(doomed):
            self._fs.delete_dir(join(self._root, step_dir_name(step)))
            self._forget(step)
        if doomed:
            logger.info("checkpoint gc under %s deleted steps %s", self.uri, sorted(doomed))
        return sorted(doomed)

    def _delete_manifests(self, candidates: list[int], protected: set[int], infos: dict) -> list[int]:
        """Deletes the manifests of ``candidates`` that neither ``protected`` nor ``keep`` (with
        what it builds on) holds, unless ``keep`` keeps changing; returns the steps deleted."""
        for _ in range(3):
            version = self._keep_version
            kept = protected | with_bases(infos, self.keep())
            doomed = [s for s in candidates if s not in kept]
            # Hashed outside the lock (it reads every file); a step kept meanwhile stays.
            found = {s: self.rehash(s) for s in doomed} if self.audit_removal is not None else {}
            with self._retention:
                if version != self._keep_version:
                    continue
                for step in doomed:
                    # Manifest first: a crash mid-delete leaves an uncommitted directory, not
                    # a committed checkpoint with files missing.
                    manifest_path = self._path(step, MANIFEST_FILE)
                    if exists(self._fs, manifest_path):
                        if self.audit_removal is not None:
                            self.audit_removal(step, found[step])
                        self._fs.delete_file(manifest_path)
                return doomed
        logger.info("checkpoint gc under %s deferred: the steps to keep kept changing", self.uri)
        return []

    def rehash(self, step: int) -> dict:
        """What is on storage of checkpoint ``step`` now: ``manifest``, its manifest as JSON (None,
        with ``manifest_error``, if unreadable), and ``files``, for each file it lists the size
        and the checksum computed again from the bytes, with the entry's algorithm (None, with
        ``error``, for a file that cannot be read)."""
        try:
            with self._fs.open_input_stream(self._path(step, MANIFEST_FILE), compression=None) as f:
                manifest = json.loads(f.read())
            entries = sorted(manifest["files"].items())
        except (OSError, ValueError, KeyError, TypeError, AttributeError, pa.ArrowException) as exc:
            return {"manifest": None, "manifest_error": repr(exc)[:300], "files": {}}
        return {"manifest": manifest, "files": {name: self._rehash_file(step, name, entry) for name, entry in entries}}

    def _rehash_file(self, step: int, name: str, entry: Any) -> dict:
        try:
            check_file_name(name)
            hasher = new_hasher(str(entry["checksum"]).partition(":")[0])
            size = 0
            with self._fs.open_input_stream(self._path(step, name), compression=None) as f:
                while chunk := f.read_buffer(_HASH_CHUNK_BYTES):
                    hasher.update(chunk)
                    size += chunk.size
        except (OSError, ValueError, KeyError, TypeError, pa.ArrowException) as exc:
            return {"size_bytes": None, "checksum": None, "error": repr(exc)[:300]}
        return {"size_bytes": size, "checksum": f"{hasher.name}:{hasher.hexdigest()}"}

    def _forget(self, step: int) -> None:
        self._valid.pop(step, None)
        self._corrupt.pop(step, None)

    def _put(self, path: str, payload: bytes) -> None:
        with self._fs.open_output_stream(path, compression=None) as out:
            out.write(payload)
        pause_if_slow(self._fs, self._root)


def _checked_base(step: int, kind: str, base_step: int | None) -> int | None:
    """The base step of a commit of ``kind``: None for a full, an earlier step for an incremental."""
    if kind == FULL:
        if base_step is not None:
            raise ValueError(f"a full checkpoint has no base_step, got {base_step}")
        return None
    if kind == INCREMENTAL:
        if base_step is None or not 0 <= base_step < step:
            raise ValueError(f"incremental step {step} needs a base_step in [0, {step}), got {base_step}")
        return int(base_step)
    raise ValueError(f"kind must be {FULL!r} or {INCREMENTAL!r}, got {kind!r}")
