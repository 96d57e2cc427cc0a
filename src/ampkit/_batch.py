"""How ``autotune``, ``diagnose.inspect`` and ``fp8.select`` call a model with the batch a
user gave them: one rule, so a batch one of them takes, the others take alike.

``inputs`` is a tuple (``model(*inputs)``), a mapping (``model(**inputs)``: a dict, or a
``collections.UserDict`` such as transformers' ``BatchEncoding``) or anything else,
a tensor or a list of them included (``model(inputs)``: a detection model or a feature
pyramid takes one list); Lightning's ``example_input_array`` has the same rule.
"""

from __future__ import annotations

from collections import abc
from typing import Any

from torch import nn


def call_model(model: nn.Module, inputs: Any) -> Any:
    """``model`` called with ``inputs`` by the rule above.

    Example:
        >>> import torch
        >>> call_model(nn.Bilinear(2, 3, 1), (torch.ones(4, 2), torch.ones(4, 3))).shape
        torch.Size([4, 1])
    """
    if isinstance(inputs, tuple):
        return model(*inputs)
    if isinstance(inputs, abc.Mapping):
        return model(**inputs)
    if not isinstance(inputs, list):
        return model(inputs)
    try:
        return model(inputs)
    except TypeError as err:  # e.g. "forward() missing 1 required positional argument"
        raise TypeError(f"{err} (the batch is a list, which the model gets as one argument; "
                        "valid: a tuple for positional arguments, a dict for keywords)") from err
