"""Argument checks shared by the policy modules.

Each raises ``ValueError`` naming the argument, its allowed range and the value it got.
"""

from __future__ import annotations

import math
import numbers


def check_positive(name: str, value: float) -> float:
    """Returns ``value`` as float if it is finite and > 0."""
    v = _as_float(name, value, "a finite number > 0")
    if not (math.isfinite(v) and v > 0.0):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return v


def check_non_negative(name: str, value: float) -> float:
    """Returns ``value`` as float if it is finite and >= 0."""
    v = _as_float(name, value, "a finite number >= 0")
    if not (math.isfinite(v) and v >= 0.0):
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    return v


def check_finite(name: str, value: float) -> float:
    """Returns ``value`` as float if it is finite (any sign)."""
    v = _as_float(name, value, "a finite number")
    if not math.isfinite(v):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return v


def check_open_unit(name: str, value: float) -> float:
    """Returns ``value`` as float if it lies in the open interval (0, 1)."""
    v = _as_float(name, value, "in (0, 1)")
    if not (0.0 < v < 1.0):
        raise ValueError(f"{name} must be in (0, 1), got {value!r}")
    return v


def check_unit_half_open(name: str, value: float) -> float:
    """Returns ``value`` as float if it lies in (0, 1]."""
    v = _as_float(name, value, "in (0, 1]")
    if not (0.0 < v <= 1.0):
        raise ValueError(f"{name} must be in (0, 1], got {value!r}")
    return v


def check_int(name: str, value: int, minimum: int, maximum: int | None = None) -> int:
    """Returns ``value`` if it is an integer (not bool) in [minimum, maximum]."""
    allowed = f"[{minimum}, {maximum}]" if maximum is not None else f">= {minimum}"
    # bool is an int subclass; True as a shard count is a bug, not a 1.
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an integer {allowed}, got {value!r}")
    v = int(value)
    if v < minimum or (maximum is not None and v > maximum):
        raise ValueError(f"{name} must be an integer {allowed}, got {v}")
    return v


def _as_float(name: str, value: float, allowed: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be {allowed}, got {value!r}")
    return float(value)
