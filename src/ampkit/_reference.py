"""The fp32 reference that ``autotune`` and ``diagnose.inspect`` hold every policy against:
the model they take must be fp32, or the "fp32" pass silently is not (one check, shared).
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.nn.parameter import is_lazy

from .fp8.linear import Float8Linear


def check_fp32_model(model: nn.Module, caller: str) -> None:
    """Refuse a model whose reference pass would not be fp32: a floating parameter that is
    not fp32 (a ``.half()``/``.bfloat16()`` model, or O2/O3's cast), one on the meta device,
    or a Float8Linear layer. ValueError names the parameter or module and what is valid;
    ``caller`` ("inspect", "autotune") is the function the message names.

    Example:
        >>> check_fp32_model(nn.Linear(4, 2).bfloat16(), "autotune")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: parameter 'weight' is torch.bfloat16; the reference pass must be fp32; ...
    """
    valid = fp32_model_hint(caller)
    for name, param in model.named_parameters():
        if is_lazy(param):
            raise ValueError(f"parameter {name!r} is not materialized yet (a lazy module); "
                             "valid: run one forward on a batch first, so that its shape "
                             "is known")
        if param.device.type == "meta":
            raise ValueError(f"parameter {name!r} is on the meta device (no data to compare); "
                             "valid: a model with real storage")
        if param.is_floating_point() and param.dtype != torch.float32:
            raise ValueError(f"parameter {name!r} is {param.dtype}; the reference pass must be "
                             f"fp32; {valid}")
    for name, module in model.named_modules():
        if isinstance(module, Float8Linear):
            raise ValueError(f"module {name or '<model>'!r} is already a Float8Linear; {valid}")


def fp32_model_hint(caller: str) -> str:
    """What :func:`check_fp32_model`'s refusals call valid (for a caller's own refusals)."""
    copies = ("the policy" if caller == "inspect" else
              "each policy" if caller == "the command" else "each candidate policy")
    return (f"valid: the fp32 model, before ampkit.initialize / convert_to_fp8 / .half() "
            f"({caller} applies {copies} to its own copy)")


def copy_model(model: nn.Module, caller: str) -> nn.Module:
    """A deep copy of ``model`` for ``caller``'s own passes ("inspect", "autotune").

    A tensor a forward pre-hook computes and keeps as a plain attribute (a pruned layer's
    ``weight = weight_orig * weight_mask``, the old ``weight_norm``'s ``weight``) is a
    non-leaf tensor, which ``copy.deepcopy`` refuses: the copy gets it detached (the hook
    computes it again from the copied parameters at the copy's next forward). Any other
    failure of ``copy.deepcopy`` is a TypeError naming it.

    Example:
        >>> from torch.nn.utils import prune
        >>> layer = prune.l1_unstructured(nn.Linear(4, 2), "weight", amount=0.5)
        >>> int((copy_model(layer, "inspect").weight == 0).sum())
        4
    """
    memo: dict[int, object] = {}
    for module in model.modules():
        for value in vars(module).values():
            if isinstance(value, torch.Tensor) and not value.is_leaf:
                memo[id(value)] = value.detach().clone()
    try:
        return copy.deepcopy(model, memo)
    except Exception as err:  # a model holding something deepcopy refuses
        raise TypeError(f"{caller} works on a deep copy of the model and copy.deepcopy failed "
                        f"({type(err).__name__}: {err}); valid: a deep-copyable "
                        "nn.Module") from err
