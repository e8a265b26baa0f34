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

__all__ = ["Journal", "RunLog", "STATE_FILE", "EVENTS_FILE", "PROGRESS_FILE"]

STATE_FILE = "supervisor_state.json"
EVENTS_FILE = "events.jsonl"
PROGRESS_FILE = "progress.jsonl"


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


class RunLog:
    """``events.jsonl`` and ``progress.jsonl`` in the run directory, appended as the run goes,
    so that ``cpr report`` can draw a run whose driver died before writing its report.

    The journal stays the source of truth: a restarted supervisor rewrites ``events.jsonl``
    from it (an event appended here but lost from the journal by the restart goes too).
    """

    def __init__(self, run_dir: Path, fresh: bool):
        self.events_path = Path(run_dir) / EVENTS_FILE
        self.progress_path = Path(run_dir) / PROGRESS_FILE
        mode = "w" if fresh else "a"
        self._events = open(self.events_path, mode, buffering=1)
        self._progress = open(self.progress_path, mode, buffering=1)

    def event(self, event: dict) -> None:
        self._events.write(json.dumps(event, default=str) + "\n")

    def progress(self, record: dict) -> None:
        self._progress.write(json.dumps(record, default=str) + "\n")

    def rewrite_events(self, events: list[dict]) -> None:
        tmp = self.events_path.with_name(f".{EVENTS_FILE}.tmp")
        tmp.write_text("".join(json.dumps(e, default=str) + "\n" for e in events))
        os.replace(tmp, self.events_path)
        self._events.close()
        self._events = open(self.events_path, "a", buffering=1)
