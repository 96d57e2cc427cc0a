"""GradScaler's argument checks, with the error types torch's scaler raises.

torch raises AssertionError for a bad growth/backoff factor and for calls out of order;
these are ValueError/RuntimeError and AssertionError at once, so code written for either
catches them. A wrong type is a TypeError, as everywhere in ampkit (``_checks``).
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Optional

import torch

from ._checks import int_range
from ._dtypes import check_device_type
from ._state import inferred_device_type

# Bounds of the scale when none are given. Below the smallest normal float32 the fp32
# reciprocal 1/scale overflows to inf (1/2**-127 > float32 max), so unscaling would
# turn every gradient into inf or NaN; above float32's max the scale itself is inf.
F32_TINY = torch.finfo(torch.float32).tiny
F32_MAX = torch.finfo(torch.float32).max


class _ArgumentError(ValueError, AssertionError):
    """A bad argument: a ValueError, and also the AssertionError torch raises there."""


class _StateError(RuntimeError, AssertionError):
    """A call out of order: a RuntimeError, and also the AssertionError torch raises there."""


class _NotAnOptimizerError(TypeError, AttributeError):
    """Not an optimizer: a TypeError, and also the AttributeError torch raises there."""


def check_optimizer(optimizer: Any) -> None:
    """Refuse what is not an optimizer (no ``param_groups``) before any state is touched."""
    if not hasattr(optimizer, "param_groups"):
        raise _NotAnOptimizerError(f"optimizer must be a torch.optim.Optimizer (something with "
                                   f"param_groups), got {type(optimizer).__name__} {optimizer!r}")


def _real(name: str, value: Any, valid: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number in {valid}, got "
                        f"{type(value).__name__} {value!r}")
    return float(value)


def _in_range(name: str, value: Any, low: float, high: float, *,
              low_open: bool, high_open: bool = False) -> float:
    valid = f"{'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
    number = _real(name, value, valid)
    too_low = number <= low if low_open else number < low
    too_high = number >= high if high_open else number > high
    if math.isnan(number) or too_low or too_high:
        raise _ArgumentError(f"{name}={value!r} is out of range; valid range: {valid}")
    return number


def _count(name: str, value: Any, low: int, high: Optional[int] = None) -> int:
    """check_int's rule, in torch's GradScaler words for an out-of-range value."""
    valid = int_range(name, value, low, high)
    if valid is not None:
        raise _ArgumentError(f"{name}={value!r} is out of range; valid range: integers {valid}")
    return int(value)


def _growth_factor(value: Any) -> float:
    return _in_range("growth_factor", value, 1.0, math.inf, low_open=True, high_open=True)


def _backoff_factor(value: Any) -> float:
    return _in_range("backoff_factor", value, 0.0, 1.0, low_open=True, high_open=True)


def _bound(name: str, value: Any) -> Optional[float]:
    if value is None:
        return None
    return _in_range(name, value, F32_TINY, F32_MAX, low_open=False)


def _bounds(min_scale: Any, max_scale: Any) -> tuple[Optional[float], Optional[float]]:
    low, high = _bound("min_scale", min_scale), _bound("max_scale", max_scale)
    if low is not None and high is not None and low > high:
        raise ValueError(f"min_scale={min_scale!r} is greater than max_scale={max_scale!r}; "
                         f"valid: min_scale <= max_scale")
    return low, high


def _enabled(value: Any) -> bool:
    """A bool (or the ints 0/1 that argparse flags give, a numpy bool, a one-element bool
    tensor, as torch takes them); never a string like "False"."""
    if isinstance(value, (bool, numbers.Integral)) and value in (0, 1):
        return bool(value)
    if ((type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_"))
            or (isinstance(value, torch.Tensor) and value.dtype == torch.bool
                and value.numel() == 1)):
        return bool(value)
    raise TypeError(f"enabled must be a bool, got {type(value).__name__} {value!r}; "
                    "valid: True, False")


def _check_group(group: Any) -> Any:
    """None or a torch.distributed ProcessGroup (checked now, not at the first collective)."""
    if group is None:
        return None
    dist = torch.distributed
    if dist.is_available() and isinstance(group, dist.ProcessGroup):
        return group
    raise TypeError(f"process_group={group!r} is not a torch.distributed ProcessGroup; valid: "
                    "None, or a group such as torch.distributed.group.WORLD or the result of "
                    "torch.distributed.new_group()")


def _infer_device() -> str:
    """The device type used when none is given: the active initialize's, else cuda/cpu."""
    return inferred_device_type()


def _device_type(device: Any) -> str:
    if device is None:
        return _infer_device()
    if isinstance(device, torch.device):
        return device.type
    return check_device_type(device)


