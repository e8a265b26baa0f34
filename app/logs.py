"""Where a run's output goes: the console gets the progress display, the product's event
lines and the summary; everything else (Ray, Ray Train, torchft, fbgemm, warnings) goes to
``RUN_DIR/logs/``, and ``-v`` shows it on the console as well.

Each process of the run (driver, supervisor, shards, trainers) adds a file handler for
Python logging and routes ``warnings`` through it; Ray's own per-process output stays in
Ray's session directory, which ``RUN_DIR/logs/ray`` points to for an embedded Ray.
"""

from __future__ import annotations

import logging
import logging.handlers
import os
from pathlib import Path

__all__ = ["LOG_DIR", "configure_driver_logging", "configure_process_logging", "link_ray_session_logs"]

LOG_DIR = "logs"
_FORMAT = "%(asctime)s %(levelname)s %(process)d %(name)s: %(message)s"
# A long run's torchft log (a few lines a step) stays bounded.
_MAX_BYTES = 64 << 20
_BACKUPS = 2

# Libraries whose INFO lines belong in the log files (not on the console): torchft's quorum
# and commit lines, fbgemm's library loads.
_LIBRARY_LEVELS = {"torchft": logging.INFO, "fbgemm_gpu": logging.INFO}


def _file_handler(path: Path) -> logging.Handler:
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.handlers.RotatingFileHandler(path, maxBytes=_MAX_BYTES, backupCount=_BACKUPS)
    handler.setFormatter(logging.Formatter(_FORMAT))
    handler.setLevel(logging.INFO)
    handler.set_name("cpr-run-log")
    return handler


def _host() -> str:
    """``<node ip>-`` on a cluster (process ids repeat across hosts), nothing on 127.0.0.1."""
    try:
        import ray

        ip = ray.util.get_node_ip_address()
    except Exception:
        return ""
    return "" if ip.startswith("127.") else f"{ip}-"


def configure_process_logging(log_dir: str | os.PathLike | None, role: str) -> Path | None:
    """In a worker process of the run: Python logging at INFO and every warning into
    ``log_dir/<role>-[<node ip>-]<pid>.log``. Idempotent per process; a no-op without ``log_dir``."""
    if log_dir is None:
        return None
    root = logging.getLogger()
    path = Path(log_dir) / f"{role}-{_host()}{os.getpid()}.log"
    if any(h.get_name() == "cpr-run-log" for h in root.handlers):
        return path
    root.addHandler(_file_handler(path))
    if root.level == logging.NOTSET or root.level > logging.INFO:
        root.setLevel(logging.INFO)
    for name, level in _LIBRARY_LEVELS.items():
        logging.getLogger(name).setLevel(level)
    logging.captureWarnings(True)
    return path


class _ConsoleFilter(logging.Filter):
    """Without -v the console shows the product's own warnings and errors, not library
    warnings (Ray's deprecations, ``warnings`` captured from libraries)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.name.split(".")[0] in ("app", "actors", "policies", "__main__")


def configure_driver_logging(run_dir: str | os.PathLike, verbose: bool) -> Path:
    """The driver: everything at INFO into ``RUN_DIR/logs/driver.log``; the console keeps
    the handler ``cpr``'s command line installed, limited to the product's own messages
    unless ``verbose``."""
    root = logging.getLogger()
    path = Path(run_dir) / LOG_DIR / "driver.log"
    for h in list(root.handlers):
        if h.get_name() == "cpr-run-log":
            root.removeHandler(h)
            h.close()
        elif isinstance(h, logging.StreamHandler) and not verbose:
            if not any(isinstance(f, _ConsoleFilter) for f in h.filters):
                h.addFilter(_ConsoleFilter())
            h.setLevel(max(h.level, logging.WARNING))
    root.addHandler(_file_handler(path))
    root.setLevel(logging.INFO)
    logging.captureWarnings(True)
    return path


def link_ray_session_logs(run_dir: str | os.PathLike) -> Path | None:
    """``RUN_DIR/logs/ray`` -> this node's Ray session log directory (every Ray worker's
    stdout and stderr, the raylet's and Ray Train's controller's logs)."""
    import ray

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
