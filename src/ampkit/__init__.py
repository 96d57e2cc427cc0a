"""ampkit: automatic mixed precision for PyTorch.

torch.amp-compatible ``autocast`` and ``GradScaler``, apex.amp-compatible opt levels
O0-O3 with fp32 master weights, fp8 linear layers, and precision policies.
"""

from __future__ import annotations

__version__ = "0.1.0"

# Policies
from .policy import Policy, get_policy

__all__ = [
    "__version__",
    # policies
    "Policy",
    "get_policy",
]
