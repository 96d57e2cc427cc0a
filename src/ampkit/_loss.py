"""The default loss of autotune and diagnose.inspect: one rule, as DESIGN.md states it."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn


def default_loss(output: Any, target: Any) -> Tensor:
    """Cross-entropy for an integer target, MSE for a floating one, else the mean output."""
    if not isinstance(output, Tensor):
        raise TypeError(f"the model returned a {type(output).__name__}, not a tensor; valid: "
                        "pass loss_fn=(output, target) -> loss")
    check_target(target)
    if target is None:
        return output.float().mean()
    if not target.is_floating_point():
        # Class indices: cross_entropy takes them as int64 only (an int32 or int16 target
        # from a dataset is the same classes); a bool target is not indices and is left as is.
        if target.dtype not in (torch.bool, torch.int64) and not target.is_complex():
            target = target.long()
        return nn.functional.cross_entropy(output.float(), target)
    return nn.functional.mse_loss(output.float(), target.float())


def check_target(target: Any) -> None:
    """A target the default loss takes: a tensor or None (TypeError names it otherwise)."""
    if target is not None and not isinstance(target, Tensor):
        raise TypeError(f"the default loss takes a tensor target (class indices or values) or "
                        f"none, got {type(target).__name__} {target!r:.80}; valid: a "
                        "torch.Tensor, or pass loss_fn=(output, target) -> loss")
