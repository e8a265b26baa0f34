"""Where input data lives: ``pyarrow.fs`` URIs (local paths, ``s3://``, ``gs://``, ``hdfs://``)
and globs, resolved into the files they name, and opened for reading. S3 endpoints and
credentials come the way pyarrow takes them: URI options (``?endpoint_override=host:port&
scheme=http``) or the standard AWS environment variables.

A file's ``uri`` keeps the options of the URI it came from, so any process can open it
again; its ``name`` (the URI without options) is what messages show.
"""

from __future__ import annotations

import fnmatch
import os
from dataclasses import dataclass
from urllib.parse import quote

import pyarrow as pa
import pyarrow.fs as pafs

from core.errors import ConfigError

__all__ = ["InputFile", "child_uri", "is_local", "open_filesystem", "resolve_inputs", "split_uri"]

_GLOB = ("*", "?", "[")
_CODECS = {".gz": "gzip", ".bz2": "bz2", ".zst": "zstd", ".lz4": "lz4"}
# Characters of an object's key that a URI would read otherwise: escaped when a URI is opened,
# so that a key is taken literally (as the AWS CLI takes it).
_SAFE_IN_PATH = "/:@!$&'()*+,;=-._~"


@dataclass(frozen=True)
class InputFile:
    uri: str
    """What opens it from any process (with the URI's options)."""
    name: str
    """The URI without options: what messages name."""
    size: int
    mtime_ns: int

    @property
    def compression(self) -> str | None:
        """The codec its name says (``.gz``, ``.bz2``, ``.zst``, ``.lz4``), None for plain text."""
        return next((codec for ext, codec in _CODECS.items() if self.name.lower().endswith(ext)), None)

    @property
    def compressed(self) -> bool:
        return self.compression is not None

    @property
    def parquet(self) -> bool:
        return self.name.lower().endswith((".parquet", ".pq"))


def is_local(uri: str) -> bool:
    return "://" not in uri or uri.startswith("file://")


def split_uri(uri: str) -> tuple[str, str, str]:
    """(prefix such as ``s3://`` or "", path, ``?options`` or "") of ``uri``. Options are what
    follows the last ``?`` when that holds ``key=value`` pairs: a ``?`` of a glob stays in the path."""
    if is_local(uri):
        path = uri[len("file://"):] if uri.startswith("file://") else uri
        return "", os.path.abspath(os.path.expanduser(path)), ""
    scheme, _, rest = uri.partition("://")
    path, sep, query = rest.rpartition("?")
    if not sep or "=" not in query or "/" in query:
        path, query = rest, ""
    return f"{scheme}://", path, f"?{query}" if query else ""


def child_uri(uri: str, name: str) -> str:
    """``name`` inside the directory ``uri``, the URI's options kept."""
    prefix, path, options = split_uri(uri)
    return f"{prefix}{path.rstrip('/')}/{name}{options}"


def open_filesystem(uri: str, field: str = "data") -> tuple[pafs.FileSystem, str]:
    """(filesystem, path within it) of ``uri``; a URI pyarrow cannot take is a ConfigError naming ``field``."""
    prefix, path, _ = split_uri(uri)
    if not prefix:
        return pafs.LocalFileSystem(), path
    _, path, options = split_uri(uri)
    try:
        fs, fs_path = pafs.FileSystem.from_uri(f"{prefix}{quote(path, safe=_SAFE_IN_PATH)}{options}")
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, OSError, ValueError) as exc:
        raise ConfigError(f"{field}: cannot open {_strip(uri)}: {exc}") from None
    return fs, fs_path.rstrip("/")


def _strip(uri: str) -> str:
    """``uri`` without its options (what messages show)."""
    prefix, path, _ = split_uri(uri)
    return f"{prefix}{path}" if prefix else uri


def resolve_inputs(uris: list[str], field: str) -> list[InputFile]:
    """The files ``uris`` name, in order (a glob's matches sorted), each checked to exist and
    to be readable. A URI that does not exist, cannot be read or lists nothing, or a glob that
    matches nothing, is a ConfigError naming ``field`` and the URI."""
    out: list[InputFile] = []
    for uri in uris:
        prefix, path, options = split_uri(uri)
        fs, fs_path = open_filesystem(uri, field)
        infos = _glob(fs, fs_path, uri, field) if any(c in path for c in _GLOB) else [_stat(fs, fs_path, uri, field)]
        for info in infos:
            found = InputFile(f"{prefix}{info.path}{options}", f"{prefix}{info.path}", info.size or 0,
                              int(info.mtime_ns or 0))
            _check_readable(fs, info.path, found.name, field)
            out.append(found)
    return out


def _stat(fs: pafs.FileSystem, path: str, uri: str, field: str) -> pafs.FileInfo:
    try:
        info = fs.get_file_info(path)
    except OSError as exc:
        raise ConfigError(f"{field}: cannot read {_strip(uri)}: {exc}") from None
    if info.type == pafs.FileType.NotFound:
        raise ConfigError(f"{field}: {_strip(uri)} does not exist")
    if info.type == pafs.FileType.Directory:
        raise ConfigError(f"{field}: {_strip(uri)} is a directory; name its files or a glob such as "
                          f"{_strip(uri).rstrip('/')}/*")
    return info


def _glob(fs: pafs.FileSystem, pattern: str, uri: str, field: str) -> list[pafs.FileInfo]:
    """Files matching ``pattern`` (``*``, ``?``, ``[...]`` within a name; ``**`` across
    directories), listed from the directory above the first wildcard."""
    cut = min(pattern.find(c) for c in _GLOB if c in pattern)
    base = pattern[:cut].rsplit("/", 1)[0] if "/" in pattern[:cut] else ""
    deep = "/" in pattern[cut:] or "**" in pattern
    try:
        listed = fs.get_file_info(pafs.FileSelector(base or ".", recursive=deep, allow_not_found=True))
    except OSError as exc:
        raise ConfigError(f"{field}: cannot list {_strip(uri)}: {exc}") from None
    depth = pattern.count("/")
    found = [
        i for i in listed
        if i.type == pafs.FileType.File and fnmatch.fnmatchcase(i.path, pattern)
        and ("**" in pattern or i.path.count("/") == depth)
    ]
    if not found:
        raise ConfigError(f"{field}: {_strip(uri)} matches no file")
    return sorted(found, key=lambda i: i.path)


def _check_readable(fs: pafs.FileSystem, path: str, name: str, field: str) -> None:
    try:
        with fs.open_input_stream(path, compression=None) as stream:
            stream.read(1)
    except OSError as exc:
        raise ConfigError(f"{field}: cannot read {name}: {exc}") from None
