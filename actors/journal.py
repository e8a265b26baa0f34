"""The supervisor's write-ahead journal: one JSON document in ``<run_dir>/supervisor_state.json``.

It holds the state machine's current state (with the intent in flight: which shards, which
generations, which chain), the committed fleet, the save schedule, failures and events.
Every write replaces the file atomically (temp file + rename), so a supervisor killed at any
point finds either the old or the new document, never half of one.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

__all__ = ["Journal", "STATE_FILE"]

STATE_FILE = "supervisor_state.json"


class Journal:
    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / STATE_FILE
        self._tmp = Path(run_dir) / f".{STATE_FILE}.tmp"

    def exists(self) -> bool:
        return self.path.exists()

    def load(self) -> dict:
        return json.loads(self.path.read_text())

    def write(self, doc: dict) -> None:
        self._tmp.write_text(json.dumps(doc, default=str))
        os.replace(self._tmp, self.path)
