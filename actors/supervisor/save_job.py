"""One checkpoint save between its snapshot and its commit, as the coordinator's background
writer carries it (``checkpoints.py``), and the one line a failed save's event gives."""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass

import ray

from core.checkpoint import DataPosition
from core.errors import CprError
from core.records import SaveRequest, Snapshot

__all__ = ["SaveJob", "Abandoned", "SAVE_ERRORS", "reason"]

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
# A save that fails for one of these is abandoned and tried again at a later step; anything
# else is a bug and crashes the save pipeline's thread (the run then fails, naming it).
SAVE_ERRORS = (ray.exceptions.RayError, OSError, TimeoutError, CprError)


class Abandoned(Exception):
    """A save that must not commit (a rollback moved the timeline, or it outlived its deadline)."""


def reason(err: BaseException) -> str:
    """One readable line for an event: a Ray error's text starts with the task's name (in
    colour) and ends with the remote exception; keep that exception's line."""
    lines = [ln.strip() for ln in _ANSI.sub("", str(err)).splitlines() if ln.strip()]
    exc = [ln for ln in lines if re.match(r"^[A-Za-z_.]*(Error|Exception)\b", ln)]
    return (exc[-1] if exc else lines[0] if lines else type(err).__name__)[:200]


@dataclass
class SaveJob:
    """One save between its snapshot and its commit."""

    request: SaveRequest
    shards: list
    snapshots: list[Snapshot]
    run_id: str
    position: DataPosition
    hold_s: float
    epoch: int
    started: float = 0.0  # time.monotonic() of its snapshot: its drain deadline counts from there
    overdue: bool = False  # still writing past that deadline: abandoned (it never commits)
    thread: threading.Thread | None = None
    dense_entry: object = None  # FileEntry of the dense state, once written
    position_entry: object = None  # FileEntry of the data position, once written
