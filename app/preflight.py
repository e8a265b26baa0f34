"""Checks of the places a run writes (``run_dir``, ``checkpoint.storage``, ``data.cache_dir``),
before it writes anything or starts Ray: a place that cannot be reached, listed or written is
one ConfigError naming its field, the place (an object store's URI without its ``?options``)
and why, instead of a traceback from deep inside the run.

A local place is checked without writing: a directory the run would create is not created
here; the nearest one that exists must be a writable directory. An object store is listed
(``check_places``), and written to and deleted from once (``probe_writes``), by a client
with short timeouts and one retry: an endpoint that nobody answers at fails in seconds,
where pyarrow's defaults retry for minutes.
"""

from __future__ import annotations

import datetime
import os
import secrets

import pyarrow.fs as pafs

from core.config import RunConfig
from core.data.sources import is_local, open_filesystem, shown as _shown, split_uri
from core.errors import ConfigError

__all__ = ["check_places", "places", "probe_writes"]

CONNECT_TIMEOUT_S = 2.0
REQUEST_TIMEOUT_S = 10.0
ATTEMPTS = 2  # S3; pyarrow's default is 3, each waiting its timeouts
GCS_RETRY_LIMIT_S = 3.0  # GCS retries for up to this long (the client's default: minutes)
PROBE_PREFIX = ".cpr-probe-"


def places(cfg: RunConfig) -> list[tuple[str, str]]:
    """(field, path or URI) of every place the run writes to, each once."""
    found = [("run_dir", cfg.run_dir)]
    if cfg.checkpoint.stored and cfg.checkpoint.storage:  # the default lies in run_dir
        found.append(("checkpoint.storage", cfg.checkpoint_uri))
    if cfg.data.cache_dir:
        found.append(("data.cache_dir", cfg.cache_dir))
    elif not is_local(cfg.cache_dir):  # the default beside an object-store checkpoint.storage
        found.append(("data.cache_dir (default: beside checkpoint.storage)", cfg.cache_dir))
    else:  # the default beside run_dir (runs/cache), shared by the runs there
        found.append(("data.cache_dir (default: beside run_dir)", cfg.cache_dir))
    unique: dict[str, str] = {}
    for field, uri in found:
        unique.setdefault(uri, field)
    return [(field, uri) for uri, field in unique.items()]


def check_places(cfg: RunConfig) -> None:
    """Every place the run writes: a local one can be created and written (nothing is created
    here), an object store answers and lists it. Raises ConfigError naming the field."""
    for field, uri in places(cfg):
        if is_local(uri):
            _check_local(field, split_uri(uri)[1])
        else:
            fs, path = _open(uri, field)
            try:
                fs.get_file_info(pafs.FileSelector(path, allow_not_found=True))
            except OSError as exc:
                raise ConfigError(f"{field}: cannot list {_shown(uri)}: {_reason(exc)}") from None


def probe_writes(cfg: RunConfig) -> None:
    """Every object-store place of the run takes a small object, which is deleted again.
    Raises ConfigError naming the field. Called after every other check: deleting the only
    object under a prefix leaves the prefix's directory marker (pyarrow keeps the directory),
    which is what the run writes there next anyway."""
    for field, uri in places(cfg):
        if is_local(uri):
            continue
        fs, path = _open(uri, field)
        probe = f"{path}/{PROBE_PREFIX}{secrets.token_hex(4)}"
        try:
            with fs.open_output_stream(probe) as out:
                out.write(b"cpr")
        except OSError as exc:
            raise ConfigError(f"{field}: cannot write to {_shown(uri)}: {_reason(exc)}") from None
        try:
            fs.delete_file(probe)
        except OSError as exc:
            raise ConfigError(f"{field}: cannot delete from {_shown(uri)} (the run removes old checkpoints and "
                              f"caches; {probe.rsplit('/', 1)[1]} is left there): {_reason(exc)}") from None


def _check_local(field: str, path: str) -> None:
    """``path`` is a writable directory, or the nearest directory above it that exists is."""
    existing = path
    while not os.path.lexists(existing) and os.path.dirname(existing) != existing:
        existing = os.path.dirname(existing)
    if existing == path and not os.path.isdir(path):
        raise ConfigError(f"{field}: {path} is not a directory")
    if not os.path.isdir(existing):
        raise ConfigError(f"{field}: cannot create {path}: {existing} is not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"{field}: cannot write to {path}: {existing} is not writable")


def _open(uri: str, field: str) -> tuple[pafs.FileSystem, str]:
    """(filesystem, path) of ``uri``, an S3 or GCS client rebuilt with short timeouts."""
    fs, path = open_filesystem(uri, field)
    if fs.type_name not in ("s3", "gcs"):
        return fs, path
    # Every option the URI gave (endpoint, region, credentials...), as pickling takes them.
    options = {k: v for k, v in fs.__reduce__()[1][0].items() if v not in ("", None)}
    if fs.type_name == "s3":
        options.update(connect_timeout=CONNECT_TIMEOUT_S, request_timeout=REQUEST_TIMEOUT_S)
        fs = pafs.S3FileSystem(**options, retry_strategy=pafs.AwsStandardS3RetryStrategy(max_attempts=ATTEMPTS))
    else:
        fs = pafs.GcsFileSystem(**{**options, "retry_time_limit": datetime.timedelta(seconds=GCS_RETRY_LIMIT_S)})
    return fs, path


def _reason(exc: OSError) -> str:
    """pyarrow's first line, less its "When listing objects under key ... in bucket ...: ",
    which the field and the URI say."""
    line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    if line.startswith("When ") and ": " in line:
        line = line.split(": ", 1)[1]
    return line[:300]
