"""Read access to the checkpoints under one storage URI: manifests, verification of their
files, verified reads of shard files and blobs, and the newest restorable chain, falling
back past corrupt checkpoints. Nothing here writes or deletes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs

from core.checkpoint.chain import REMOVED, FoundChain, find_chain
from core.checkpoint.files import (
    MANIFEST_FILE,
    STEP_DIR_RE,
    CheckpointInfo,
    FileEntry,
    join,
    resolve,
    shard_file_name,
    step_dir_name,
)
from core.checkpoint.checksum import checksum_of, new_hasher
from core.checkpoint.manifest import checksum_algo, manifest_from_json
from core.checkpoint.plans import read_slices, recorded_plan
from core.checkpoint.rows import ShardRows, merge_shard_rows, rows_from_batch
from core.errors import CheckpointCorrupt, CheckpointNotFound

__all__ = ["CheckpointReader"]

logger = logging.getLogger(__name__)

_VERIFY_CHUNK_BYTES = 16 << 20
# A checkpoint removed between a listing and its read means the listing is stale: a fresh
# one may hold a newer state (a save committed meanwhile). Bounded: retention never stops.
_RELISTS = 2


class CheckpointReader:
    """Verifies, reads and restores the checkpoints under ``uri`` (see CheckpointStore).

    Corrupt checkpoints skipped by ``latest_valid``, ``chain_steps``, ``verified_chain`` and
    ``shard_chain`` are logged and appended to ``fallbacks`` as ``(step, reason)``, each
    (step, reason) once per instance; so are those whose manifest went while a chain was being
    read (retention or a fence), which are also in ``removed_steps``.
    """

    def __init__(self, uri: str) -> None:
        self.uri = uri
        self.fallbacks: list[tuple[int, str]] = []
        self.removed_steps: set[int] = set()
        self._reported: set[tuple[int, str]] = set()
        self._fs, self._root = resolve(uri)
        # Verdicts on whole checkpoints, each kept with the manifest it was reached on: a
        # committed checkpoint never changes, and one fenced and committed anew has another
        # manifest. A store also counts what it committed itself as valid. Only
        # verified_chain and the store's gc rely on them.
        self._valid: dict[int, CheckpointInfo] = {}
        self._corrupt: dict[int, tuple[CheckpointInfo, str]] = {}

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
        return manifest_from_json(raw, step)

    def verify(self, step: int) -> CheckpointInfo:
        """Check every file of ``step`` exists with the size and checksum of its manifest.

        Raises:
            CheckpointNotFound: ``step`` has no manifest.
            CheckpointCorrupt: naming the file and the expected and actual value.
        """
        return self._verify_files(self.info(step))

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
        return rows_from_batch(batch, step, name)

    def plan(self, info: CheckpointInfo):
        """The plan ``info``'s shard files were written under (``plans.recorded_plan``)."""
        return recorded_plan(info)

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
        return self._chain(upto_step, self._verify_files, record=True)

    def verified_chain(self, upto_step: int | None = None) -> list[int]:
        """``chain_steps``, reading and hashing each checkpoint's files at most once per instance.

        A checkpoint that verified stays valid for this instance, one found corrupt stays
        corrupt (and is reported in ``fallbacks`` once); those this instance committed count
        as verified. Only manifests are read again, so a step fenced or deleted since, or
        committed anew, is judged afresh.
        """
        return self._chain(upto_step, self._verify_once, record=True)

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

    def shard_chain(
        self, shard_id: int, upto_step: int | None = None, slices: Sequence | None = None
    ) -> tuple[list[int], list[ShardRows]]:
        """The newest restorable state of ONE shard, reading and verifying only that shard's
        files: each file is read once, its checksum checked on the bytes read, and used.
        ``slices``: the shard's rows under the plan now; a checkpoint of another plan gives
        them from the files that hold them (``core.checkpoint.plans.read_slices``).

        ``chain_steps``'s rule (newest valid full at or before ``upto_step``, then its
        incrementals, stopping before the first bad one), except that only ``shard_id``'s
        file of each step is verified: another shard's corrupt file, or the dense blob, does
        not stop this shard's recovery. Skipped fulls are recorded in ``fallbacks``.
        Returns ``([], [])`` when no full holds a valid file of this shard.
        """
        parts: dict[int, ShardRows] = {}

        def read(info: CheckpointInfo) -> None:
            parts[info.step] = read_slices(self, info, shard_id, slices)

        steps = self._chain(upto_step, read, record=True)
        return steps, [parts[s] for s in steps]

    def chain_candidates(self, upto_step: int | None = None) -> list[int]:
        """``chain_steps`` from the manifests alone, reading no data file: what a partial
        recovery will try (the shard itself then reads and verifies its own files through
        ``shard_chain``, falling back past a corrupt one)."""
        return self._chain(upto_step, lambda info: None, record=False)

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

    # ----------------------------------------------------------------- internals

    def _chain(self, upto_step: int | None, verify: Callable[[CheckpointInfo], object], record: bool) -> list[int]:
        """``find_chain`` over a fresh listing, listed again (up to ``_RELISTS`` times) while a
        checkpoint of the listing turns out removed; every removal is reported all the same."""
        removed: list[int] = []
        found: FoundChain | None = None
        for _ in range(1 + _RELISTS):
            if found is not None:
                removed += found.removed
            committed = [s for s in self.list_committed() if upto_step is None or s <= upto_step]
            found = find_chain(committed, self.info, verify)
            if not found.removed:
                break
        if record:
            self.removed_steps.update(removed + list(found.removed))
            first = found.steps[0] if found.steps else None
            self._report([(s, REMOVED) for s in removed if s not in found.removed] + found.skipped_fulls, first)
            if found.stopped_before is not None:
                self._report([found.stopped_before], found.steps[-1])
        return found.steps

    def _report(self, skipped: list[tuple[int, str]], fallback_step: int | None) -> None:
        target = f"falling back to step {fallback_step}" if fallback_step is not None else "no older valid checkpoint"
        for step, reason in skipped:
            if (step, reason) in self._reported:
                continue
            self._reported.add((step, reason))
            if reason.startswith(REMOVED):
                logger.warning("checkpoint step %d was %s; %s", step, reason, target)
            else:
                logger.warning("checkpoint step %d is corrupt: %s; %s", step, reason, target)
            self.fallbacks.append((step, reason))

    def _verify_files(self, info: CheckpointInfo) -> CheckpointInfo:
        """``verify`` of a parsed manifest; the verdict is kept for ``_verify_once``."""
        step, names = info.step, sorted(info.files)
        try:
            # Metadata first: a missing or truncated file is found without reading anything.
            for name, file_info in zip(names, self._fs.get_file_info([self._path(step, n) for n in names])):
                self._check_size(step, info.files[name], file_info)
            for name in names:
                entry = info.files[name]
                hasher = new_hasher(checksum_algo(entry))
                try:
                    with self._fs.open_input_stream(self._path(step, name), compression=None) as f:
                        while chunk := f.read_buffer(_VERIFY_CHUNK_BYTES):
                            hasher.update(chunk)
                except FileNotFoundError:
                    raise CheckpointCorrupt(f"checkpoint step {step}: file {name} is missing") from None
                self._check_checksum(step, entry, hasher)
        except CheckpointCorrupt as exc:
            self._unless_removed(step)
            self._corrupt[step] = (info, str(exc))
            raise
        self._valid[step] = info
        return info

    def mark_corrupt(self, step: int, reason: str) -> None:
        """A reader elsewhere (a shard loading its file) found checkpoint ``step`` corrupt:
        chains of this instance pass over it from now on, as if this instance had found it."""
        self._valid.pop(step, None)
        try:
            self._corrupt[step] = (self.info(step), reason)
        except Exception:  # noqa: BLE001 - its manifest is gone or unreadable: no chain uses it anyway
            pass

    def _verify_once(self, info: CheckpointInfo) -> CheckpointInfo:
        """``_verify_files`` unless a verdict on this very manifest is known."""
        if self._valid.get(info.step) == info:
            return info
        known = self._corrupt.get(info.step)
        if known is not None and known[0] == info:
            raise CheckpointCorrupt(known[1])
        return self._verify_files(info)

    def _scan(self) -> tuple[list[int], list[int]]:
        """(committed steps, uncommitted step directories), each ascending."""
        selector = pafs.FileSelector(self._root, allow_not_found=True, recursive=False)
        steps = sorted(
            int(m.group(1))
            for entry in self._fs.get_file_info(selector)
            if entry.type == pafs.FileType.Directory and (m := STEP_DIR_RE.match(entry.base_name))
        )
        manifests = self._fs.get_file_info([self._path(s, MANIFEST_FILE) for s in steps])
        committed = [s for s, m in zip(steps, manifests) if m.type == pafs.FileType.File]
        uncommitted = [s for s, m in zip(steps, manifests) if m.type != pafs.FileType.File]
        return committed, uncommitted

    def _unless_removed(self, step: int) -> None:
        """Raises CheckpointNotFound if the manifest of ``step`` is gone: a file found missing
        then went with its checkpoint (retention or a fence), which is not corrupt."""
        if self._fs.get_file_info(self._path(step, MANIFEST_FILE)).type != pafs.FileType.File:
            raise CheckpointNotFound(f"checkpoint step {step} under {self.uri} was {REMOVED}")

    def _read_verified(self, step: int, name: str) -> pa.Buffer:
        try:
            return self._read_listed(step, name)
        except CheckpointCorrupt:
            self._unless_removed(step)
            raise

    def _read_listed(self, step: int, name: str) -> pa.Buffer:
        info = self.info(step)
        entry = info.files.get(name)
        if entry is None:
            # Committed without it: the checkpoint cannot restore what the file would hold.
            raise CheckpointCorrupt(f"checkpoint step {step} lists no file {name}; it lists {sorted(info.files)}")
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
        actual = checksum_of(buffer, checksum_algo(entry))  # chunked: on every core
        if actual != entry.checksum:
            raise CheckpointCorrupt(
                f"checkpoint step {step}: file {entry.name} has checksum {actual}, expected {entry.checksum}"
            )
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
        return join(self._root, step_dir_name(step), name)

