"""Where input data lives: ``pyarrow.fs`` URIs (local paths, ``s3://``, ``gs://``, ``hdfs://``)
and globs, resolved into the files they name, and opened for reading. S3 endpoints and
credentials come the way pyarrow takes them: URI options (``?endpoint_override=host:port&
scheme=http``) or the standard AWS environment variables.

A file's ``uri`` keeps the options of the URI it came from, so any process can open it
again; its ``name`` (the URI without options) is what messages show.

Globs mean what Python's ``glob.glob(pattern, recursive=True)`` means, on every filesystem
(an object store has no directories to walk, so the files under the glob's literal prefix are
listed and matched): ``*``, ``?`` and ``[...]`` match within one name, ``**`` as a whole
segment matches zero or more directories, a name starting with ``.`` is matched only by a
segment that starts with ``.`` too, and ``[[]`` is a literal ``[`` (``glob.escape``). The same
glob then names the same files on a laptop and on S3.

The inputs are a set: ``check_distinct`` refuses a file named twice, or in both the training
and the evaluation data, which would count its rows twice or evaluate on rows trained on.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass
from urllib.parse import quote

import pyarrow as pa
import pyarrow.fs as pafs

from core.errors import ConfigError

__all__ = [
    "InputFile", "check_distinct", "child_uri", "has_wildcard", "is_local", "open_filesystem", "resolve_inputs", "shown",
    "split_uri",
]

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
    named_by: str = dataclasses.field(default="", compare=False)
    """The config's URI that named it, without options (a glob, or the file's own URI): what
    ``check_distinct`` shows when a file is named twice. Not part of its identity."""

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
    target = f"{prefix}{quote(path, safe=_SAFE_IN_PATH)}{options}"
    try:
        fs, fs_path = pafs.FileSystem.from_uri(target)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, OSError, ValueError) as exc:
        # pyarrow's message may quote the whole URI: its options (endpoints, keys) stay out of ours
        said = str(exc).replace(target, shown(uri))
        said = said.replace(options, "") if options else said
        raise ConfigError(f"{field}: cannot open {shown(uri)}: {said}") from None
    return fs, fs_path.rstrip("/")


def shown(uri: str) -> str:
    """``uri`` as messages, names and logs show it: without its ``?options`` and without
    credentials written into it (``s3://KEY:SECRET@bucket/...``)."""
    prefix, path, _ = split_uri(uri)
    if not prefix:
        return uri
    authority, sep, rest = path.partition("/")
    return f"{prefix}{authority.rpartition('@')[2]}{sep}{rest}"



def resolve_inputs(uris: list[str], field: str) -> list[InputFile]:
    """The files ``uris`` name, in order (a glob's matches sorted by path), each checked to exist
    and to be readable, each remembering the URI that named it (``named_by``). A URI that does
    not exist, cannot be read or lists nothing, or a glob that matches nothing, is a
    ConfigError naming ``field`` and the URI. A file named twice is left to ``check_distinct``,
    which sees the training and the evaluation data together."""
    out: list[InputFile] = []
    for uri in uris:
        prefix, path, options = split_uri(uri)
        fs, fs_path = open_filesystem(uri, field)
        infos = _glob(fs, fs_path, uri, field) if has_wildcard(path) else [_stat(fs, fs_path, uri, field)]
        for info in infos:
            found = InputFile(f"{prefix}{info.path}{options}", f"{prefix}{info.path}", info.size or 0,
                              int(info.mtime_ns or 0), shown(uri))
            _check_readable(fs, info.path, found.name, field)
            out.append(found)
    return out


def _stat(fs: pafs.FileSystem, path: str, uri: str, field: str) -> pafs.FileInfo:
    try:
        info = fs.get_file_info(path)
    except OSError as exc:
        raise ConfigError(f"{field}: cannot read {shown(uri)}: {exc}") from None
    if info.type == pafs.FileType.NotFound:
        raise ConfigError(f"{field}: {shown(uri)} does not exist")
    if info.type == pafs.FileType.Directory:
        raise ConfigError(f"{field}: {shown(uri)} is a directory; name its files or a glob such as "
                          f"{shown(uri).rstrip('/')}/*")
    return info


def _glob(fs: pafs.FileSystem, pattern: str, uri: str, field: str) -> list[pafs.FileInfo]:
    """Files matching ``pattern`` (Python's ``glob`` rules, see the module), sorted by path:
    the directory above the first segment with a wildcard is listed (all the way down when the
    rest spans more than one segment or is ``**``) and every path matched whole."""
    parts = pattern.split("/")
    first = next(k for k, part in enumerate(parts) if has_wildcard(part))
    base = "/".join(parts[:first]) or ("/" if pattern.startswith("/") else "")
    deep = first < len(parts) - 1 or parts[first] == "**"
    try:
        listed = fs.get_file_info(pafs.FileSelector(base, recursive=deep, allow_not_found=True))
    except OSError as exc:
        raise ConfigError(f"{field}: cannot list {shown(uri)}: {exc}") from None
    matches = _glob_regex(pattern).match
    found = [i for i in listed if i.type == pafs.FileType.File and matches(i.path)]
    if shown(uri).endswith("/"):
        found = []  # a glob ending in '/' names directories only; a local path lost that '/' to abspath
    if not found:
        hint = " (a [...] is a set of characters; a literal [ is written [[])" if "[" in pattern else ""
        raise ConfigError(f"{field}: {shown(uri)} matches no file{hint}")
    return sorted(found, key=lambda i: i.path)


def has_wildcard(text: str) -> bool:
    """Whether ``text`` (a path, a URI, one name) holds a glob's wildcard: ``*``, ``?`` or ``[``."""
    return any(c in text for c in _GLOB)


# Zero or more directories none of whose names starts with '.': what a whole '**' segment spans.
_DIRS = r"(?:(?=[^/.])[^/]*/)*"


def _glob_regex(pattern: str) -> re.Pattern:
    """``pattern`` as a regular expression over whole paths, segment by segment (Python 3.11
    has no ``glob.translate``): no wildcard crosses a '/', and a segment with wildcards that
    does not itself start with '.' matches no name that does (``include_hidden=False``)."""
    parts = pattern.split("/")
    out = []
    for k, part in enumerate(parts):
        last = k == len(parts) - 1
        if part == "**":
            out.append(_DIRS + (r"(?=[^/.])[^/]*" if last else ""))  # _DIRS ends with its own '/'
        else:
            out.append(_segment_regex(part) + ("" if last else "/"))
    return re.compile("".join(out) + r"\Z", re.DOTALL)


def _segment_regex(segment: str) -> str:
    """One name's pattern: ``*`` any characters, ``?`` one, ``[...]`` one of a set (``[!...]``
    one not in it; a ']' first is a member; a '[' without its ']' is itself), the rest literal."""
    if not has_wildcard(segment):
        return re.escape(segment)
    out = [] if segment.startswith(".") else [r"(?=[^/.])"]  # hidden names stay hidden; never empty
    i = 0
    while i < len(segment):
        c = segment[i]
        i += 1
        if c == "*":
            out.append("[^/]*")
        elif c == "?":
            out.append("[^/]")
        elif c == "[":
            start = i + (segment[i:i + 1] == "!")
            start += segment[start:start + 1] == "]"
            end = segment.find("]", start)
            if end < 0:
                out.append(re.escape(c))
            else:
                out.append(_set_regex(segment[i:end]))
                i = end + 1
        else:
            out.append(re.escape(c))
    return "".join(out)


def _set_regex(body: str) -> str:
    """The inside of a ``[...]`` as a regex class: ranges ``a-z`` kept (one running backwards
    holds nothing, as in ``fnmatch``), every other character literal, '/' never a member."""
    negate = body.startswith("!")
    body = body[1:] if negate else body
    members, k = [], 0
    while k < len(body):
        if k + 2 < len(body) and body[k + 1] == "-":
            if body[k] <= body[k + 2]:
                members.append(f"{re.escape(body[k])}-{re.escape(body[k + 2])}")
            k += 3
        else:
            members.append(re.escape(body[k]))
            k += 1
    if negate:
        return f"[^/{''.join(members)}]"
    return f"[{''.join(members)}]" if members else "(?!)"


def _check_readable(fs: pafs.FileSystem, path: str, name: str, field: str) -> None:
    try:
        with fs.open_input_stream(path, compression=None) as stream:
            stream.read(1)
    except OSError as exc:
        raise ConfigError(f"{field}: cannot read {name}: {exc}") from None


def check_distinct(train: list[InputFile], eval: list[InputFile]) -> None:
    """Refuses, with a ConfigError of one line, a file named twice in ``train`` (data.train),
    twice in ``eval`` (data.eval), or in both: its rows would count twice, or the evaluation
    would hold rows trained on. A local file is known by its real path (a symlink or
    ``a/../a/x.tsv`` is the same file), an object by its scheme, bucket and key. The message
    names the file, the field(s) and, when a glob matched it, the glob."""
    seen: dict[str, tuple[str, InputFile]] = {}
    for field, files in (("data.train", train), ("data.eval", eval)):
        for file in files:
            key = _identity(file)
            if key in seen:
                raise ConfigError(_named_twice(*seen[key], field, file))
            seen[key] = (field, file)


def _identity(file: InputFile) -> str:
    prefix, path, _ = split_uri(file.name)
    return f"{prefix}{path}" if prefix else os.path.realpath(path)


def _by_glob(file: InputFile) -> bool:
    return bool(file.named_by) and has_wildcard(split_uri(file.named_by)[1])


def _named_twice(first_field: str, first: InputFile, field: str, again: InputFile) -> str:
    """The message of ``check_distinct``: ``again`` (in ``field``) is ``first`` (in ``first_field``)."""
    globbed = _by_glob(first) or _by_glob(again)
    notes = ["one file"] if again.name != first.name else []
    alias = f", as {again.name}" if notes else ""
    if first_field == field:
        notes += [f"matched by {first.named_by}, then by {again.named_by}"] if globbed else []
        said = f"{field}: {first.name} is named twice in {field}{alias}{_notes(notes)}: a file is read once"
        return f"{said}; {'narrow the glob' if globbed else 'name it once'}"
    alias = f", as {first.name}" if notes else ""
    notes += [f"matched by {first.named_by}"] if _by_glob(first) else []
    matched = f" (matched by {again.named_by})" if _by_glob(again) else ""
    said = (f"{field}: {again.name}{matched} is also in {first_field}{alias}{_notes(notes)}: a file is read once, "
            f"as training or as evaluation data")
    return f"{said}; {'narrow the glob' if globbed else 'name it in one of them'}"


def _notes(notes: list[str]) -> str:
    return f" ({'; '.join(notes)})" if notes else ""
