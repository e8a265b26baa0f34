"""What every host of a cluster must see as the driver wrote it: the microbatch cache (trainers
memory-map it by path) and the checkpoint directory (each shard writes and reads its own files
there). ``expected_files`` lists them with a fresh probe; ``problems`` says what this host does
not see. ``app.storage`` runs the check on every node before training; trainers run it again.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from core.checkpoint import local_path

__all__ = ["expected_files", "problems", "PROBE"]

PROBE = ".cpr-storage-probe-{run_id}"


def expected_files(cache_files: list[str], checkpoint_uri: str, run_id: str) -> dict[str, dict]:
    """What every node must see: each cache file with its size, and a fresh probe file (with
    its content) written into the checkpoint directory. Returns ``{path: {"field", "size",
    "content"}}``; the probe is removed by ``check_every_node``."""
    out = {p: {"field": "data.cache_dir", "size": os.path.getsize(p), "content": None} for p in cache_files}
    directory = local_path(checkpoint_uri)
    if directory is not None:
        Path(directory).mkdir(parents=True, exist_ok=True)
        probe = Path(directory) / PROBE.format(run_id=run_id)
        content = secrets.token_hex(16)
        probe.write_text(content)
        out[str(probe)] = {"field": "checkpoint.storage", "size": len(content), "content": content}
    return out


def problems(expected: dict[str, dict]) -> list[str]:
    """What this process's host does not see as the driver wrote it."""
    out = []
    for path, want in expected.items():
        try:
            size = os.path.getsize(path)
            content = Path(path).read_text() if want["content"] is not None else None
        except OSError as err:
            out.append(f"{want['field']}: {path} is not there ({err.strerror})")
            continue
        if size != want["size"] or content != want["content"]:
            out.append(f"{want['field']}: {path} is another file here ({size} bytes, the driver's has {want['size']})")
    return out
