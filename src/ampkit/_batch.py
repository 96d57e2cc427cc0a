"""How ``autotune``, ``diagnose.inspect`` and ``fp8.select`` call a model with the batch a
user gave them: one rule, so a batch one of them takes, the others take alike.

``inputs`` is a tensor (``model(inputs)``), a tuple or list (``model(*inputs)``: a
DataLoader's collated list of inputs too) or a dict (``model(**inputs)``).
"""

from __future__ import annotations

from typing import Any

from torch import nn


def call_model(model: nn.Module, inputs: Any) -> Any:
    """``model`` called with ``inputs`` by the rule above.

    Example:
        >>> import torch
        >>> call_model(nn.Bilinear(2, 3, 1), [torch.ones(4, 2), torch.ones(4, 3)]).shape
        torch.Size([4, 1])
    """
    if isinstance(inputs, (tuple, list)):
        return model(*inputs)
    if isinstance(inputs, dict):
        return model(**inputs)
    return model(inputs)


def arguments(inputs: Any) -> list[Any]:
    """The arguments ``call_model`` passes: positional ones, then keyword values."""
    if isinstance(inputs, (tuple, list)):
        return list(inputs)
    if isinstance(inputs, dict):
        return list(inputs.values())
    return [inputs]
