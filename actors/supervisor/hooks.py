"""Callbacks at named points of the supervisor's work, in the manner of Ray Train's
``ControllerCallback``: the metrics, the event files and fault injection are hooks, so the
recovery code calls ``hooks.at_point("recovery.spawned")`` and never knows whether faults exist.
With no hook registered every call is a no-op."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from core.journal import RunLog
from core.records import Progress

__all__ = ["RunHooks", "HookList", "RunLogHook"]

logger = logging.getLogger(__name__)


class RunHooks:
    """The interface, doing nothing. Observers (``on_*``) must not change the run; a point
    (``at_point``, ``after_commit``) may raise or kill on purpose: that is fault injection."""

    def on_event(self, event: dict) -> None:
        """An event was recorded."""

    def on_progress(self, record: Progress) -> None:
        """A trainer reported progress."""

    def on_trainer_detected(self, detection_s: float) -> None:
        """The survivors acted on a trainer's death, ``detection_s`` after it."""

    def at_point(self, point: str) -> None:
        """The supervisor's work reached ``point`` (``core.points.POINTS``)."""

    def after_commit(self, step: int) -> None:
        """Training step ``step`` committed (reported once per trainer)."""


class HookList(RunHooks):
    """Several hooks in order. An observer's error is logged and the run goes on; a point's
    error propagates, since it is raised on purpose."""

    def __init__(self, hooks: Sequence[RunHooks] = ()):
        self.hooks = list(hooks)

    def add(self, hook: RunHooks) -> None:
        self.hooks.append(hook)

    def _observe(self, method: str, *args: object) -> None:
        for hook in self.hooks:
            try:
                getattr(hook, method)(*args)
            except Exception:  # noqa: BLE001 - an observer must never stop training
                logger.exception("hook %s.%s failed", type(hook).__name__, method)

    def on_event(self, event: dict) -> None:
        self._observe("on_event", event)

    def on_progress(self, record: Progress) -> None:
        self._observe("on_progress", record)

    def on_trainer_detected(self, detection_s: float) -> None:
        self._observe("on_trainer_detected", detection_s)

    def at_point(self, point: str) -> None:
        for hook in self.hooks:
            hook.at_point(point)

    def after_commit(self, step: int) -> None:
        for hook in self.hooks:
            hook.after_commit(step)


class RunLogHook(RunHooks):
    """``progress.jsonl``, appended as the run goes (the event log writes ``events.jsonl``
    itself, under the books' lock, so that the journal can say how far it reached)."""

    def __init__(self, run_log: RunLog):
        self.run_log = run_log

    def on_progress(self, record: Progress) -> None:
        self.run_log.progress(record)
