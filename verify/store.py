"""The checkpoint files, read with the checker's own code: every committed checkpoint's files
hashed against its manifest, and a shard's saved rows read back for the lost-samples recount."""

from __future__ import annotations

import hashlib
import json
import re

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs

__all__ = ["Store", "DENSE_FILE", "files_missing", "files_read", "plan_slices", "shard_file"]

_STEP_DIR = re.compile(r"^ckpt-(\d{12})$")
_FENCED_DIR = re.compile(r"^ckpt-(\d{12})-(\d+)$")
_SHARD_FILE = re.compile(r"^shard-(\d+)\.arrow$")
_CHUNK = 8 << 20
# "<algo>" hashes the whole file; "<algo>c<MiB>" the digests of its MiB-sized chunks.
_ALGO = re.compile(r"(sha256|sha512|blake2b)(?:c([1-9][0-9]{0,3}))?")  # fullmatch; chunks up to 1024 MiB
DENSE_FILE = "dense.pt"


def shard_file(k: int) -> str:
    return f"shard-{k}.arrow"


def plan_slices(manifest: dict) -> list[list[tuple[int, int, int]]] | None:
    """The rows each shard file holds, ``[(table, row_start, row_end), ...]`` per shard, as the
    manifest's plan records them; None where it records none (an older writer) or not as a list
    of shards of such triples."""
    plan = (manifest.get("meta") or {}).get("plan") if isinstance(manifest, dict) else None
    try:
        return [[(int(t), int(a), int(b)) for t, a, b in shard] for shard in plan["shards"]]
    except (KeyError, TypeError, ValueError):
        return None


def files_read(shard: int, slices, written: list | None) -> list[int]:
    """The shard files a load by ``shard``, holding ``slices`` ((table, row_start, row_end)
    each), read of a checkpoint whose plan gave each file ``written``'s rows: its own where that
    plan gave it these very rows (or records none), else every file holding some of its rows."""
    mine = sorted(tuple(int(x) for x in s) for s in slices)
    if written is None or (shard < len(written) and sorted(written[shard]) == mine):
        return [shard]
    return [j for j, held in enumerate(written) if any(t == u and a < f and c < b for t, a, b in held for u, c, f in mine)]


def files_missing(step: int, files: dict, shards: int | None, manifest: dict | None = None) -> list[str]:
    """What a checkpoint of a run of ``shards`` shards must hold and whose manifest ``files``
    does not list: the dense state and every shard's file (a shard writes one in every save,
    its rows or none of them). A ``manifest`` that records its plan says how many shards wrote
    it (a resume may have changed the run's number since). ``shards`` None: not checked."""
    recorded = plan_slices(manifest) if manifest is not None else None
    if recorded is not None:
        shards = len(recorded)
    if shards is None:
        return []
    wanted = [DENSE_FILE] + [shard_file(k) for k in range(shards)]
    return [f"checkpoint {step}: its manifest lists no {name} (the run has {shards} shards)"
            for name in wanted if name not in files]


class Store:
    def __init__(self, uri: str):
        self.fs, self.root = pafs.FileSystem.from_uri(uri)
        self.uri = uri

    def _path(self, step: int, name: str | None = None) -> str:
        d = f"{self.root.rstrip('/')}/ckpt-{step:012d}"
        return d if name is None else f"{d}/{name}"

    def committed(self) -> list[int]:
        """Steps whose directory holds a manifest (what commits a checkpoint)."""
        try:
            infos = self.fs.get_file_info(pafs.FileSelector(self.root, allow_not_found=True))
        except (OSError, pa.ArrowException):
            return []
        steps = []
        for info in infos:
            m = _STEP_DIR.match(info.base_name)
            if m and self.fs.get_file_info(self._path(int(m.group(1)), "manifest.json")).type == pafs.FileType.File:
                steps.append(int(m.group(1)))
        return sorted(steps)

    def fenced(self) -> dict[int, list[tuple[float, float, str]]]:
        """The checkpoints a rollback fenced that an audited run kept aside (``fenced/ckpt-<step>-
        <ms>``): step -> [(committed at, by its manifest; fenced at; its directory)]."""
        out: dict[int, list[tuple[float, float, str]]] = {}
        try:
            infos = self.fs.get_file_info(pafs.FileSelector(f"{self.root.rstrip('/')}/fenced", allow_not_found=True))
        except (OSError, pa.ArrowException):
            return out
        for info in infos:
            m = _FENCED_DIR.match(info.base_name)
            if m is None:
                continue
            try:
                with self.fs.open_input_stream(f"{info.path}/manifest.json") as f:
                    committed = float(json.loads(f.read())["created_s"])
            except (OSError, ValueError, KeyError, TypeError, pa.ArrowException):
                continue
            out.setdefault(int(m.group(1)), []).append((committed, int(m.group(2)) / 1000, info.path))
        return out

    def commit_time(self, step: int) -> float | None:
        """When the manifest of ``step`` was written, by the filesystem's clock (None: no such
        checkpoint). A step fenced by a rollback is saved again later under the same number."""
        info = self.fs.get_file_info(self._path(step, "manifest.json"))
        if info.type != pafs.FileType.File or info.mtime is None:
            return None
        return info.mtime.timestamp()

    def plan_in(self, directory: str) -> list[list[tuple[int, int, int]]] | None:
        """``plan_slices`` of the manifest of the checkpoint in ``directory`` (a fenced copy
        keeps its own); None where it cannot be read or records no plan."""
        try:
            with self.fs.open_input_stream(f"{directory}/manifest.json") as f:
                return plan_slices(json.loads(f.read()))
        except (OSError, ValueError):
            return None

    def shard_files(self, step: int) -> list[int]:
        """The shards whose file the manifest of ``step`` lists, ascending."""
        names = self.manifest(step).get("files") or {}
        return sorted(int(m.group(1)) for n in names if (m := _SHARD_FILE.match(n)))

    def manifest(self, step: int) -> dict:
        with self.fs.open_input_stream(self._path(step, "manifest.json")) as f:
            return json.loads(f.read())

    def problems(self, step: int, shards: int | None = None) -> list[str]:
        """What does not match the manifest of ``step``: a file missing, of another size, or
        whose bytes hash to another digest; with ``shards`` (the run's number), also a manifest
        that lists no dense state or no file of some shard (``files_missing``)."""
        try:
            manifest = self.manifest(step)
            files = manifest["files"]
        except (OSError, ValueError, KeyError, TypeError) as err:
            return [f"checkpoint {step}: its manifest is unreadable ({err})"]
        if manifest.get("step") != step:
            return [f"checkpoint {step}: its manifest names step {manifest.get('step')}"]
        if not isinstance(files, dict):
            return [f"checkpoint {step}: its manifest's files are not a mapping"]
        out = files_missing(step, files, shards, manifest)
        for name, entry in sorted(files.items()):
            algo, _, digest = str(entry.get("checksum", "")).partition(":")
            m = _ALGO.fullmatch(algo)
            if "/" in name or name.startswith(".") or m is None or int(m.group(2) or 0) > 1024:
                out.append(f"checkpoint {step}: file entry {name!r} with checksum {entry.get('checksum')!r} is not one "
                           "its writer makes")
                continue
            try:
                size, hexdigest = self._hash(self._path(step, name), m.group(1), int(m.group(2) or 0) << 20)
            except (OSError, pa.ArrowException) as err:
                out.append(f"checkpoint {step}: file {name} cannot be read ({err})")
                continue
            if size != entry.get("size_bytes"):
                out.append(f"checkpoint {step}: file {name} holds {size} bytes, its manifest says {entry.get('size_bytes')}")
            elif hexdigest != digest:
                out.append(f"checkpoint {step}: file {name} hashes to {algo}:{hexdigest[:16]}..., "
                           f"its manifest says {digest[:16]}...")
        return out

    def _hash(self, path: str, algo: str, chunk: int) -> tuple[int, str]:
        """(size, hex digest) of a file: ``algo`` over its bytes, or with ``chunk`` over the
        digests of its consecutive ``chunk``-byte pieces (an empty file is one empty piece)."""
        whole, piece, filled, size, pieces = hashlib.new(algo), hashlib.new(algo), 0, 0, 0
        with self.fs.open_input_stream(path) as f:
            while data := f.read(min(_CHUNK, chunk - filled) if chunk else _CHUNK):
                size += len(data)
                if not chunk:
                    whole.update(data)
                    continue
                piece.update(data)
                filled += len(data)
                if filled == chunk:
                    whole.update(piece.digest())
                    piece, filled, pieces = hashlib.new(algo), 0, pieces + 1
        if chunk and (filled or not pieces):
            whole.update(piece.digest())
        return size, whole.hexdigest()

    def shard_rows(self, step: int, shard: int) -> tuple[np.ndarray, np.ndarray]:
        """(table, row) of every row shard ``shard`` saved in checkpoint ``step``."""
        with self.fs.open_input_file(self._path(step, shard_file(shard))) as f:
            reader = pa.ipc.open_file(f)
            tables, rows = [], []
            for i in range(reader.num_record_batches):
                batch = reader.get_batch(i)
                tables.append(batch.column("table").to_numpy(zero_copy_only=False).astype(np.int64))
                rows.append(batch.column("row").to_numpy(zero_copy_only=False).astype(np.int64))
        return np.concatenate(tables), np.concatenate(rows)
