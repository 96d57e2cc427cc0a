"""ampkit: automatic mixed precision for PyTorch.

torch.amp-compatible ``autocast`` and ``GradScaler``, apex.amp-compatible opt levels
O0-O3 with fp32 master weights, fp8 linear layers, and precision policies.
"""

from __future__ import annotations

__version__ = "0.1.0"

# Policies
from .policy import Policy, get_policy

# Torch-style: autocast and op overrides
from .autocast import autocast
from .overrides import (
    disable_casts,
    float_function,
    half_function,
    promote_function,
    register_float_function,
    register_half_function,
    register_promote_function,
)

__all__ = [
    "__version__",
    # policies
    "Policy",
    "get_policy",
    # torch-style
    "autocast",
    # op overrides
    "register_half_function",
    "register_float_function",
    "register_promote_function",
    "half_function",
    "float_function",
    "promote_function",
    "disable_casts",
]
