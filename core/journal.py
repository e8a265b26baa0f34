"""The supervisor's files in the run directory.

- ``supervisor_state.json``, the write-ahead journal: JSON lines, a snapshot of every part's
  section first, then one line per write holding only what changed since the write before
  (a section, or the keys of a dict section), so that a write costs what changed, not what
  the run accumulated. A write is one line, appended and flushed: a supervisor killed in the
  middle leaves a torn last line, which reading drops. Once the lines outweigh the snapshot,
  the next write replaces the file with a new snapshot (temp file + rename).
- ``trainer_book.jsonl``: the high-rate records (every commit, failed step and broken group),
  appended, replayed by a restarted or resumed supervisor.
- ``events.jsonl``: every event, appended by the supervisor's event log; the journal records
  how far it reached at each write. ``progress.jsonl``: every progress report. A resumed run
  appends to all of them.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import threading
from collections.abc import Iterator
from pathlib import Path

from core.checkpoint import CheckpointStore
from core.codec import encode
from core.data.sources import shown
from core.errors import ConfigError

__all__ = ["Journal", "AppendLog", "RunLog", "flat_view", "refuse_another_run", "refuse_old_journal", "STATE_FILE",
           "BOOK_FILE", "EVENTS_FILE", "PROGRESS_FILE", "JOURNAL_FORMAT"]

# 3: change lines after a snapshot; events and progress in their own files (the journal keeps
# the events the supervisor reads back and the events file's length). One of format 2 (a
# single document, every event in it) is not read: ``--resume`` refuses it, saying so.
JOURNAL_FORMAT = 3

STATE_FILE = "supervisor_state.json"
BOOK_FILE = "trainer_book.jsonl"
EVENTS_FILE = "events.jsonl"
PROGRESS_FILE = "progress.jsonl"

# A new snapshot once the change lines since the last one reach this share of its size (and
# this many bytes): a write costs its change plus, amortized, a constant share of the state.
_COMPACT_RATIO = 4.0
_COMPACT_MIN_BYTES = 256 * 1024


def _texts(doc: dict) -> dict[str, object]:
    """Each section as JSON text; a dict section as JSON text per key (a change line then
    carries only the keys that changed)."""
    out: dict[str, object] = {}
    for name, value in doc.items():
        if isinstance(value, dict):
            out[name] = {str(k): json.dumps(v, default=str) for k, v in value.items()}
        else:
            out[name] = json.dumps(value, default=str)
    return out


def _obj(pairs: dict[str, str]) -> str:
    return "{" + ", ".join(f"{json.dumps(k)}: {t}" for k, t in pairs.items()) + "}"


class Journal:
    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / STATE_FILE
        self._tmp = Path(run_dir) / f".{STATE_FILE}.tmp"
        self._fd: int | None = None  # appending; None: the next write is a snapshot
        self._size = 0
        self._written: dict[str, object] = {}  # what the file holds now, as _texts gives it
        self._snapshot_bytes = 0
        self._lines_bytes = 0  # change lines written since the snapshot
        self.last_write_bytes = 0  # bytes the last write put on disk (measured by the benchmark)

    def exists(self) -> bool:
        return self.path.exists()

    def load(self) -> dict:
        """The document of the last complete write: the snapshot with every change line
        applied in order (a torn last line is a write that did not happen)."""
        doc: dict | None = None
        for record in AppendLog.iter(self.path):
            if doc is None:
                doc = record
                continue
            for name, value in record.get("put", {}).items():
                doc[name] = value
            for name, values in record.get("merge", {}).items():
                doc[name] = {**doc.get(name, {}), **values}
            for name, keys in record.get("drop", {}).items():
                for key in keys:
                    doc.get(name, {}).pop(key, None)
        if doc is None:
            raise ValueError(f"{self.path}: empty")
        return doc

    def write(self, doc: dict) -> None:
        texts = _texts(doc)
        due = self._lines_bytes >= max(_COMPACT_MIN_BYTES, _COMPACT_RATIO * self._snapshot_bytes)
        if self._fd is None or due or any(name not in texts for name in self._written):
            self._snapshot(doc, texts)  # (a section that left the document: a snapshot says so)
            return
        line = self._change_line(texts)
        if line is None:
            self.last_write_bytes = 0
            return
        data = line.encode()
        try:
            _append(self._fd, data, self._size)
        except OSError:
            self._close()  # whatever the file holds now, the next write replaces it whole
            raise
        self._written, self._size = texts, self._size + len(data)
        self._lines_bytes += len(data)
        self.last_write_bytes = len(data)

    def _snapshot(self, doc: dict, texts: dict[str, object]) -> None:
        data = (json.dumps(doc, default=str) + "\n").encode()
        self._close()
        self._tmp.write_bytes(data)
        os.replace(self._tmp, self.path)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
        self._written, self._size, self._snapshot_bytes, self._lines_bytes = texts, len(data), len(data), 0
        self.last_write_bytes = len(data)

    def _close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _change_line(self, texts: dict[str, object]) -> str | None:
        """One line with the sections (or keys of dict sections) that differ from the file."""
        put, merge, drop = {}, {}, {}
        for name, text in texts.items():
            old = self._written.get(name)
            if isinstance(text, dict) and isinstance(old, dict):
                changed = {k: t for k, t in text.items() if old.get(k) != t}
                if changed:
                    merge[name] = _obj(changed)
                if gone := [k for k in old if k not in text]:
                    drop[name] = json.dumps(gone)
            elif text != old:
                put[name] = _obj(text) if isinstance(text, dict) else text
        parts = {key: _obj(group) for key, group in (("put", put), ("merge", merge), ("drop", drop)) if group}
        return _obj(parts) + "\n" if parts else None


def refuse_another_run(run_dir: Path, checkpoint_uri: str | None) -> None:
    """A new run does not start over another run's checkpoints or journal (``--resume``
    continues that run): one ConfigError naming what is there, before anything is written."""
    again = f"continue that run with `cpr train --resume {run_dir}`, or leave run_dir out: each run then gets its own"
    if checkpoint_uri is not None and (existing := CheckpointStore(checkpoint_uri).list_committed()):
        raise ConfigError(f"{shown(checkpoint_uri)} already holds checkpoints of steps {existing[:3]}...; {again}")
    journal = Journal(run_dir)
    if not journal.exists():
        return
    try:
        other = f"run {journal.load().get('run_id')}"
    except (OSError, ValueError):
        other = "another run (unreadable)"
    raise ConfigError(f"{run_dir} holds the journal of {other} ({STATE_FILE}); {again}")


def refuse_old_journal(run_dir: Path) -> None:
    """``--resume`` continues from the run's journal: one of another format (written by
    another version of cpr) is refused with a ConfigError naming it, before anything starts."""
    journal = Journal(run_dir)
    if not journal.exists():
        return
    try:
        found = journal.load().get("format")
    except (OSError, ValueError) as err:
        raise ConfigError(f"--resume {run_dir}: its journal ({STATE_FILE}) cannot be read: {err}") from None
    if found != JOURNAL_FORMAT:
        raise ConfigError(f"--resume {run_dir}: its journal ({STATE_FILE}) has format {found}, written by another "
                          f"version of cpr; this one reads format {JOURNAL_FORMAT} and cannot continue that run")


def flat_view(doc: dict) -> dict:
    """What a reader of a crashed run needs from the journal, whatever its sections: run id,
    attempt, state, events, progress, failures, kills, heals, evaluation, resume step,
    supervisor restarts, the checkpoint interval in use and the failed saves. A journal of the
    first format (one flat document) is already that. From the third format on, the journal
    keeps only the events the supervisor reads back (``events.jsonl`` has every one) and the
    last progress records (``progress.jsonl`` has every one)."""
    if doc.get("format") not in (2, 3):
        return doc
    controller, ledger, trainers = doc.get("controller") or {}, doc.get("ledger") or {}, doc.get("trainers") or {}
    events = doc.get("events")
    if isinstance(events, dict):
        events = sorted((e for kept in (events.get("kept") or {}).values() for e in kept), key=lambda e: e["time"])
    return {
        "run_id": doc.get("run_id"), "attempt": doc.get("attempt"), "state": controller.get("state"),
        "events": events, "progress": trainers.get("progress"), "failures": ledger.get("failures"),
        "kills": ledger.get("kills"), "heals": trainers.get("heals"), "attempt_starts": trainers.get("attempt_starts"),
        "prunes": trainers.get("prunes"), "eval": doc.get("eval"),
        "resume_step": controller.get("resume_step"), "supervisor_restarts": doc.get("supervisor_restarts"),
        "schedule": {k: (doc.get("checkpoints") or {}).get(k)
                     for k in ("interval_steps_in_use", "failed_saves", "longest_failed_in_a_row")},
    }


class AppendLog:
    """A JSON-lines file appended one record at a time (flushed per line: a process killed by
    a signal loses nothing written before). Reading tolerates a torn last line only, the
    trace of a writer killed mid-line; a bad line before it is an error. ``size``: the bytes
    in the file, where the next record goes."""

    def __init__(self, path: Path, fresh: bool = False):
        self.path = Path(path)
        if not fresh:
            self._drop_torn_tail()
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | (os.O_TRUNC if fresh else 0), 0o644)
        self.size = os.fstat(self._fd).st_size
        self._failed = False

    def _drop_torn_tail(self) -> None:
        """A line torn by a killed writer is cut before appending, or it would end up in the
        middle of the file, where reading refuses it."""
        if not self.path.exists():
            return
        with open(self.path, "r+b") as f:
            end = f.seek(0, os.SEEK_END)
            start = end
            while start > 0:  # back to the last newline, a chunk at a time (the file may be long)
                start = max(0, start - 64 * 1024)
                f.seek(start)
                cut = f.read(end - start).rfind(b"\n")
                if cut >= 0:
                    if start + cut + 1 < end:
                        f.truncate(start + cut + 1)
                    return
            f.truncate(0)

    def append(self, record: dict) -> None:
        """One line, written whole or not at all (a failed write, a full disk, is cut back off
        and raised: the file never holds half a record before another)."""
        data = (json.dumps(encode(record), default=str) + "\n").encode()
        if self._failed:  # the last write failed and may not have been cut back: cut it now
            os.ftruncate(self._fd, self.size)
            self._failed = False
        try:
            _append(self._fd, data, self.size)
        except OSError:
            self._failed = True
            raise
        self.size += len(data)

    def cut(self, size: int) -> bool:
        """Drops what follows byte ``size`` (records appended after the state the caller went
        back to). False, and nothing cut, when ``size`` is not the end of a line of the file."""
        if size >= self.size:
            return size == self.size
        if size > 0:
            with open(self.path, "rb") as f:
                f.seek(size - 1)
                if f.read(1) != b"\n":
                    return False
        os.ftruncate(self._fd, size)
        self.size = size
        return True

    def close(self) -> None:
        os.close(self._fd)

    @staticmethod
    def iter(path: Path, end: int | None = None) -> Iterator[dict]:
        """The records in order, one line in memory at a time (up to byte ``end``)."""
        if not Path(path).exists():
            return
        with open(path, "rb") as f:
            previous, n = None, 0
            for raw in f if end is None else _lines_upto(f, end):
                if previous is not None:
                    yield _parse(path, n, previous, last=False)
                previous, n = raw, n + 1
            if previous is not None and (record := _parse(path, n, previous, last=True)) is not None:
                yield record

    @staticmethod
    def read(path: Path) -> list[dict]:
        return list(AppendLog.iter(path))

    @staticmethod
    def tail(path: Path, end: int, count: int) -> list[dict]:
        """The last ``count`` records before byte ``end``, read from the end (what follows a
        restart needs of a long file, without reading all of it)."""
        if count <= 0 or end <= 0 or not Path(path).exists():
            return []
        chunk, data = 64 * 1024, b""
        with open(path, "rb") as f:
            start = end
            while start > 0 and data.count(b"\n") <= count:
                start = max(0, start - chunk)
                f.seek(start)
                data = f.read(end - start)
        lines = data.split(b"\n")
        if start > 0:
            lines = lines[1:]  # the first line read is cut
        out = [json.loads(line) for line in lines if line.strip()]
        return out[-count:]


def _append(fd: int, data: bytes, size: int) -> None:
    """Appends ``data`` to the file open at ``fd`` (``size`` bytes long) in one write; a short
    or failed write is cut back to ``size`` and raised."""
    try:
        if os.write(fd, data) != len(data):
            raise OSError(errno.ENOSPC, "short write")
    except OSError:
        with contextlib.suppress(OSError):  # the caller cuts again before its next write
            os.ftruncate(fd, size)
        raise


def _lines_upto(f, end: int) -> Iterator[bytes]:
    read = 0
    for raw in f:
        if read + len(raw) > end:
            return
        read += len(raw)
        yield raw


def _parse(path: Path, n: int, raw: bytes, last: bool) -> dict | None:
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        if last:
            return None
        raise ValueError(f"{path}:{n}: not a JSON record, and not the last line") from None


class RunLog:
    """``progress.jsonl`` in the run directory, appended as the run goes (so that ``cpr
    report`` can draw a run whose driver died) and read back for the report: the supervisor
    keeps only the last records in memory."""

    def __init__(self, run_dir: Path, fresh: bool):
        self.progress_path = Path(run_dir) / PROGRESS_FILE
        self._progress = AppendLog(self.progress_path, fresh=fresh)
        self._lock = threading.Lock()  # reports come on several of the supervisor's threads

    def progress(self, record: object) -> None:
        with self._lock:
            self._progress.append(record)

    def read_progress(self) -> list[dict]:
        return sorted(AppendLog.iter(self.progress_path), key=lambda r: r.get("time") or 0.0)
