"""Gradients of a plain ``loss.backward()`` under an initialize that scales an fp16 loss.

Such gradients had no loss scaling: those below fp16's smallest subnormal became zero.
O2's step and a closure's evaluation that move them from the half model into the masters,
and a ``scale_loss`` block that finds them held at its start (O1, O2), warn once per
optimizer. apex's O2 step ignored them, silently (apex#747). An O1 step is not checked:
torch's own code steps with zero gradients (DCP's ``_init_optim_state``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

from ._warn import warn

if TYPE_CHECKING:
    from .master import MasterWeights
    from .optim import AmpStash


def warn_unscaled(stash: "AmpStash", masters: Optional["MasterWeights"]) -> None:
    """Once per optimizer: fp16 grads of a plain ``backward()`` under an initialize that
    scales the loss (its small grads flushed to zero; apex's O2 step ignored them)."""
    amp = stash.prepared_by
    if stash.unscaled_warned or amp is None or not (amp.enabled and amp.scaling) or not (
            amp.half_dtype is torch.float16 if masters is None else
            any(p.dtype == torch.float16 for p in masters.model_params)):
        return
    stash.unscaled_warned = True
    warn(f"opt_level {amp.opt_level or 'O2'}: a plain loss.backward() under fp16, which no "
         "loss scaling scaled: its gradients below about 6e-8 became zero, and the rest are "
         "applied as they are. Wrap the backward in `with amp.scale_loss(loss, optimizer) as "
         "scaled_loss: scaled_loss.backward()` (or use ampkit.GradScaler), or pass "
         "loss_scale=1.0 to initialize to train unscaled. Said once per optimizer")
