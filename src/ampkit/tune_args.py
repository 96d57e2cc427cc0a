"""autotune's arguments: each checked before anything is copied, trained or timed, and the
candidates it takes (ValueError/TypeError naming the bad value and the valid ones)."""

from __future__ import annotations

import math
import numbers
from typing import Any, Iterable, Optional

import torch
from torch import nn

from ._dtypes import device_policies, iter_tensors
from ._loss import check_target
from ._measure import check_threads
from ._reference import check_fp32_model
from .fp8.config import FP8_POLICY_NAMES, fp8_policy_recipe
from .policy import Policy, get_policy

FP8_CANDIDATES = FP8_POLICY_NAMES


def native_candidates(device: Optional[str] = None) -> list[str]:
    """The policies a device runs natively, fp32 first (autotune's default candidates)."""
    return list(device_policies(device).candidates)


def check_max_loss_dev(value: Any, name: str = "max_loss_dev") -> float:
    """The tolerance, a relative loss deviation: a finite real number >= 0 (any real
    type, numpy's too); ValueError naming ``name`` otherwise (the API's and the CLI's)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) \
            or not (value >= 0 and math.isfinite(value)):
        raise ValueError(f"{name} must be a number >= 0 (finite), got {value!r}; valid: e.g. "
                         "0.02 (2%)")
    return float(value)


def check_request(model: Any, inputs: Any, target: Any = None, *, candidates: Any = None,
                  max_loss_dev: Any = 0.02, steps: Any = 20, optimizer: Any = None,
                  loss_fn: Any = None, device: Any = None, threads: Any = None) -> list[str]:
    """Everything autotune checks before any work, alone (its arguments): a ValueError or
    TypeError here is a request it refuses (``ampkit tune`` makes it a usage error); one
    raised afterwards came from training. Returns the candidate names, as check_args."""
    names = check_args(model, candidates, max_loss_dev, steps, optimizer, loss_fn, device,
                       threads)
    check_inputs(inputs)
    if loss_fn is None:
        check_target(target)
    return names


def check_args(model: Any, candidates: Any, max_loss_dev: Any, steps: Any, optimizer: Any,
               loss_fn: Any, device: Any, threads: Any) -> list[str]:
    """Every argument of autotune but the batch checked; the candidate names given (a
    Policy by its name), or the device's native ones."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"autotune takes a torch.nn.Module, got {type(model).__name__} {model!r}")
    _check_model(model)
    if optimizer is not None and not callable(optimizer):
        raise TypeError(f"optimizer must be a callable params -> optimizer, got {optimizer!r}")
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"loss_fn must be a callable (output, target) -> loss, got {loss_fn!r}")
    if threads is not None:
        check_threads("threads", threads)
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 3:
        raise ValueError(f"steps must be an int >= 3 (2 warm-up steps, then timed ones), got {steps!r}")
    check_max_loss_dev(max_loss_dev)
    _check_device(device)  # first: the defaults below are the device's
    if isinstance(candidates, str):  # one name, not its characters
        candidates = [candidates]
    elif candidates is not None and not isinstance(candidates, Iterable):
        raise TypeError(f"candidates must be a policy name or a list of them, got "
                        f"{type(candidates).__name__} {candidates!r}")
    names = list(native_candidates(device) if candidates is None else candidates)
    names = [str(name) if isinstance(name, Policy) else name for name in names]  # a name each
    if not names:
        raise ValueError("candidates is empty; valid: policy names such as "
                         f"{', '.join(native_candidates(device))}")
    for name in names:
        check_candidate(name)
    return names


def _check_model(model: nn.Module) -> None:
    """An fp32 model (the reference must be fp32) with parameters to train, not wrapped
    in (Distributed)DataParallel (each candidate's policy is applied to a copy of it)."""
    if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
        raise TypeError(f"autotune takes the bare module, got it wrapped in "
                        f"{type(model).__name__}; valid: a torch.nn.Module not wrapped in "
                        "DistributedDataParallel/DataParallel (model.module), which autotune "
                        "trains in one process")
    check_fp32_model(model, "autotune")
    params = dict(model.named_parameters())
    valid = "valid: a model with at least one parameter that requires grad"
    if not params:
        raise ValueError(f"the model ({type(model).__name__}) has no parameters, and autotune "
                         f"compares the policies by training it; {valid}")
    if not any(param.requires_grad for param in params.values()):
        raise ValueError(f"no parameter of the model requires grad (all {len(params)} frozen, "
                         f"e.g. {next(iter(params))!r}), and autotune compares the policies by "
                         f"training it; {valid}")


def _check_device(device: Any) -> None:
    """A device autotune can run on here; ValueError names it and the valid ones."""
    if device is None:
        return
    valid = ", ".join(_valid_devices())
    if not isinstance(device, (str, torch.device)):
        raise TypeError(f"device must be a device name such as 'cpu' or 'cuda', got "
                        f"{type(device).__name__} {device!r}; valid: {valid}")
    name = str(device)
    try:
        parsed = torch.device(device)
    except (RuntimeError, ValueError):
        raise ValueError(f"unknown device {name!r}; valid: {valid}") from None
    if parsed.type == "cpu":
        return
    backend = getattr(torch, parsed.type, None)
    if backend is None or not hasattr(backend, "is_available") or not backend.is_available():
        raise ValueError(f"device {name!r} is not available here (torch {torch.__version__}, "
                         f"no {parsed.type} device); valid: {valid}")
    if parsed.index is not None and parsed.index >= backend.device_count():
        raise ValueError(f"device {name!r} does not exist here; valid: {valid}")


def _valid_devices() -> list[str]:
    """"cpu", then each accelerator type this machine has and its numbered devices."""
    valid = ["cpu"]
    for kind in ("cuda", "xpu", "mps"):
        backend = getattr(torch, kind, None)
        if backend is not None and hasattr(backend, "is_available") and backend.is_available():
            valid += [kind] + [f"{kind}:{i}" for i in range(backend.device_count())]
    return valid


def check_candidate(name: Any) -> str:
    """``name`` if autotune can measure it: a policy name or an fp8 candidate name.

    Raises ValueError naming the bad name and the valid ones.

    Example:
        >>> check_candidate("fp8-rowwise"), check_candidate("O2-bf16")
        ('fp8-rowwise', 'O2-bf16')
    """
    try:
        if fp8_policy_recipe(name) is not None:
            return name
    except ValueError as err:  # "fp8-" or "fp8-<unknown recipe>": fp8's own message
        raise ValueError(f"unknown candidate {name!r}: {err}") from None
    try:
        get_policy(name)
    except (TypeError, ValueError) as err:
        raise ValueError(f"unknown candidate {name!r}: {err}; or an fp8 candidate: "
                         f"{', '.join(FP8_CANDIDATES)}") from None
    return name


def check_inputs(inputs: Any) -> None:
    tensors = list(iter_tensors(inputs))
    if not tensors:
        raise TypeError(f"inputs must be a tensor, a list of them, or a tuple or dict holding "
                        f"tensors (the batch the model is called with), got "
                        f"{type(inputs).__name__} {inputs!r:.80}")
    empty = [tuple(t.shape) for t in tensors if t.numel() == 0]
    if empty:
        raise ValueError(f"inputs hold no samples (shape {empty[0]}); valid: a batch of at "
                         "least one sample")
