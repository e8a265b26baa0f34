"""Log files of a run's worker processes: each process (supervisor, shards, trainers) adds a
file handler for Python logging under ``RUN_DIR/logs/`` and routes ``warnings`` through it.
The driver's console and Ray's own session logs are ``app.logs``'s.
"""

from __future__ import annotations

import logging
import logging.handlers
import os
from pathlib import Path

__all__ = ["LOG_DIR", "RUN_LOG_HANDLER", "configure_process_logging", "file_handler"]

LOG_DIR = "logs"
RUN_LOG_HANDLER = "cpr-run-log"
_FORMAT = "%(asctime)s %(levelname)s %(process)d %(name)s: %(message)s"
# A long run's torchft log (a few lines a step) stays bounded.
_MAX_BYTES = 64 << 20
_BACKUPS = 2

# Libraries whose INFO lines belong in the log files (not on the console): torchft's quorum
# and commit lines, fbgemm's library loads.
_LIBRARY_LEVELS = {"torchft": logging.INFO, "fbgemm_gpu": logging.INFO}


def file_handler(path: Path) -> logging.Handler:
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.handlers.RotatingFileHandler(path, maxBytes=_MAX_BYTES, backupCount=_BACKUPS)
    handler.setFormatter(logging.Formatter(_FORMAT))
    handler.setLevel(logging.INFO)
    handler.set_name(RUN_LOG_HANDLER)
    return handler


def configure_process_logging(log_dir: str | os.PathLike | None, role: str, node_ip: str | None = None) -> Path | None:
    """In a worker process of the run: Python logging at INFO and every warning into
    ``log_dir/<role>-[<node ip>-]<pid>.log`` (the node's IP only on a cluster, where process
    ids repeat across hosts). Idempotent per process; a no-op without ``log_dir``."""
    if log_dir is None:
        return None
    root = logging.getLogger()
    host = "" if node_ip is None or node_ip.startswith("127.") else f"{node_ip}-"
    path = Path(log_dir) / f"{role}-{host}{os.getpid()}.log"
    if any(h.get_name() == RUN_LOG_HANDLER for h in root.handlers):
        return path
    root.addHandler(file_handler(path))
    if root.level == logging.NOTSET or root.level > logging.INFO:
        root.setLevel(logging.INFO)
    for name, level in _LIBRARY_LEVELS.items():
        logging.getLogger(name).setLevel(level)
    logging.captureWarnings(True)
    return path
