"""Where a run's output goes: the console gets the progress display, the product's event
lines and the summary; everything else (Ray, Ray Train, torchft, fbgemm, warnings) goes to
``RUN_DIR/logs/``, and ``-v`` shows it on the console as well.

Each process of the run (driver, supervisor, shards, trainers) adds a file handler for
Python logging and routes ``warnings`` through it; Ray's own per-process output stays in
Ray's session directory, which ``RUN_DIR/logs/ray`` points to for an embedded Ray.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import ray
import ray._private.worker

from core.logs import LOG_DIR, RUN_LOG_HANDLER, file_handler

__all__ = ["LOG_DIR", "configure_driver_logging", "link_ray_session_logs", "point_latest"]


class _ConsoleFilter(logging.Filter):
    """Without -v the console shows the product's own warnings and errors, not library
    warnings (Ray's deprecations, ``warnings`` captured from libraries)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.name.split(".")[0] in ("app", "actors", "core", "policies", "__main__")


def configure_driver_logging(run_dir: str | os.PathLike, verbose: bool) -> Path:
    """The driver: everything at INFO into ``RUN_DIR/logs/driver.log``; the console keeps
    the handler ``cpr``'s command line installed, limited to the product's own messages
    unless ``verbose``."""
    root = logging.getLogger()
    path = Path(run_dir) / LOG_DIR / "driver.log"
    for h in list(root.handlers):
        if h.get_name() == RUN_LOG_HANDLER:
            root.removeHandler(h)
            h.close()
        elif isinstance(h, logging.StreamHandler) and not verbose:
            if not any(isinstance(f, _ConsoleFilter) for f in h.filters):
                h.addFilter(_ConsoleFilter())
            h.setLevel(max(h.level, logging.WARNING))
    root.addHandler(file_handler(path))
    root.setLevel(logging.INFO)
    logging.captureWarnings(True)
    return path


def link_ray_session_logs(run_dir: str | os.PathLike) -> Path | None:
    """``RUN_DIR/logs/ray`` -> this node's Ray session log directory (every Ray worker's
    stdout and stderr, the raylet's and Ray Train's controller's logs)."""
    try:
        session = Path(ray._private.worker.global_worker.node.get_session_dir_path())
    except AttributeError:  # not connected, or a client connection without a local node
        return None
    link = Path(run_dir) / LOG_DIR / "ray"
    link.parent.mkdir(parents=True, exist_ok=True)
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(session / "logs", target_is_directory=True)
    return link


def point_latest(run_dir: Path) -> None:
    """Points ``latest`` beside a run in ``runs/`` (``runs/latest``) to that run, the newest;
    replaced atomically, so a reader never finds it missing."""
    if run_dir.parent.name != "runs":
        return
    link, tmp = run_dir.parent / "latest", run_dir.parent / f".latest-{os.getpid()}"
    try:
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(run_dir.name)
        os.replace(tmp, link)
    except OSError as err:  # a runs/latest that is a real directory, a file system without links
        logging.getLogger(__name__).info("runs/latest not updated: %s", err)
