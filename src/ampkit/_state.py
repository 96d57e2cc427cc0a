"""The process-wide setting left by the most recent ``initialize`` call.

``autocast`` and ``GradScaler`` read it to infer the device and half dtype when the
caller gives none; ``initialize`` writes it (and ``initialize(enabled=False)`` or a
later call replaces it, so no state leaks from an earlier call).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class ActiveAmp:
    """Device type and half dtype of the model given to the active ``initialize``."""

    device_type: str
    half_dtype: Optional[torch.dtype]


_active: Optional[ActiveAmp] = None


def set_active(state: Optional[ActiveAmp]) -> None:
    global _active
    _active = state


def get_active() -> Optional[ActiveAmp]:
    return _active


def inferred_device_type() -> str:
    """The active initialize's device type, else "cuda" when available, else "cpu"."""
    if _active is not None:
        return _active.device_type
    return "cuda" if torch.cuda.is_available() else "cpu"
