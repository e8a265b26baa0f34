"""Storage every host of a cluster must see: the microbatch cache (trainers memory-map it by
path) and the checkpoints (each shard writes and reads its own files there).

On one node this holds by construction. On a cluster, a path that is local to each host
would be read wrongly (another host's file of the same name, or none) or written where the
supervisor cannot commit it, so the driver checks it before any trainer starts: it writes
a probe file into the checkpoint directory, and a task on every alive node reads the probe
and the cache files back by path. A node that cannot is refused with the path, the node and
what to do. Object-store checkpoint URIs (``s3://``, ``gs://``...) are shared by nature and
not probed.
"""

from __future__ import annotations

import logging
import os
import secrets
from pathlib import Path

from actors.checkpoint import local_path
from app.errors import ConfigError

__all__ = ["expected_files", "problems", "check_every_node"]

logger = logging.getLogger(__name__)

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


def _node_problems(expected: dict[str, dict]) -> tuple[str, list[str]]:
    import ray

    return ray.util.get_node_ip_address(), problems(expected)


def check_every_node(expected: dict[str, dict], timeout_s: float = 60.0) -> None:
    """Raises ConfigError unless every alive node of the cluster sees ``expected``. Nothing
    to do on a single node (the driver wrote the files there)."""
    import ray

    from actors.nodes import other_nodes, pinned

    try:
        refs = [pinned(_node_problems, node).remote(expected) for node in other_nodes()]
        found = [f"host {ip}: {p}" for ip, ps in ray.get(refs, timeout=timeout_s) for p in ps]
    finally:
        for path, want in expected.items():
            if want["content"] is not None:
                Path(path).unlink(missing_ok=True)
    if found:
        raise ConfigError(
            "the run's storage is not shared by every host of the cluster: " + "; ".join(found[:6])
            + ". Put data.cache_dir and checkpoint.storage (or run_dir) on storage that every node mounts "
            "at the same path (NFS, EFS...), or give checkpoint.storage an object-store URI (s3://, gs://)"
        )
    logger.info("every node sees the cache and the checkpoint directory (%d files checked)", len(expected))
