"""What ``scale_loss`` checks before it changes anything: that ``initialize`` ran, its
arguments (the loss, the optimizers it prepared, the loss id), and whether a later
``initialize`` replaced the one that prepared them."""

from __future__ import annotations

import numbers
from typing import Any, Optional

import torch
from torch import Tensor

from .. import _state
from .._warn import warn
from .._orphan import ORPHAN_MESSAGE, is_orphan
from ..optim import AmpStash, as_optimizers, stash_of


def require_initialized() -> _state.ActiveAmp:
    """The active initialize (RuntimeError when there is none)."""
    amp = _state.get_active()
    if amp is None:
        raise RuntimeError("ampkit.initialize has not been called: call model, optimizer = "
                           "amp.initialize(model, optimizer, opt_level=...) first")
    return amp


REPLACED = (
    "ampkit.scale_loss: optimizers[{i}] ({name}) was prepared by an earlier ampkit.initialize, "
    "and a later initialize of other models (or TuneResult.apply) replaced its amp state: "
    "this scale_loss uses the later one's loss scalers and settings (one amp state per "
    "process, as in apex), so the two runs share a loss scale; valid: one initialize for "
    "every model and optimizer (lists of each, num_losses=N for N losses)")


def warn_if_replaced(i: int, opt: Any, stash: Optional[AmpStash], amp: Any) -> None:
    """Once per replaced initialize: its flag lives on its state (a key by id() in a
    process-wide set grew with every replaced initialize, and a new state given a freed
    one's id was never warned about)."""
    replaced = None if stash is None else stash.prepared_by
    if replaced is not None and replaced is not amp and not replaced.replaced_warned:
        replaced.replaced_warned = True
        warn(REPLACED.format(i=i, name=type(opt).__name__))


def check_scale_loss(loss: Any, optimizers: Any, loss_id: Any, amp: _state.ActiveAmp
                      ) -> tuple[list[torch.optim.Optimizer], list[AmpStash]]:
    """The optimizers as a list, and their stashes; raises on a bad argument."""
    if not isinstance(loss, Tensor):
        raise TypeError(f"loss must be a torch.Tensor, got {type(loss).__name__} {loss!r}")
    if isinstance(optimizers, torch.optim.Optimizer):  # the usual call: one optimizer
        opts = [optimizers]
        stashes = [stash_of(optimizers)]
    else:
        opts = as_optimizers(optimizers, "optimizers")
        stashes = [stash_of(opt) for opt in opts]
        for i, opt in enumerate(opts):
            if any(opt is other for other in opts[:i]):  # its grads would be unscaled twice
                raise ValueError(f"optimizers[{i}] ({type(opt).__name__}) is listed twice; "
                                 "valid: each optimizer once")
    for i, (opt, stash) in enumerate(zip(opts, stashes)):
        if stash is None:  # (an optimizer with a stash is never an orphan)
            if is_orphan(opt):
                raise RuntimeError(f"optimizers[{i}]: "
                                   + ORPHAN_MESSAGE.format(name=type(opt).__name__))
            raise RuntimeError(f"optimizers[{i}] ({type(opt).__name__}) was not passed through "
                               "ampkit.initialize; valid: the optimizer(s) initialize returned")
        warn_if_replaced(i, opt, stash, amp)
    count = len(amp.scalers)
    # A plain int is checked without the ABC check's calls (bool's class is not int).
    integral = loss_id.__class__ is int or (not isinstance(loss_id, bool)
                                            and isinstance(loss_id, numbers.Integral))
    if not integral or not 0 <= loss_id < count:
        raise ValueError(f"loss_id={loss_id!r} is out of range; valid: 0..{count - 1} "
                         f"(initialize had num_losses={count})")
    return opts, stashes
