"""The fault injector's own log: one JSON line per step of every injected fault, written and
fsynced by the process that acts (the one that sends the signal, stops the process, plants
the file), before it acts and after. ``cpr verify`` reads it to check the supervisor's report,
so nothing here goes through the supervisor.

A line: ``{"t", "event": "sending" | "sent" | "aborted", "fault", "target", "pid", "trigger",
"sender", "host", ...}``. "sending" is written before the act and "sent" after it; an act whose
sender dies with it (the supervisor killing itself) has only its "sending" line.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from pathlib import Path

__all__ = ["FAULT_LOG_DIR", "fault_log_dir", "FaultLog"]

FAULT_LOG_DIR = "faults"


def fault_log_dir(run_dir: str | os.PathLike) -> str:
    return str(Path(run_dir) / FAULT_LOG_DIR)


class FaultLog:
    """Appends to ``<dir>/faults-<host>-<pid namespace>-<pid>.jsonl``, each line made durable before
    return (the PID namespace tells apart the hosts of a namespace cluster, which share a name)."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)

    def write(self, event: str, fault: str, target: str, pid: int | None, trigger: str, t: float | None = None,
              **extra) -> dict:
        record = {"t": time.time() if t is None else t, "event": event, "fault": fault, "target": target, "pid": pid,
                  "trigger": trigger, "sender": os.getpid(), "host": socket.gethostname(), **extra}
        new = not self.directory.exists()
        self.directory.mkdir(parents=True, exist_ok=True)
        if new:
            _fsync_dir(self.directory.parent)
        path = self.directory / f"faults-{socket.gethostname()}-{_pid_namespace()}-{os.getpid()}.jsonl"
        created = not path.exists()
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (json.dumps(record) + "\n").encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        if created:
            _fsync_dir(self.directory)
        return record


def _pid_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def resume_later(pid: int, until: float, log_dir: str, target: str, trigger: str) -> None:
    """Sleeps until ``until`` (epoch seconds), then SIGCONTs ``pid``, logging before and
    after: the end of a stall, run as its own process (``python -m core.faultlog``) so that it
    happens even if the process that stopped the target dies meanwhile."""
    time.sleep(max(0.0, until - time.time()))
    log = FaultLog(log_dir)
    log.write("sending", "resume", target, pid, trigger)
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        log.write("aborted", "resume", target, pid, trigger, error="the process is gone")
        return
    log.write("sent", "resume", target, pid, trigger)


def free_later(path: str, until: float, log_dir: str, trigger: str) -> None:
    """Sleeps until ``until``, then deletes the filler file ``path`` (the end of a full
    storage), logging before and after; its own process, like ``resume_later``."""
    time.sleep(max(0.0, until - time.time()))
    log = FaultLog(log_dir)
    log.write("sending", "free_storage", "storage", None, trigger, file=path)
    try:
        os.unlink(path)
    except FileNotFoundError:
        log.write("aborted", "free_storage", "storage", None, trigger, error="the filler file is gone")
        return
    log.write("sent", "free_storage", "storage", None, trigger, file=path)


if __name__ == "__main__":
    import sys

    if sys.argv[1] == "resume":
        _pid, _until, _dir, _target, _trigger = sys.argv[2:7]
        resume_later(int(_pid), float(_until), _dir, _target, _trigger)
    elif sys.argv[1] == "free":
        _path, _until, _dir, _trigger = sys.argv[2:6]
        free_later(_path, float(_until), _dir, _trigger)
