"""Storage every host of a cluster must see where the run keeps it on a local path: the
microbatch store (preprocessing tasks write it, trainers read it) and the checkpoints (each
shard writes and reads its own files there).

On one node this holds by construction. On a cluster, a path that is local to each host
would be read wrongly (another host's file of the same name, or none) or written where the
supervisor cannot commit it, so the driver checks it before preprocessing: it writes a
probe file into each such directory, and a task on every alive node reads the probes back
by path. A node that cannot is refused with the path, the node and what to do. Object-store
URIs (``s3://``, ``gs://``...) are shared by nature and not probed: a cluster whose data and
checkpoints live in object storage needs no shared directory.
"""

from __future__ import annotations

import logging
from pathlib import Path

import ray

from actors.nodes import other_nodes, pinned
from core.errors import ConfigError
from core.storage import expected_files, problems

__all__ = ["expected_files", "problems", "check_every_node"]

logger = logging.getLogger(__name__)


def _node_problems(expected: dict[str, dict]) -> tuple[str, list[str]]:
    return ray.util.get_node_ip_address(), problems(expected)


def check_every_node(expected: dict[str, dict], timeout_s: float = 60.0) -> None:
    """Raises ConfigError unless every alive node of the cluster sees ``expected``. Nothing
    to do on a single node (the driver wrote the files there)."""
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
            "at the same path (NFS, EFS...), or give them object-store URIs (s3://, gs://)"
        )
    logger.info("every node sees the run's local storage (%d probes checked)", len(expected))
