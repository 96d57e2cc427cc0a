"""What :func:`~ampkit.diagnose.inspect` is asked to do, checked before anything runs: the
model (fp32, not initialized, not wrapped), the policy's name resolved to a Policy and an
fp8 recipe, the device, the loss function and the modules ``keep_fp32`` selected.

``inspect`` runs what :func:`prepare` returns; ``ampkit doctor`` calls
:func:`check_request` to tell a refused request (exit 2) from a failing model.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Union

import torch
from torch import Tensor, nn

from .._dtypes import autocast_default_dtype, capability, iter_tensors
from .._reference import check_fp32_model, fp32_model_hint
from .._torch_compat import uncompiled
from ..apply import check_models, make_scalers
from ..convert import conversion_of
from ..fp8.config import FP8_BASE_POLICY, FP8_POLICY_NAMES, fp8_policy_recipe
from ..keep import kept_modules, kept_names
from ..policy import Policy, get_policy

LossFn = Callable[[Any, Any], Tensor]


class Setup:
    """The validated request: what to run, where, and with which casts."""

    def __init__(self, name: str, policy: Policy, fp8_recipe: Optional[str],
                 device: torch.device, loss_fn: Optional[LossFn], kept: frozenset[str],
                 selection: tuple[str, ...]) -> None:
        self.name, self.policy, self.fp8_recipe = name, policy, fp8_recipe
        self.device, self.loss_fn = device, loss_fn
        # The dtype values meet under the policy; a pure-fp32 policy casts nothing, and
        # neither do modules ampkit.keep_fp32 selected (they are part of the policy).
        self.half = policy.half_dtype or torch.float32
        self.kept = kept
        # The names the caller passed to keep_fp32: advice to keep one more must repeat
        # them, since a second keep_fp32 call replaces the selection.
        self.selection = selection
        # The first scale a GradScaler of this policy uses (2**16 dynamic, the static
        # scale, 1.0 for none): the rule lives in ampkit.apply; get_scale() before the
        # first step returns the initial scale without a sync.
        self.loss_scale = make_scalers(policy, 1, device.type)[0].get_scale()

    def cast_dtype(self, name: str) -> torch.dtype:
        """The dtype module ``name``'s parameter gradients are cast to under the policy
        (its outputs are counted against the dtype they have under the policy)."""
        return torch.float32 if name in self.kept else self.half


def check_request(model: nn.Module, inputs: Any, *, policy: Union[str, Policy, None] = None,
                  loss_fn: Optional[LossFn] = None) -> None:
    """What :func:`~ampkit.diagnose.inspect` checks before anything runs, alone: a ValueError or TypeError
    here is a request inspect refuses (a half or converted model, a bad policy or
    loss_fn); one that inspect raises afterwards came from running the model.

    Example:
        >>> check_request(nn.Linear(4, 2).half(), torch.randn(3, 4))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: parameter 'weight' is torch.float16; the reference pass must be fp32; ...
    """
    prepare(uncompiled(model), inputs, policy, loss_fn)


def prepare(model: Any, inputs: Any, policy: Any, loss_fn: Any) -> Setup:
    """Check every argument before anything runs; resolve the policy and the device."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"inspect takes a torch.nn.Module, got {type(model).__name__} {model!r}")
    check_models(model)  # refuses a DistributedDataParallel/DataParallel wrapper
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"loss_fn must be a callable (output, target) -> loss, got {loss_fn!r}")
    if torch.is_inference_mode_enabled():
        raise RuntimeError("inspect needs autograd (it runs a backward pass); valid: call it "
                           "outside torch.inference_mode()")
    _check_fp32_model(model)
    device = _device_of(model, inputs)
    name, resolved, recipe = resolve_policy(policy, device.type)
    kept = {id(m) for m in kept_modules(model)}
    fp32_names = frozenset(n for n, m in model.named_modules() if id(m) in kept)
    return Setup(name, resolved, recipe, device, loss_fn, fp32_names, tuple(kept_names(model)))


def _check_fp32_model(model: nn.Module) -> None:
    check_fp32_model(model, "inspect")
    if conversion_of(model) is not None:
        raise ValueError("this model went through ampkit.initialize (its forward hooks cast); "
                         f"{fp32_model_hint('inspect')}")


def _device_of(model: nn.Module, inputs: Any) -> torch.device:
    for param in model.parameters():
        return param.device
    for tensor in iter_tensors(inputs):
        return tensor.device
    return torch.device("cpu")


def default_policy(device_type: str) -> str:
    """The device's default mixed policy: bf16-mixed where bf16 runs natively or is the
    autocast default (CPU), else 16-mixed (CUDA without bf16)."""
    bf16 = (device_type == "cuda" and capability(device_type).bf16) or \
        autocast_default_dtype(device_type) == torch.bfloat16
    return "bf16-mixed" if bf16 else "16-mixed"


def resolve_policy(policy: Union[str, Policy, None],
                   device_type: str) -> tuple[str, Policy, Optional[str]]:
    """(name, Policy, fp8 recipe or None) for ``policy``; ValueError names the valid ones."""
    if policy is None:
        policy = default_policy(device_type)
    if isinstance(policy, Policy):
        return str(policy), policy, None
    if not isinstance(policy, str):
        raise TypeError(f"policy must be a name (str), a Policy or None, got "
                        f"{type(policy).__name__} {policy!r}")
    recipe = fp8_policy_recipe(policy)  # the meaning of the fp8 names: decided in fp8.config
    if recipe is not None:
        return policy.strip(), get_policy(FP8_BASE_POLICY), recipe
    try:
        return policy.strip(), get_policy(policy), None
    except ValueError as err:
        raise ValueError(f"{err}; or an fp8 policy: {', '.join(FP8_POLICY_NAMES)}") from None

