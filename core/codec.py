"""Typed records to JSON and back: the supervisor's journal holds its frozen dataclasses
(states, failure records, decisions) as JSON documents, and a restarted supervisor reads
them back as the same types.

``encode`` turns dataclasses, enums, tuples and int-keyed dicts into plain JSON values;
``decode(tp, value)`` rebuilds ``tp`` from them, guided by the dataclasses' type hints
(nested dataclasses, ``X | None``, ``tuple[X, ...]``, ``dict[int, X]``, enums). A union of
several dataclasses is not supported: records that can be one of several kinds keep them in
separate fields.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import types
import typing
from typing import Any

__all__ = ["encode", "decode"]


def encode(value: Any) -> Any:
    """``value`` as JSON-compatible data (dicts with str keys, lists, numbers, strings)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: encode(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, dict):
        return {str(k): encode(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [encode(v) for v in value]
    if hasattr(value, "item") and callable(value.item) and not isinstance(value, (str, bytes)):
        return value.item()  # a numpy scalar
    return value


@functools.lru_cache(maxsize=None)
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def decode(tp: Any, value: Any) -> Any:
    """Rebuilds a value of type ``tp`` from ``encode``'s output."""
    if value is None:
        return None
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(options) == 1:
            return decode(options[0], value)
        return value  # a union of plain types (int | float): JSON keeps them apart
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        hints = _hints(tp)
        names = {f.name for f in dataclasses.fields(tp) if f.init}
        return tp(**{k: decode(hints[k], v) for k, v in value.items() if k in names})
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return tp(value)
    if origin is tuple:
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(decode(args[0], v) for v in value)
        return tuple(decode(a, v) for a, v in zip(args, value))
    if origin is list:
        (arg,) = typing.get_args(tp) or (Any,)
        return [decode(arg, v) for v in value]
    if origin is dict:
        key, val = typing.get_args(tp) or (str, Any)
        return {decode(key, k) if key is not str else k: decode(val, v) for k, v in value.items()}
    if tp in (int, float, str, bool):
        return tp(value)
    return value
