"""FP8 training: Float8Linear layers, convert_to_fp8, and fp8 attention.

Example:
    >>> import torch
    >>> from ampkit.fp8 import convert_to_fp8
    >>> model = convert_to_fp8(torch.nn.Sequential(torch.nn.Linear(64, 64)), recipe="delayed")
"""

from __future__ import annotations

from .attention import check_fp8_attention, fp8_attention, scaled_dot_product_attention
from .config import AmaxComputeAlgo, Float8Config, Recipe
from .convert import convert_to_fp8, fp8_state_dict, load_fp8_state_dict
from .linear import Float8Linear

__all__ = ["AmaxComputeAlgo", "Float8Config", "Float8Linear", "Recipe", "check_fp8_attention",
           "convert_to_fp8", "fp8_attention", "fp8_state_dict", "load_fp8_state_dict",
           "scaled_dot_product_attention"]
