"""Diagnostics: what a precision policy does to a model, module by module.

- :func:`inspect` runs one step in fp32 and one under a policy and compares every
  module's output and gradients (SQNR, underflow, overflow, the first non-finite
  module, FLOPs by dtype, advice).
- :func:`watch` finds the first module whose output or gradient becomes non-finite in
  your own training step, with one host sync at the end of the block.

Example:
    >>> import torch, ampkit
    >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
    >>> report = ampkit.diagnose.inspect(model, torch.randn(4, 8), policy="bf16-mixed")
    >>> report.first_nonfinite is None
    True
"""

from __future__ import annotations

from .flops import FlopCounter
from .inspection import inspect
from .nonfinite import NonFiniteError, Watch, watch
from .report import ModuleStats, Report

__all__ = ["inspect", "watch", "Watch", "NonFiniteError", "Report", "ModuleStats", "FlopCounter"]
