"""A sharded run's state for ``torch.distributed.checkpoint`` (DCP): model, optimizer, scaler.

DCP saves and loads objects with ``state_dict``/``load_state_dict`` (its ``Stateful``
protocol) in place, each rank writing and reading its own shards. ``TrainState`` gathers
what an exact resume needs: the model's and the optimizer's sharded state (through
torch's ``get_state_dict``/``set_state_dict``, which key the optimizer state by
parameter name, so it loads into a freshly built optimizer) and the GradScaler's scale
and counters (Python numbers, the same on every rank).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from ..scaler import GradScaler


class TrainState:
    """Model, optimizer and GradScaler as one DCP ``Stateful``, for save and exact resume.

    Args:
        model: the (sharded) model.
        optimizer: its optimizer, or None to save the model alone.
        scaler: the GradScaler, or None (also leave it out when it is disabled: a disabled
            scaler has no state).

    Example:
        >>> state = {"train": TrainState(model, optimizer, scaler)}  # doctest: +SKIP
        >>> torch.distributed.checkpoint.save(state, checkpoint_id="ckpt/step100")  # doctest: +SKIP
        >>> torch.distributed.checkpoint.load(state, checkpoint_id="ckpt/step100")  # doctest: +SKIP
    """

    def __init__(self, model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None,
                 scaler: Optional[GradScaler] = None) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"TrainState: model must be a torch.nn.Module, got {model!r}")
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"TrainState: optimizer must be a torch.optim.Optimizer or None, "
                            f"got {optimizer!r}")
        if scaler is not None and not hasattr(scaler, "load_state_dict"):
            raise TypeError(f"TrainState: scaler must be a GradScaler or None, got {scaler!r}")
        self.model, self.optimizer, self.scaler = model, optimizer, scaler

    def state_dict(self) -> dict[str, Any]:
        """{"model": ..., "optimizer": ..., "scaler": ...}: sharded tensors and numbers."""
        from torch.distributed.checkpoint import state_dict as dcp_state

        if self.optimizer is None:
            state: dict[str, Any] = {"model": dcp_state.get_model_state_dict(self.model)}
        else:
            model_sd, optim_sd = dcp_state.get_state_dict(self.model, self.optimizer)
            state = {"model": model_sd, "optimizer": optim_sd}
        if self.scaler is not None and self.scaler.is_enabled():
            state["scaler"] = self.scaler.state_dict()  # reads the scale: one host sync
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load what :meth:`state_dict` saved, in place (DCP calls it after reading)."""
        from torch.distributed.checkpoint import state_dict as dcp_state

        if self.optimizer is None:
            dcp_state.set_model_state_dict(self.model, state["model"])
        else:
            dcp_state.set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                                     optim_state_dict=state["optimizer"])
        if self.scaler is not None and self.scaler.is_enabled():
            self.scaler.load_state_dict(state["scaler"])
