"""The delayed recipe's amax histories as state: made where the weight is (also for a
layer built on or moved to the meta device), saved, checked and loaded.

:class:`DelayedHistories` is a mixin of :class:`ampkit.fp8.linear.Float8Linear`, which
owns the buffers ``amax_history_{input,weight,grad_output}``, ``config``, ``weight`` and
the warm-up flag ``_delayed_started`` it reads.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .config import Recipe

ROLE_NAMES = ("input", "weight", "grad_output")
HISTORIES_IN_COMPILE = (
    "Float8Linear: the delayed recipe's amax histories of this meta-built layer are made, "
    "as zeros on the weight's device, at its first forward (after load_state_dict(assign="
    "True)), a step torch.compile(fullgraph=True) cannot trace; valid: one eager forward "
    "first, model.to_empty(device=...) instead of an assigning load, or fullgraph=False "
    "(one graph break, in the first call only)")


class DelayedHistories:
    """Histories made on the meta device hold no values: ``to_empty()`` fills them with
    whatever memory it gets, an assigning ``load_state_dict`` leaves them on meta. They
    are made again, as zeros, where the weight is once it is on a real device."""

    config: Any  # the layer's (Float8Config), weight and warm-up flag
    weight: Tensor
    _delayed_started: bool
    # Whether the histories were made on the meta device and wait to be made again (a
    # class default: layers pickled before it had none).
    _histories_pending = False

    def _zero_history(self) -> Tensor:
        # A plain tensor also where the weight is an FSDP2 DTensor (its device: its shard's).
        return torch.zeros(self.config.amax_history_len, dtype=torch.float32,
                           device=self.weight.device)

    def _histories_moved(self, emptied: bool = False) -> None:
        """After a move: a move to meta drops the histories' values, as building there
        does (made again where the weight lands, with a fresh warm-up); a move from meta
        makes them. ``emptied`` (``to_empty()`` from a real device): their values are
        uninitialised memory, NaN or any number, made again as from meta."""
        if self.config.recipe is Recipe.DELAYED and (emptied or
                                                     self.weight.device.type == "meta"):
            self._histories_pending = True
            self._delayed_started = False
        self._make_pending_histories()

    def _make_pending_histories(self) -> bool:
        """Zero histories on the weight's device, once, for histories made on meta; True
        when this call made them.

        Called where the layer is first used on a real device: after a move (``to_empty``
        of a meta-built model), at the forward (after ``load_state_dict(assign=True)``,
        which moves no buffer), and when its fp8 state is read or loaded. The per-step
        cost is the caller's check of one Python bool.
        """
        if not self._histories_pending or self.weight.device.type == "meta":
            return False
        for name in ROLE_NAMES:
            setattr(self, f"amax_history_{name}", self._zero_history())
        self._histories_pending = False
        return True

    def fp8_state_dict(self) -> dict[str, Any]:
        """The delayed recipe's amax histories and warm-up flag (empty for other recipes)."""
        if self.config.recipe is not Recipe.DELAYED:
            return {}
        self._make_pending_histories()
        state: dict[str, Any] = {"started": self._delayed_started}
        for name in ROLE_NAMES:
            state[f"amax_history_{name}"] = getattr(self, f"amax_history_{name}").detach().clone()
        return state

    def check_fp8_state_dict(self, state: dict[str, Any], *,
                             where: str = "Float8Linear fp8 state") -> None:
        """Raise ValueError/TypeError unless ``state`` is what :meth:`fp8_state_dict` gives
        here; ``where`` names ``state`` in the message."""
        expected = self.fp8_state_dict()
        if not isinstance(state, dict) or set(state) != set(expected):
            got = sorted(state, key=str) if isinstance(state, dict) else type(state).__name__
            raise ValueError(f"{where} has keys {got}; valid: {sorted(expected)}")
        for key, value in expected.items():
            if torch.is_tensor(value):
                check_history(state[key], value, f"{where}[{key!r}]")
            elif not isinstance(state[key], bool):
                raise TypeError(f"{where}[{key!r}] must be True or False, got "
                                f"{type(state[key]).__name__} {state[key]!r}; valid: True, False")

    @torch.no_grad()
    def load_fp8_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the delayed recipe's histories and warm-up flag."""
        self.check_fp8_state_dict(state)
        if self.config.recipe is not Recipe.DELAYED:
            return
        self._delayed_started = state["started"]
        for name in ROLE_NAMES:
            getattr(self, f"amax_history_{name}").copy_(state[f"amax_history_{name}"])


def check_history(value: Any, like: Tensor, where: str) -> None:
    """Raise unless ``value`` could be an amax history like ``like``."""
    valid = (f"valid: a {like.dtype} tensor of shape {tuple(like.shape)} (amax_history_len="
             f"{like.numel()}) of finite values >= 0")
    if not torch.is_tensor(value):
        raise TypeError(f"{where} must be a tensor, got {type(value).__name__} {value!r}; {valid}")
    if value.shape != like.shape or value.dtype != like.dtype:
        raise ValueError(f"{where} is a {value.dtype} tensor of shape {tuple(value.shape)}; {valid}")
    if value.device.type == "meta" or value.is_sparse:
        raise TypeError(f"{where} is a {value.layout} tensor on {value.device} (no values to "
                        f"load); {valid}")
    # A NaN or negative amax would give every later cast a NaN or negative scale.
    bad = (~value.isfinite() | (value < 0)).nonzero()  # one host sync, when loading only
    if len(bad):
        index = int(bad[0, 0])
        raise ValueError(f"{where} has {value[index].item()} at index {index}; {valid}")
