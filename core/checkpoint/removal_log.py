"""The audit's record of the checkpoints retention removes (``audit_log``): ``cpr verify``
checks every committed checkpoint's files against its manifest at the end of a run, and a
checkpoint retention removed before then would go unchecked. So, before its manifest goes,
the supervisor appends to ``<audit_dir>/retention.jsonl`` what the checker needs to verify it
afterwards (``CheckpointStore.rehash``), one JSON line each, synced before the removal:

    {"t", "event": "open", "pid", "host"}                      first, by each writing process
    {"t", "event": "remove", "why": "retention", "step",
     "manifest": {...} | None, "manifest_error"?: str,          the manifest, as on storage
     "files": {name: {"size_bytes", "checksum"} |               each file it lists, hashed
                     {"size_bytes": None, "checksum": None, "error"}}}   again from its bytes
"""

from __future__ import annotations

import json
import os
import socket
import time
from typing import IO

__all__ = ["REMOVAL_LOG", "RemovalLog"]

REMOVAL_LOG = "retention.jsonl"


class RemovalLog:
    """Appends to ``<audit_dir>/retention.jsonl``; a CheckpointStore's ``audit_removal``."""

    def __init__(self, audit_dir: str):
        self.path = os.path.join(audit_dir, REMOVAL_LOG)
        self._file: IO[str] | None = None

    def __call__(self, step: int, found: dict) -> None:
        """Checkpoint ``step`` is about to be removed by retention; ``found``: ``rehash``'s."""
        if self._file is None:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            self._file = open(self.path, "a", buffering=1)
            self._write({"event": "open", "pid": os.getpid(), "host": socket.gethostname()})
        self._write({"event": "remove", "why": "retention", "step": step, **found})

    def _write(self, record: dict) -> None:
        self._file.write(json.dumps({"t": round(time.time(), 6), **record}) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())  # on disk before the checkpoint is not
