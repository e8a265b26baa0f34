"""What every host of a cluster must share with the driver when the run keeps it on a local
path: the input files (preprocessing tasks read them on any host), the microbatch store
(preprocessing tasks write it and trainers read it on every host) and the checkpoint
directory (each shard writes and reads its own files there).
``expected_files`` writes a fresh probe into each such directory; ``problems`` says what this
host does not see. Object-store URIs (``s3://``, ``gs://``...) are shared by nature and not
probed. ``app.storage`` runs the check on every node before preprocessing.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from core.checkpoint import local_path

__all__ = ["expected_files", "problems", "PROBE"]

PROBE = ".cpr-storage-probe-{run_id}"


def expected_files(cache_uri: str, checkpoint_uri: str, run_id: str,
                   inputs: tuple[tuple[str, str, int], ...] = ()) -> dict[str, dict]:
    """What every node must see: the input files given by local path (``(field, path, size)``:
    preprocessing tasks read them anywhere), and a fresh probe file (with its content) in the
    store's and the checkpoints' directories where they are local paths. Returns ``{path:
    {"field", "size", "content"}}``; the probes are removed by ``check_every_node``."""
    out = {path: {"field": field, "size": size, "content": None} for field, path, size in inputs}
    for field, uri in (("data.cache_dir", cache_uri), ("checkpoint.storage", checkpoint_uri)):
        directory = local_path(uri)
        if directory is None:
            continue
        Path(directory).mkdir(parents=True, exist_ok=True)
        probe = Path(directory) / PROBE.format(run_id=run_id)
        content = secrets.token_hex(16)
        probe.write_text(content)
        out[str(probe)] = {"field": field, "size": len(content), "content": content}
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
