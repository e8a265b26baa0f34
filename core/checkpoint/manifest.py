"""A checkpoint's manifest: the JSON that commits it, listing its files with their sizes and
checksums. Parsing refuses anything its writer never produces, so a crafted or damaged
manifest makes its checkpoint corrupt before any reader acts on it.
"""

from __future__ import annotations

import hashlib
import json
import re

from core.checkpoint.checksum import BASE_ALGOS, parse_algo
from core.checkpoint.files import FULL, INCREMENTAL, MANIFEST_FILE, CheckpointInfo, FileEntry, check_file_name
from core.errors import CheckpointCorrupt

__all__ = ["CHECKSUM_ALGOS", "checksum_algo", "manifest_from_json", "manifest_to_json"]

_FORMAT_VERSION = 1
# The algorithms a checksum may name: what writers used (sha256 over the whole file) and use
# (CHECKSUM_ALGO, chunked: core.checkpoint.checksum), and two that a later writer might, each
# whole or chunked. Anything else hashlib offers (shake_*, which need a digest length, md5 ...)
# is no checksum of ours.
CHECKSUM_ALGOS = frozenset(BASE_ALGOS)
_HEX_CHARS = {algo: 2 * hashlib.new(algo).digest_size for algo in CHECKSUM_ALGOS}
_LOWER_HEX = re.compile(r"[0-9a-f]+")


def checksum_algo(entry: FileEntry) -> str:
    """The hash algorithm of an entry from a parsed manifest (its checksum is well-formed)."""
    return entry.checksum.partition(":")[0]


def manifest_to_json(info: CheckpointInfo) -> bytes:
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


def manifest_from_json(raw: bytes, step: int) -> CheckpointInfo:
    """The manifest of ``step`` parsed and checked; CheckpointCorrupt says what is wrong."""
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
    for name, entry in info.files.items():
        # A crafted manifest must not make a reader open anything outside this checkpoint.
        try:
            check_file_name(name)
        except ValueError as exc:
            raise CheckpointCorrupt(f"{where} lists an unsafe file name: {exc}") from None
        problem = _checksum_problem(entry.checksum)
        if problem is not None:
            raise CheckpointCorrupt(f"{where}: file {name} has checksum {entry.checksum!r}: {problem}")
    if info.kind not in (FULL, INCREMENTAL) or (info.kind == INCREMENTAL) != (info.base_step is not None):
        raise CheckpointCorrupt(f"{where} has kind {info.kind!r} with base_step {info.base_step}")
    save_index = info.meta.get("save_index", 0)
    # The coordinator resumes counting saves from it.
    if isinstance(save_index, bool) or not isinstance(save_index, int) or save_index < 0:
        raise CheckpointCorrupt(f"{where} has save_index {save_index!r}, expected an integer >= 0")
    return info


def _checksum_problem(checksum: str) -> str | None:
    """What makes ``checksum`` no "<algo>:<hex digest>" of an allowed algorithm, or None."""
    algo, colon, digest = checksum.partition(":")
    if not colon:
        return "expected '<algorithm>:<hex digest>'"
    try:
        base, _ = parse_algo(algo)
    except ValueError as exc:
        return str(exc)
    if len(digest) != _HEX_CHARS[base] or not _LOWER_HEX.fullmatch(digest):
        return f"expected {_HEX_CHARS[base]} lowercase hex digits after '{algo}:', got {len(digest)} characters"
    return None
