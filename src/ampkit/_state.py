"""ampkit's one piece of process-wide state: the active ``initialize``.

``initialize`` writes it (a later call, or ``initialize(enabled=False)``, replaces it
whole, so nothing leaks from an earlier call); ``autocast`` and ``GradScaler`` read the
device type and half dtype from it when the caller gives none; ``scale_loss`` its loss
scalers. Nothing here refers to a model or an optimizer. The test fixture resets it with
``set_active(None)``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

import torch

from ._dtypes import default_device_type

if TYPE_CHECKING:
    from .policy import Policy
    from .scaler import GradScaler


@dataclass(eq=False)
class ActiveAmp:
    """The active ``initialize``: where it runs and what it set up.

    Args:
        device_type: the device type of the models it was given.
        half_dtype: its policy's half dtype (None for fp32).
        enabled: False after ``initialize(enabled=False)``: scale_loss passes through.
        policy: the policy it applied.
        scalers: one loss scaler per loss (``num_losses``).
        log_level: the logging level of its messages (from ``verbosity``).
        scaling: False while the loss scale is a fixed 1.0 (scale_loss has nothing to do).
        overflow_notes: fused overflows on their way to the host, for the log.
        scale_windows: in a run of several processes, per loss id, the loss-scale updates
            that wait for the end of their accumulation window (see ``scale_loss``).
        fixed_unskipped: per loss id, under a fixed loss scale, the exits that would have
            updated a dynamic one (apex's ``_unskipped``; a dynamic scaler's count is its
            growth tracker, and this list is empty). Filled by ``initialize``.
        opt_level: the opt level ``initialize`` was given ("O0".."O3"; None when
            ``TuneResult.apply`` configured the policy).
        replaced_warned: ``scale_loss`` warned that a later initialize replaced this one.
    """

    device_type: str
    half_dtype: Optional[torch.dtype]
    enabled: bool = True
    policy: Optional["Policy"] = None
    scalers: list["GradScaler"] = field(default_factory=list)
    log_level: int = logging.INFO
    scaling: bool = False
    overflow_notes: list[Any] = field(default_factory=list)
    scale_windows: dict[int, Any] = field(default_factory=dict)
    fixed_unskipped: list[int] = field(default_factory=list)
    opt_level: Optional[str] = None
    replaced_warned: bool = False

    @property
    def dynamic(self) -> bool:
        return self.policy is not None and self.policy.dynamic_loss_scale


_active: Optional[ActiveAmp] = None
# scale_loss bodies begun in this process. A gradient an optimizer holds when a body
# begins, with none begun since that optimizer last zeroed, stepped or left a body, was
# written by a plain backward (unscaled), not by another body's scaled one.
_bodies = [0]


def body_began() -> None:
    _bodies[0] += 1


def bodies() -> int:
    return _bodies[0]


def set_active(state: Optional[ActiveAmp]) -> None:
    global _active
    _active = state


def get_active() -> Optional[ActiveAmp]:
    return _active


def inferred_device_type() -> str:
    """The active initialize's device type, else "cuda" when available, else "cpu"."""
    if _active is not None and _active.enabled:
        return _active.device_type
    return default_device_type()
