"""Argument checks shared by the front ends: one rule per kind of mistake.

A value of the wrong type raises TypeError, a value of the right type out of range
ValueError; both name the argument, the value and what is valid.
"""

from __future__ import annotations

import difflib
import math
import numbers
from typing import Any, Optional


def check_bool(name: str, value: Any, *, strings: bool = False) -> bool:
    """A bool (``strings``: also "True"/"False", as apex took them from argparse)."""
    if isinstance(value, bool):
        return value
    if strings and value in ("True", "False"):
        return value == "True"
    valid = "True, False" + (", 'True', 'False'" if strings else "")
    raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}; valid: {valid}")


# The largest counts a scaler's device counters hold: int32 (torch's growth tracker, the
# run of overflows) and int64 (the skipped steps; the growth interval torch's update takes).
INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1


def int_range(name: str, value: Any, low: int, high: Optional[int] = None) -> Optional[str]:
    """The valid range's words (">= 1", "in [0, 7]") when ``value`` is an int outside it,
    None when inside; TypeError naming the range for a non-int (a bool included)."""
    valid = f">= {low}" if high is None else f"in [{low}, {high}]"
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int {valid}, got {type(value).__name__} {value!r}")
    return valid if value < low or (high is not None and value > high) else None


def check_int(name: str, value: Any, low: int, high: Optional[int] = None) -> int:
    """An int (not a bool) >= ``low`` (and <= ``high``)."""
    valid = int_range(name, value, low, high)
    if valid is not None:
        raise ValueError(f"{name} must be an int {valid}, got {value!r}")
    return int(value)


def check_positive(name: str, value: Any, *, allow_none: bool = False) -> Optional[float]:
    """A positive finite real number (or None when ``allow_none``)."""
    if value is None and allow_none:
        return None
    valid = "a positive finite number" + (" or None" if allow_none else "")
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be {valid}, got {type(value).__name__} {value!r}")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be {valid}, got {value!r}")
    return float(value)


def short_repr(value: Any, limit: int = 80) -> str:
    """``repr(value)`` on one line, cut at ``limit`` characters: an optimizer's or a
    model's repr runs over many lines."""
    text = " ".join(repr(value).split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def as_list(value: Any, name: str, kind: type, kind_name: str) -> list:
    """``value`` as a list of ``kind``: one of them, or a list/tuple of them."""
    if isinstance(value, kind):
        return [value]
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"{name} must be a {kind_name} or a list of them, got "
                        f"{type(value).__name__} {short_repr(value)}")
    for i, item in enumerate(value):
        if not isinstance(item, kind):
            raise TypeError(f"{name}[{i}] is a {type(item).__name__} ({short_repr(item)}), not "
                            f"a {kind_name}; valid: a {kind_name} or a list of them")
    return list(value)


def callable_choices(obj: Any, name: str, obj_name: str) -> str:
    """The valid choices for a missing attribute ``name`` of ``obj`` (named ``obj_name``):
    its public callable attributes, all of them when few, else those closest to ``name``.

    Example:
        >>> import types
        >>> callable_choices(types.SimpleNamespace(mm=len, bmm=len), "mn", "ns")
        "valid: 'bmm', 'mm'"
    """
    names = sorted(attr for attr in dir(obj)
                   if not attr.startswith("_") and callable(getattr(obj, attr, None)))
    if not names:
        return f"valid: the name of a callable attribute, and {obj_name} has none"
    if len(names) <= 8:
        return f"valid: {', '.join(map(repr, names))}"
    close = difflib.get_close_matches(name, names, n=5, cutoff=0.5)
    example = next((attr for attr in names if attr.islower()), names[0])
    hint = f"closest: {', '.join(map(repr, close))}" if close else f"e.g. {example!r}"
    return f"valid: one of its {len(names)} callable attributes ({hint})"
