"""Background threads that cannot die silently: each runs under a guard that hands an
unexpected exception to the supervisor, which ends the run as Failed naming the thread and
the error (a wedged run that nobody hears of is the failure this prevents)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from actors.supervisor.books import JournalUnwritable

__all__ = ["ThreadCrash", "start_guarded"]

logger = logging.getLogger(__name__)

ThreadCrash = Callable[[str, BaseException], None]


def start_guarded(name: str, target: Callable[..., object], on_crash: ThreadCrash, *args: object) -> threading.Thread:
    """Starts ``target(*args)`` on a daemon thread called ``name``; an exception escaping it
    is logged with its traceback and passed to ``on_crash(name, error)``."""

    def run() -> None:
        try:
            target(*args)
        except JournalUnwritable as err:
            # Raised by Books.persist after it failed the run with this reason (from an error
            # handler as anywhere else): the thread stops; reported all the same, in case the
            # books had nobody to tell.
            logger.error("thread %s stopped: %s", name, err)
            on_crash(name, err)
        except BaseException as err:  # noqa: BLE001 - every escape is reported, none swallowed
            logger.exception("thread %s crashed", name)
            on_crash(name, err)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread
