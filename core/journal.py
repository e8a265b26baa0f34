"""The supervisor's files in the run directory.

- ``supervisor_state.json``, the write-ahead journal: one JSON document with a section per
  part of the supervisor (the recovery state with its intent in flight, the committed fleet,
  the save schedule, failures, events...). Every write replaces the file atomically (temp
  file + rename), so a supervisor killed at any point finds the old or the new document.
- ``trainer_book.jsonl``: the high-rate records (every commit, failed step and broken group),
  appended instead of rewritten, replayed by a restarted or resumed supervisor.
- ``events.jsonl`` and ``progress.jsonl``: appended as the run goes, for ``cpr report`` on a
  run whose driver died. A resumed run appends to all of them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from core.checkpoint import CheckpointStore
from core.codec import encode
from core.errors import ConfigError

__all__ = ["Journal", "AppendLog", "RunLog", "flat_view", "refuse_another_run", "STATE_FILE", "BOOK_FILE",
           "EVENTS_FILE", "PROGRESS_FILE"]

STATE_FILE = "supervisor_state.json"
BOOK_FILE = "trainer_book.jsonl"
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


def refuse_another_run(run_dir: Path, checkpoint_uri: str | None) -> None:
    """A new run does not start over another run's checkpoints or journal (``--resume``
    continues that run): one ConfigError naming what is there, before anything is written."""
    again = f"continue that run with `cpr train --resume {run_dir}`, or leave run_dir out: each run then gets its own"
    if checkpoint_uri is not None and (existing := CheckpointStore(checkpoint_uri).list_committed()):
        raise ConfigError(f"{checkpoint_uri} already holds checkpoints of steps {existing[:3]}...; {again}")
    journal = Journal(run_dir)
    if not journal.exists():
        return
    try:
        other = f"run {journal.load().get('run_id')}"
    except (OSError, ValueError):
        other = "another run (unreadable)"
    raise ConfigError(f"{run_dir} holds the journal of {other} ({STATE_FILE}); {again}")


def flat_view(doc: dict) -> dict:
    """What a reader of a crashed run needs from the journal, whatever its sections: run id,
    attempt, state, events, progress, failures, kills, heals, evaluation, resume step,
    supervisor restarts, the checkpoint interval in use and the failed saves. A journal of the
    first format (one flat document) is already that."""
    if doc.get("format") != 2:
        return doc
    controller, ledger, trainers = doc.get("controller") or {}, doc.get("ledger") or {}, doc.get("trainers") or {}
    return {
        "run_id": doc.get("run_id"), "attempt": doc.get("attempt"), "state": controller.get("state"),
        "events": doc.get("events"), "progress": trainers.get("progress"), "failures": ledger.get("failures"),
        "kills": ledger.get("kills"), "heals": trainers.get("heals"), "eval": doc.get("eval"),
        "resume_step": controller.get("resume_step"), "supervisor_restarts": doc.get("supervisor_restarts"),
        "schedule": {k: (doc.get("checkpoints") or {}).get(k)
                     for k in ("interval_steps_in_use", "failed_saves", "longest_failed_in_a_row")},
    }


class AppendLog:
    """A JSON-lines file appended one record at a time (flushed per line: a process killed by
    a signal loses nothing written before). Reading tolerates a torn last line only, the
    trace of a writer killed mid-line; a bad line before it is an error."""

    def __init__(self, path: Path, fresh: bool = False):
        self.path = Path(path)
        if not fresh:
            self._drop_torn_tail()
        self._file = open(self.path, "w" if fresh else "a", buffering=1)

    def _drop_torn_tail(self) -> None:
        """A line torn by a killed writer is cut before appending, or it would end up in the
        middle of the file, where reading refuses it."""
        if not self.path.exists():
            return
        data = self.path.read_bytes()
        if data and not data.endswith(b"\n"):
            with open(self.path, "r+b") as f:
                f.truncate(data.rfind(b"\n") + 1)

    def append(self, record: dict) -> None:
        self._file.write(json.dumps(encode(record), default=str) + "\n")

    def close(self) -> None:
        self._file.close()

    @staticmethod
    def read(path: Path) -> list[dict]:
        if not Path(path).exists():
            return []
        lines = Path(path).read_text().splitlines()
        out = []
        for n, line in enumerate(lines, 1):
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                if n < len(lines):
                    raise ValueError(f"{path}:{n}: not a JSON record, and not the last line") from None
        return out


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

    def progress(self, record: object) -> None:
        self._progress.write(json.dumps(encode(record), default=str) + "\n")

    def rewrite_events(self, events: list[dict]) -> None:
        tmp = self.events_path.with_name(f".{EVENTS_FILE}.tmp")
        tmp.write_text("".join(json.dumps(e, default=str) + "\n" for e in events))
        os.replace(tmp, self.events_path)
        self._events.close()
        self._events = open(self.events_path, "a", buffering=1)
