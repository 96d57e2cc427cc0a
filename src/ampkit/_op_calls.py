"""How an overridden op's call treats its arguments: the tensor an in-place op writes into
(``add_``, ``inplace=True``), ``out=`` (resized and refused as torch does), and whether a
function is one of torch's own ops (run with autocast off) or code of the caller's.

Read by ``overrides._casting_wrapper``, once per registration (the signatures) and per call.
"""

from __future__ import annotations

import inspect
import os
import types
import warnings
from typing import Any, Callable, Optional

import torch

from ._dtypes import iter_tensors


def is_in_place(fn: Callable[..., Any]) -> bool:
    """torch's naming: ``add_`` writes into its tensor (``__iadd__``'s kind is not covered)."""
    name = getattr(fn, "__name__", "")
    return name.endswith("_") and not name.endswith("__")


# The namespaces of torch's ops written in Python (``F.mse_loss``, ``torch.cdist``,
# ``torch.linalg.*``); not torch.utils (``checkpoint`` runs the caller's code).
_TORCH_OP_MODULES = frozenset({"torch", "torch.functional", "torch.nn.functional",
                               torch.Tensor.__module__,  # Tensor's Python methods
                               "torch.linalg", "torch.fft", "torch.special"})
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep


def is_torch_op(fn: Callable[..., Any]) -> bool:
    """A builtin, or one of torch's own Python ops: a function of an op namespace whose code
    is torch's (a function of yours wrapped with ``functools.wraps(F.x)`` is not)."""
    if not isinstance(fn, types.FunctionType):
        return True
    return (getattr(fn, "__module__", None) in _TORCH_OP_MODULES
            and fn.__code__.co_filename.startswith(_TORCH_DIR))


def inplace_flag(fn: Callable[..., Any]) -> tuple[Optional[int], Optional[str]]:
    """Where ``fn`` takes an ``inplace`` flag (``F.relu(input, inplace=False)``): its
    positional index (-1 when keyword-only; None without one or without a signature), and
    the name of the first parameter, the tensor written into."""
    try:
        parameters = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # builtins without a text signature
        return None, None
    first = parameters[0].name if parameters else None
    for index, parameter in enumerate(parameters):
        if parameter.name == "inplace":
            positional = parameter.kind in (parameter.POSITIONAL_ONLY,
                                            parameter.POSITIONAL_OR_KEYWORD)
            return (index if positional else -1), first
    return None, first


def flag_set(args: tuple, kwargs: dict, position: int) -> bool:
    if "inplace" in kwargs:
        return bool(kwargs["inplace"])
    return 0 <= position < len(args) and bool(args[position])


def check_out(name: str, result: Any) -> None:
    """torch's refusal of ``out=`` where autograd would need the result (a differentiable
    op on an argument that requires grad), before ``out`` is written."""
    if any(t.requires_grad for t in iter_tensors(result)):
        raise RuntimeError(f"{name}(): functions with out=... arguments don't support automatic "
                           "differentiation, but one of the arguments requires grad.")


def write_out(out: Any, result: Any) -> Any:
    """What ``out=`` promised: the result written into the caller's tensor(s), resized as
    torch resizes an ``out=`` tensor (silently when it is empty, else with its warning)."""
    with torch.no_grad():
        if isinstance(out, torch.Tensor):
            return _resized(out, result).copy_(result)
        for target, value in zip(out, result):
            _resized(target, value).copy_(value)
    return out


def _resized(out: torch.Tensor, result: torch.Tensor) -> torch.Tensor:
    if out.shape != result.shape:
        if out.numel() != 0:
            warnings.warn(
                f"An output with one or more elements was resized since it had shape "
                f"{list(out.shape)}, which does not match the required output shape "
                f"{list(result.shape)}. This behavior is deprecated, and in a future PyTorch "
                "release outputs will not be resized unless they have zero elements. You can "
                "explicitly reuse an out tensor t by resizing it, inplace, to zero elements "
                "with t.resize_(0).", UserWarning, stacklevel=4)
        out.resize_(result.shape)
    return out
