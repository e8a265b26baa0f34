"""Checkpoints that retention removed during the run, checked from the audit's record of them.

``cpr verify`` hashes every checkpoint still committed at the end (``verify.store``); one that
retention removed before then is checked from ``audit/retention.jsonl``, where the supervisor
wrote, before removing it, its manifest and each file's size and checksum computed again from
the bytes on storage (``core.checkpoint.removal_log``): every file the manifest lists must have
been there, of its size and with its checksum, and the manifest must list the dense state and
every shard's file, as a committed one must.
"""

from __future__ import annotations

from verify.files import RunFiles, read_jsonl
from verify.store import files_missing

__all__ = ["REMOVAL_LOG", "check_removed"]

REMOVAL_LOG = "retention.jsonl"


def check_removed(run: RunFiles, damaged: set[tuple[int, str]] | frozenset = frozenset()) -> list[str]:
    """What does not hold of the checkpoints retention removed. ``damaged``: the (step, file)
    the fault injector damaged on purpose (``verify.kills.planted_damage``), whose mismatch is
    expected. A torn line is accepted only as its writer's last (the supervisor killed while
    writing it, before the removal it announced)."""
    path = run.run_dir / "audit" / REMOVAL_LOG
    if not path.exists():
        return []
    records, torn, lines = read_jsonl(path)
    opens = {r["_line"] for r in records if r.get("event") == "open"}
    v = [f"{REMOVAL_LOG} line {i} does not parse and is not its writer's last: {text[:80]!r}"
         for i, text in torn if i != lines and i + 1 not in opens]
    shards = int(run.config.get("embeddings", {}).get("num_shards", 0)) or None
    for r in records:
        if r.get("event") == "remove":
            v += [p for p in removed_problems(r, shards)
                  if not any(p.startswith(f"checkpoint {s}: file {f} ") for s, f in damaged)]
    return v


def removed_problems(record: dict, shards: int | None) -> list[str]:
    """One "remove" record's checkpoint against its own manifest."""
    step, manifest, found = record.get("step"), record.get("manifest"), record.get("files") or {}
    where = f"checkpoint {step}"
    if not isinstance(manifest, dict):
        return [f"{where}: removed by retention with an unreadable manifest ({record.get('manifest_error')})"]
    files = manifest.get("files")
    if manifest.get("step") != step or not isinstance(files, dict):
        return [f"{where}: removed by retention with a manifest of step {manifest.get('step')} listing {files!r:.80}"]
    out = files_missing(step, files, shards, manifest)
    for name, entry in sorted(files.items()):
        seen = found.get(name)
        if not isinstance(entry, dict):
            out.append(f"{where}: file entry {name!r} is {entry!r:.80}")
        elif seen is None:
            out.append(f"{where}: file {name} was not hashed before retention removed it")
        elif seen.get("checksum") is None:
            out.append(f"{where}: file {name} could not be read when retention removed it ({seen.get('error')})")
        elif seen.get("size_bytes") != entry.get("size_bytes"):
            out.append(f"{where}: file {name} held {seen.get('size_bytes')} bytes when retention removed it, "
                       f"its manifest says {entry.get('size_bytes')}")
        elif seen["checksum"] != entry.get("checksum"):
            out.append(f"{where}: file {name} hashed to {str(seen['checksum'])[:24]}... when retention removed it, "
                       f"its manifest says {str(entry.get('checksum'))[:24]}...")
    return out
