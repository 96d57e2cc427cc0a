"""apex.amp's front end on ampkit: ``initialize``, ``scale_loss`` and the amp state dict.

``initialize`` resolves a :class:`~ampkit.policy.Policy` from an opt level and apex's
keyword overrides, then applies it: the models through ``convert.py`` (parameter dtype,
forward casts, fp32 state dicts), the optimizers through ``master.py`` (fp32 master
weights under O2) plus a step guard that ``scale_loss`` uses to skip a step after an
overflow. ``scale_loss`` keeps one dynamic loss scaler per loss, each a
:class:`~ampkit.scaler.GradScaler` driven through its shared unscale/update helpers.

Process-wide state is only the active call's settings and scalers: nothing refers to
the models or optimizers, so a later ``initialize`` replaces it without leaking.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import numbers
import warnings
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional, Sequence, Union

import torch
from torch import Tensor, nn

from . import _state
from ._dtypes import FLOAT_DTYPES, HALF_DTYPES, autocast_default_dtype, default_device_type, resolve_dtype
from .autocast import autocast
from .convert import BATCHNORM_TYPES, ForwardCasts, conversion_of, convert_model
from .master import MasterWeights, master_of, release_masters
from .optim import ORPHAN_MESSAGE, AmpStash, is_orphan, master_weights_of, own_params, stash_of, wrap
from .policy import OPT_LEVELS, Policy, get_policy
from .scaler import FP16_GRAD_MIN_SCALE, GradScaler, check_floor, unscale_grads_

logger = logging.getLogger("ampkit")

# verbosity -> logging level of ampkit's messages (overflows, the chosen opt level).
# 2 is WARNING so the messages show without any logging configuration, like apex's prints.
_LEVELS = {0: logging.DEBUG, 1: logging.INFO, 2: logging.WARNING}
_DYNAMIC_INIT_SCALE = 2.0**16  # apex's first dynamic scale
_GROWTH_INTERVAL = 2000  # apex's clean steps before the scale doubles
ModelArg = Union[nn.Module, Sequence[nn.Module]]
OptimizerArg = Union[torch.optim.Optimizer, Sequence[torch.optim.Optimizer]]


@dataclass
class _AmpState:
    """The active initialize: its policy, loss scalers and log level."""

    enabled: bool
    policy: Optional[Policy] = None
    scalers: list[GradScaler] = field(default_factory=list)
    log_level: int = logging.INFO
    # False while the loss scale is a fixed 1.0: scale_loss has nothing to unscale. Set by
    # initialize from the policy, and by writing _amp_state.loss_scalers[i]._loss_scale.
    scaling: bool = False
    overflow_notes: list["_OverflowNote"] = field(default_factory=list)

    @property
    def dynamic(self) -> bool:
        return self.policy is not None and self.policy.dynamic_loss_scale


_amp: Optional[_AmpState] = None


# --- initialize ---------------------------------------------------------------------------
def initialize(models: ModelArg, optimizers: Optional[OptimizerArg] = None, enabled: bool = True,
               opt_level: str = "O1", cast_model_type: Optional[torch.dtype] = None,
               patch_torch_functions: Optional[bool] = None,
               keep_batchnorm_fp32: Union[bool, str, None] = None,
               master_weights: Optional[bool] = None, loss_scale: Union[float, str, None] = None,
               cast_model_outputs: Optional[torch.dtype] = None, num_losses: int = 1,
               verbosity: int = 1, min_loss_scale: Optional[float] = None,
               max_loss_scale: float = 2.0**24, *,
               half_dtype: Union[torch.dtype, str, None] = None) -> Any:
    """Prepare models and optimizers for an opt level, as ``apex.amp.initialize`` did.

    Everything is validated before any model or optimizer changes. A later call replaces
    this one's settings and loss scalers; a model passed again loses this call's hooks.

    Args:
        models: a module or a list of modules (not yet wrapped in DDP/DataParallel).
        optimizers: an optimizer, a list of them, or None; each may be initialized once.
        enabled: False returns the inputs untouched and makes scale_loss a pass-through.
        opt_level: "O0" fp32, "O1" autocast, "O2" half model + fp32 masters, "O3" pure half.
        cast_model_type, patch_torch_functions, keep_batchnorm_fp32, master_weights,
        loss_scale, cast_model_outputs: apex's overrides of the level's defaults.
        num_losses: how many losses get their own loss scaler (``scale_loss(loss_id=...)``).
        verbosity: 0 logs at DEBUG, 1 at INFO, 2 at WARNING (logger "ampkit").
        min_loss_scale, max_loss_scale: bounds of the dynamic loss scale.
        half_dtype: torch.float16 or torch.bfloat16 (None: the device's autocast default).

    Returns:
        ``models`` when ``optimizers`` is None, else ``(models, optimizers)``: the same
        objects that were passed, modified in place.

    Example:
        >>> model, optimizer = initialize(model, optimizer, opt_level="O2")  # doctest: +SKIP
    """
    model_list = _check_models(models)
    opt_list = _check_optimizers(optimizers)
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled must be a bool, got {enabled!r}; valid: True, False")
    level = _check_opt_level(opt_level)
    count = _check_count("num_losses", num_losses, 1)
    log_level = _LEVELS[min(_check_count("verbosity", verbosity, 0), 2)]
    device_type = _device_type_of(model_list)
    half = (autocast_default_dtype(device_type) if half_dtype is None
            else resolve_dtype(half_dtype, allowed=HALF_DTYPES, what="half_dtype"))
    policy = _resolve_policy(level, half, cast_model_type=cast_model_type,
                             patch_torch_functions=patch_torch_functions,
                             keep_batchnorm_fp32=keep_batchnorm_fp32,
                             master_weights=master_weights, loss_scale=loss_scale,
                             cast_model_outputs=cast_model_outputs)
    scalers = _make_scalers(policy, count, device_type, min_loss_scale, max_loss_scale)
    if enabled:
        _check_params(model_list, opt_list, policy)
    # Nothing was modified above this line.
    global _amp
    if not enabled:
        _amp = _AmpState(enabled=False)
        _state.set_active(None)
    else:
        _amp = _AmpState(True, policy, scalers, log_level, scaling=policy.loss_scale != 1.0)
        _state.set_active(_state.ActiveAmp(device_type, policy.half_dtype))
        _apply(policy, model_list, opt_list, device_type, cast_model_outputs is not None)
        _warn_about_bf16_o3(level, policy)
        logger.log(log_level, "ampkit.initialize: opt_level %s on %s, policy %s, %d loss scaler(s)",
                   level, device_type, policy, count)
    return models if optimizers is None else (models, optimizers)


def _apply(policy: Policy, models: list[nn.Module], optimizers: list[torch.optim.Optimizer],
           device_type: str, explicit_outputs: bool) -> None:
    params = [p for model in models for p in model.parameters()]
    # An earlier initialize's masters of these parameters would keep taking their grads;
    # their fp32 values seed the new masters (the half params are rounded from them).
    earlier = {id(p): m for p in params if (m := master_of(p)) is not None}
    release_masters(params)
    casts = _forward_casts(policy, device_type, explicit_outputs)
    keep_fp32 = BATCHNORM_TYPES if policy.keep_batchnorm_fp32 else ()
    for model in models:
        if conversion_of(model) is not None:
            _restore_fp32(model, earlier)
    # The fp32 values before the cast (references to their storage, no copies): the new
    # masters start from them, not from the half values rounded from them.
    fp32_values = {id(p): p.data for p in params if p.dtype == torch.float32}
    for model in models:
        convert_model(model, param_dtype=policy.param_dtype, keep_fp32=keep_fp32, casts=casts)
    for optimizer in optimizers:
        masters = wrap(optimizer, master_weights=policy.master_weights).masters
        if masters is not None:
            _seed_masters(masters, fp32_values)


@torch.no_grad()
def _restore_fp32(model: nn.Module, earlier: dict[int, Tensor]) -> None:
    """Undo an earlier initialize's cast: params back to fp32 (their masters' values when
    they had masters, so nothing is lost) and half buffers back to fp32, in place, so the
    new opt level starts from the fp32 model the earlier call was given.
    """
    for param in model.parameters():
        if param.dtype in HALF_DTYPES:
            master = earlier.get(id(param))
            param.data = master.detach().clone() if master is not None else param.data.float()
    for module in model.modules():
        for name, buffer in module._buffers.items():
            if buffer is not None and buffer.dtype in HALF_DTYPES:
                module._buffers[name] = buffer.float()


@torch.no_grad()
def _seed_masters(masters: MasterWeights, earlier: dict[int, Tensor]) -> None:
    for param, master in zip(masters.model_params, masters.master_params):
        previous = earlier.get(id(param))
        if previous is not None and previous.shape == master.shape:
            master.copy_(previous)


def _forward_casts(policy: Policy, device_type: str, explicit_outputs: bool) -> ForwardCasts:
    half_params = policy.param_dtype in HALF_DTYPES
    region = functools.partial(autocast, device_type, policy.compute_dtype) if policy.autocast else None
    cast_outputs = half_params or policy.autocast or explicit_outputs
    return ForwardCasts(input_dtype=policy.param_dtype if half_params else None,
                        output_dtype=policy.output_dtype if cast_outputs else None,
                        autocast=region)


# --- initialize: argument checks ----------------------------------------------------------
def _check_models(models: Any) -> list[nn.Module]:
    model_list = _as_list(models, "models", nn.Module, "torch.nn.Module")
    if not model_list:
        raise ValueError("models is an empty list; pass a torch.nn.Module or a list of them")
    for i, model in enumerate(model_list):
        if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            raise TypeError(f"models[{i}] is wrapped in {type(model).__name__}; pass the bare "
                            f"module (valid: a torch.nn.Module not wrapped in "
                            f"DistributedDataParallel/DataParallel) and wrap it after initialize")
    return model_list


def _check_optimizers(optimizers: Any) -> list[torch.optim.Optimizer]:
    if optimizers is None:
        return []
    opt_list = _as_list(optimizers, "optimizers", torch.optim.Optimizer, "torch.optim.Optimizer")
    for i, optimizer in enumerate(opt_list):
        if any(optimizer is other for other in opt_list[:i]):
            raise ValueError(f"optimizers[{i}] ({type(optimizer).__name__}) is listed twice; "
                             "valid: each optimizer once")
        if stash_of(optimizer) is not None:
            raise RuntimeError(
                f"optimizers[{i}] ({type(optimizer).__name__}) was already passed through "
                "ampkit.initialize; an optimizer can be initialized only once: create a new "
                "optimizer over the model's parameters and pass that")
    return opt_list


def _as_list(value: Any, name: str, kind: type, kind_name: str) -> list:
    if isinstance(value, kind):
        return [value]
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"{name} must be a {kind_name} or a list of them, got "
                        f"{type(value).__name__} {value!r}")
    for i, item in enumerate(value):
        if not isinstance(item, kind):
            raise TypeError(f"{name}[{i}] is a {type(item).__name__} ({item!r}), not a "
                            f"{kind_name}; valid: a {kind_name} or a list of them")
    return list(value)


def _check_opt_level(opt_level: Any) -> str:
    if isinstance(opt_level, str) and opt_level in OPT_LEVELS:
        return opt_level
    hint = ""
    if str(opt_level).strip() in ("0", "1", "2", "3"):
        hint = f" (a digit: did you mean 'O{str(opt_level).strip()}', with the letter O?)"
    raise ValueError(f"unknown opt_level {opt_level!r}{hint}; valid: "
                     f"{', '.join(repr(level) for level in OPT_LEVELS)}")


def _check_count(name: str, value: Any, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    return int(value)


def _device_type_of(models: list[nn.Module]) -> str:
    for i, model in enumerate(models):
        for name, param in model.named_parameters():
            if param.device.type == "meta":
                raise ValueError(
                    f"models[{i}] has parameter {name!r} on the meta device (no data to train "
                    "or cast); valid: a model with real storage, e.g. materialize it first with "
                    "model.to_empty(device=...) and initialize its weights")
            return param.device.type
    return default_device_type()


def _check_params(models: list[nn.Module], optimizers: list[torch.optim.Optimizer],
                  policy: Policy) -> None:
    """Each optimizer steps some of the models' parameters, in non-empty groups, and under
    master weights no parameter is stepped by two optimizers (one master per parameter).
    """
    model_params = {id(p) for model in models for p in model.parameters()}
    owner: dict[int, int] = {}
    for i, optimizer in enumerate(optimizers):
        params = []
        for j, group in enumerate(optimizer.param_groups):
            if not group["params"]:
                raise ValueError(f"optimizers[{i}].param_groups[{j}] has no parameters; valid: "
                                 "groups that each hold at least one parameter")
            params.extend(group["params"])
        if model_params and not any(id(p) in model_params for p in params):
            raise ValueError(f"optimizers[{i}] ({type(optimizer).__name__}) steps none of the "
                             "parameters of the models given to initialize; valid: an optimizer "
                             "built over those models' parameters")
        for p in params:
            first = owner.setdefault(id(p), i)
            if first != i and policy.master_weights:
                raise ValueError(
                    f"a parameter of shape {tuple(p.shape)} is in optimizers[{first}] and "
                    f"optimizers[{i}]; with master weights each half parameter has one fp32 "
                    "master that one optimizer steps; valid: each parameter in one optimizer")


def _warn_about_bf16_o3(level: str, policy: Policy) -> None:
    if level == "O3" and policy.param_dtype == torch.bfloat16 and not policy.master_weights:
        warnings.warn(
            "ampkit.initialize: opt_level O3 here trains the whole model in bfloat16 without "
            "fp32 master weights, and bf16 keeps 8 bits of mantissa: updates smaller than about "
            "1/256 of a weight are lost, so small-learning-rate recipes that trained under "
            "apex's fp16 O3 can stall. Pass half_dtype=torch.float16 for apex's O3, or use "
            "opt_level='O2' for fp32 master weights", UserWarning, stacklevel=3)


# --- initialize: the policy and the loss scalers -------------------------------------------
def _resolve_policy(level: str, half: torch.dtype, *, cast_model_type: Any,
                    patch_torch_functions: Any, keep_batchnorm_fp32: Any, master_weights: Any,
                    loss_scale: Any, cast_model_outputs: Any) -> Policy:
    """The opt level's policy in ``half``, with apex's keyword overrides applied."""
    policy = get_policy(level).with_half_dtype(half)
    changes: dict[str, Any] = {}
    if patch_torch_functions is not None:
        changes["autocast"] = _check_bool("patch_torch_functions", patch_torch_functions)
    if cast_model_type is not None:
        changes["param_dtype"] = resolve_dtype(cast_model_type, allowed=FLOAT_DTYPES,
                                               what="cast_model_type")
    use_autocast = changes.get("autocast", policy.autocast)
    param_dtype = changes.get("param_dtype", policy.param_dtype)
    if changes:  # autocast or param_dtype changed: compute is autocast's, else the params'
        changes["compute_dtype"] = half if use_autocast else param_dtype
    if master_weights is not None:
        changes["master_weights"] = _check_bool("master_weights", master_weights)
    elif param_dtype not in HALF_DTYPES:
        changes["master_weights"] = False  # fp32 params are their own masters
    if keep_batchnorm_fp32 is not None:
        changes["keep_batchnorm_fp32"] = _check_bool("keep_batchnorm_fp32", keep_batchnorm_fp32,
                                                     strings=True)
    if loss_scale is not None:
        changes["loss_scale"] = _numeric_string(loss_scale)
    if cast_model_outputs is not None:
        changes["output_dtype"] = resolve_dtype(cast_model_outputs, allowed=FLOAT_DTYPES,
                                                what="cast_model_outputs")
    return policy.replace(**changes) if changes else policy


def _check_bool(name: str, value: Any, strings: bool = False) -> bool:
    if isinstance(value, bool):
        return value
    if strings and value in ("True", "False"):  # apex took these from argparse as strings
        return value == "True"
    valid = "True, False" + (", 'True', 'False'" if strings else "")
    raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}; valid: {valid}")


def _numeric_string(loss_scale: Any) -> Any:
    """apex accepted loss_scale from argparse, e.g. "128.0"; anything else goes to Policy."""
    if isinstance(loss_scale, str) and loss_scale != "dynamic":
        try:
            return float(loss_scale)
        except ValueError:
            pass
    return loss_scale


def _check_scale_bound(name: str, value: Any, allow_none: bool) -> Optional[float]:
    if value is None and allow_none:
        return None
    if (isinstance(value, bool) or not isinstance(value, numbers.Real)
            or not (math.isfinite(value) and value > 0)):
        raise ValueError(f"{name} must be a positive finite number{' or None' if allow_none else ''}"
                         f", got {value!r}")
    return float(value)


def _make_scalers(policy: Policy, count: int, device_type: str, min_loss_scale: Any,
                  max_loss_scale: Any) -> list[GradScaler]:
    low = _check_scale_bound("min_loss_scale", min_loss_scale, allow_none=True)
    high = _check_scale_bound("max_loss_scale", max_loss_scale, allow_none=False)
    if low is not None and high is not None and low > high:
        raise ValueError(f"min_loss_scale={min_loss_scale!r} is greater than "
                         f"max_loss_scale={max_loss_scale!r}; valid: min_loss_scale <= max_loss_scale")
    if low is None and policy.param_dtype == torch.float16:
        # The model's own gradients are fp16: below a scale of 1 every step flushes more of
        # them to zero (at the fp32 floor all of them) instead of skipping.
        low = FP16_GRAD_MIN_SCALE
    if policy.dynamic_loss_scale:
        return [GradScaler(device_type, init_scale=_DYNAMIC_INIT_SCALE,
                           growth_interval=_GROWTH_INTERVAL, min_scale=low, max_scale=high)
                for _ in range(count)]
    # A fixed scale: the scaler only holds it (as a device tensor); it is never updated.
    return [GradScaler(device_type, init_scale=float(policy.loss_scale)) for _ in range(count)]


# --- scale_loss -------------------------------------------------------------------------------
@contextlib.contextmanager
def scale_loss(loss: Tensor, optimizers: OptimizerArg, loss_id: int = 0,
               model: Optional[nn.Module] = None, delay_unscale: bool = False,
               delay_overflow_check: bool = False) -> Iterator[Tensor]:
    """Yield ``loss.float() * scale``; on exit unscale the grads and check for overflow.

    On exit (unless ``delay_unscale``): each optimizer's gradients are unscaled (under O2
    the model's half gradients are moved into the fp32 masters as they are unscaled) and
    checked for inf/NaN, loss scaler ``loss_id`` is updated and, after an overflow, the
    next ``step()`` of exactly these optimizers does nothing (their params, masters and
    state stay as they are; their grads are dropped). Several scale_loss calls before one
    step accumulate: each unscales its own backward's grads. Gradients that reach another
    model's parameters in this backward stay there, untouched, until that model's
    ``zero_grad()`` (a GAN's generator loss through the discriminator), as in fp32.

    If the body raises, every gradient these optimizers' parameters received in it is
    dropped (the ones they held before are put back), so no scaled gradient is ever
    stepped.

    Host syncs: none when every optimizer is fused (``fused=True`` Adam/AdamW/SGD: the
    overflow flag stays on the device and the fused kernel skips the update, as with
    torch's GradScaler); otherwise one per call with a dynamic scale (reading the overflow
    flag, as apex did); none with a fixed scale or ``delay_overflow_check``. A skipped
    fused step keeps its (inf/NaN) grads until the next ``zero_grad``.

    Args:
        loss: the loss tensor (any dtype; the scaled loss is fp32).
        optimizers: the optimizer(s) returned by ``initialize`` that this backward feeds.
        loss_id: which loss scaler, in ``range(num_losses)``.
        model: unused, as in apex.
        delay_unscale: leave the grads scaled (accumulation; a later call unscales them).
        delay_overflow_check: unscale, but neither check for overflow nor update the
            scale (no host sync; the caller takes charge, as in apex).

    Example:
        >>> with scale_loss(loss, optimizer) as scaled_loss:  # doctest: +SKIP
        ...     scaled_loss.backward()
        >>> optimizer.step()  # doctest: +SKIP
    """
    amp = _require_initialized()
    if not amp.enabled:
        yield loss
        return
    opts = _check_scale_loss(loss, optimizers, loss_id, amp)
    if amp.overflow_notes:
        _report_overflows(amp)
    delay_unscale = _check_bool("delay_unscale", delay_unscale)
    delay_overflow_check = _check_bool("delay_overflow_check", delay_overflow_check)
    scaling = amp.scaling
    scaler = amp.scalers[loss_id]
    scaled = scaler.scale(loss.float()) if scaling else loss.float()
    held = [_set_aside(opt) for opt in opts]
    try:
        yield scaled
    except BaseException:
        for entry in held:
            entry.restore()
        raise
    if not scaling:  # a fixed scale of 1.0: nothing to unscale or check
        for opt, entry in zip(opts, held):
            _take_grads(opt, entry, None, None, delay=True)
        return
    inv_scale = scaler._inverse_scale()
    found_inf = torch.zeros((), dtype=torch.float32, device=inv_scale.device)
    for opt, entry in zip(opts, held):
        _take_grads(opt, entry, inv_scale, found_inf, delay=delay_unscale)
    if delay_unscale:
        for opt in opts:  # checked with the call that does not delay
            _stash(opt).pending_found_inf = _or_flag(_stash(opt).pending_found_inf, found_inf)
        return
    for opt in opts:
        stash = _stash(opt)
        if stash.pending_found_inf is not None:
            found_inf.add_(stash.pending_found_inf.to(found_inf.device))
            stash.pending_found_inf = None
    if amp.dynamic and not delay_overflow_check:
        _update(amp, scaler, found_inf, opts, loss_id)


@dataclass(eq=False)
class _Held:
    """The grads an optimizer's params held before a scale_loss body, set aside.

    Backward then writes only the body's own gradients, so they can be unscaled apart
    from grads an earlier scale_loss already unscaled, or dropped if the body raises.
    ``own``: the params the optimizer steps itself (their ``.grad``); ``half``: the half
    model params behind its fp32 masters (their grads are always still scaled). Only the
    (param, grad) pairs whose grad was set are kept: after a zero_grad there are none.
    """

    own: list[Tensor]
    half: list[Tensor]
    own_grads: list[tuple[Tensor, Tensor]]
    half_grads: list[tuple[Tensor, Tensor]]
    own_unscaled: bool

    def restore(self) -> None:
        for param in self.own + self.half:
            param.grad = None
        for param, grad in self.own_grads + self.half_grads:
            param.grad = grad

    @torch.no_grad()
    def add_back(self, *, own: bool, half: bool) -> None:
        pairs = (self.own_grads if own else []) + (self.half_grads if half else [])
        if not pairs:
            return
        summed = [(p.grad, old) for p, old in pairs if p.grad is not None]
        if summed:
            torch._foreach_add_([g for g, _ in summed], [old for _, old in summed])
        for param, old in pairs:
            if param.grad is None:
                param.grad = old
        if own:
            self.own_grads = []
        if half:
            self.half_grads = []


def _set_aside(optimizer: torch.optim.Optimizer) -> _Held:
    stash = _stash(optimizer)
    own = own_params(optimizer)
    half = [] if stash.masters is None else stash.masters.model_params
    held = _Held(own, half, [(p, p.grad) for p in own if p.grad is not None],
                 [(p, p.grad) for p in half if p.grad is not None], stash.grads_unscaled)
    for param, _ in held.own_grads + held.half_grads:
        param.grad = None
    return held


def _take_grads(optimizer: torch.optim.Optimizer, held: _Held, inv_scale: Optional[Tensor],
                found_inf: Optional[Tensor], delay: bool) -> None:
    """After the body: unscale what its backward produced for ``optimizer`` (unless
    ``delay``), move the model's half grads into the fp32 masters, add back what was held.

    The half grads move on every exit, delayed or not, so micro-batches accumulate in fp32
    in the masters; a delayed exit unscales them too (exact: a power-of-two multiply) and
    its inf check is carried to the exit that does not delay. The optimizer's own (fp32)
    grads stay scaled until that exit, as in apex.
    """
    stash = _stash(optimizer)
    # Held grads still scaled join the new ones before the unscale; grads an earlier exit
    # unscaled join after it.
    held.add_back(own=delay or not held.own_unscaled, half=True)
    own = [] if delay else [p.grad for p in held.own if p.grad is not None]
    unscale = None
    if inv_scale is not None and found_inf is not None:
        def unscale(new_master_grads: list[Tensor]) -> None:
            _unscale_grads(own + new_master_grads, inv_scale, found_inf)
    if stash.masters is not None:
        stash.masters.move_grads(unscale)
    elif unscale is not None:
        unscale([])
    held.add_back(own=True, half=False)
    if not delay:
        stash.grads_unscaled = True


def _or_flag(held: Optional[Tensor], flag: Tensor) -> Tensor:
    """Several overflow flags as one (any overflow counts)."""
    flag = flag.detach().reshape(())
    return flag if held is None else torch.maximum(held, flag.to(held.device))


def _unscale_grads(grads: list[Tensor], inv_scale: Tensor, found_inf: Tensor) -> None:
    if grads:
        unscale_grads_(grads, inv_scale, found_inf)


def _stash(optimizer: torch.optim.Optimizer) -> AmpStash:
    stash = stash_of(optimizer)
    assert stash is not None  # _check_scale_loss let only prepared optimizers through
    return stash


def _update(amp: _AmpState, scaler: GradScaler, found_inf: Tensor,
            optimizers: list[torch.optim.Optimizer], loss_id: int) -> None:
    scaler._apply_update(found_inf)
    names = ", ".join(type(opt).__name__ for opt in optimizers)
    if all(getattr(opt, "_step_supports_amp_scaling", False) for opt in optimizers):
        # Fused optimizers skip on the device: no host sync here, whatever the log level.
        # A listening logger gets the overflow later, from a copy already on the host.
        for optimizer in optimizers:
            stash = _stash(optimizer)
            stash.found_inf = _or_flag(stash.found_inf, found_inf)
        if logger.isEnabledFor(amp.log_level):
            amp.overflow_notes.append(_OverflowNote.start(found_inf, names, loss_id))
        return
    # The one host sync of scale_loss with plain optimizers (apex had it too): Python
    # must know now whether the next optimizer.step() runs. A listening logger's copy of
    # the new scale is queued before it, so that sync brings it to the host as well.
    listening = logger.isEnabledFor(amp.log_level)
    scale = scaler._get_scale_async()
    new_scale = scale.to("cpu", non_blocking=True, copy=True) if listening and scale is not None else None
    overflow = bool(found_inf.item())
    check_floor(scaler, overflow)
    if not overflow:
        return
    for optimizer in optimizers:
        _stash(optimizer).skip_next = True
    if new_scale is not None:
        new_scale._ampkit_host_copy = True  # type: ignore[attr-defined]
        logger.log(amp.log_level, "Gradient overflow: skipping the next step() of %s; loss "
                   "scaler %d now at %g", names, loss_id, new_scale.item())


@dataclass(eq=False)
class _OverflowNote:
    """A fused step's overflow flag on its way to the host, logged once it has arrived."""

    flag: Tensor
    event: Any
    names: str
    loss_id: int

    @classmethod
    def start(cls, found_inf: Tensor, names: str, loss_id: int) -> "_OverflowNote":
        flag = found_inf.detach().to("cpu", non_blocking=True, copy=True)
        flag._ampkit_host_copy = True  # type: ignore[attr-defined]  # read without a sync
        event = None
        if found_inf.device.type != "cpu":
            event = torch.Event(device=found_inf.device)
            event.record()
        return cls(flag, event, names, loss_id)

    def arrived(self) -> bool:
        return self.event is None or self.event.query()


def _report_overflows(amp: _AmpState) -> None:
    """Log the fused overflows whose flags have reached the host (no waiting on the device)."""
    waiting = []
    for note in amp.overflow_notes:
        if not note.arrived():
            waiting.append(note)
        elif note.flag.item():  # a host tensor: no device sync
            logger.log(amp.log_level, "Gradient overflow: the step of %s was skipped on the "
                       "device; loss scaler %d backed off", note.names, note.loss_id)
    amp.overflow_notes = waiting


def _require_initialized() -> _AmpState:
    if _amp is None:
        raise RuntimeError("ampkit.initialize has not been called: call model, optimizer = "
                           "amp.initialize(model, optimizer, opt_level=...) first")
    return _amp


def _check_scale_loss(loss: Any, optimizers: Any, loss_id: Any,
                      amp: _AmpState) -> list[torch.optim.Optimizer]:
    if not isinstance(loss, Tensor):
        raise TypeError(f"loss must be a torch.Tensor, got {type(loss).__name__} {loss!r}")
    opts = _as_list(optimizers, "optimizers", torch.optim.Optimizer, "torch.optim.Optimizer")
    for i, opt in enumerate(opts):
        if is_orphan(opt):
            raise RuntimeError(f"optimizers[{i}]: " + ORPHAN_MESSAGE.format(name=type(opt).__name__))
        if stash_of(opt) is None:
            raise RuntimeError(f"optimizers[{i}] ({type(opt).__name__}) was not passed through "
                               "ampkit.initialize; valid: the optimizer(s) initialize returned")
    count = len(amp.scalers)
    if isinstance(loss_id, bool) or not isinstance(loss_id, numbers.Integral) or not 0 <= loss_id < count:
        raise ValueError(f"loss_id={loss_id!r} is out of range; valid: 0..{count - 1} "
                         f"(initialize had num_losses={count})")
    return opts


# --- master params and the amp state dict -------------------------------------------------
def master_params(optimizer: torch.optim.Optimizer) -> Iterator[Tensor]:
    """The parameters the optimizer steps: the fp32 masters under O2, else the params.

    Example:
        >>> torch.nn.utils.clip_grad_norm_(master_params(optimizer), 1.0)  # doctest: +SKIP
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"master_params takes a torch.optim.Optimizer, got "
                        f"{type(optimizer).__name__} {optimizer!r}")
    return iter([p for group in optimizer.param_groups for p in group["params"]])


def state_dict(destination: Optional[dict] = None) -> dict[str, dict[str, Any]]:
    """The loss scalers' state: ``{"loss_scaler0": {"loss_scale": float, "unskipped": int}, ...}``.

    Exactly apex's format: ``loss_scale`` and ``unskipped`` (clean steps since the scale
    last changed, the growth tracker) are the whole of a loss scaler's evolving state, so
    a resumed run continues bitwise; the settings come from ``initialize``. Empty when not
    initialized or disabled. Syncs with the device.

    Example:
        >>> torch.save({"amp": state_dict()}, "ckpt.pt")  # doctest: +SKIP
    """
    result: dict[str, dict[str, Any]] = {} if destination is None else destination
    if _amp is None or not _amp.enabled:
        return result
    for i, scaler in enumerate(_amp.scalers):
        full = scaler.state_dict()
        result[f"loss_scaler{i}"] = {"loss_scale": float(full["scale"]),
                                     "unskipped": int(full["_growth_tracker"])}
    return result


def load_state_dict(state: dict[str, dict[str, Any]]) -> None:
    """Restore the loss scalers from :func:`state_dict` or an apex.amp checkpoint.

    Example:
        >>> load_state_dict(torch.load("ckpt.pt")["amp"])  # doctest: +SKIP
    """
    if _amp is None and isinstance(state, dict) and not state:
        return  # what state_dict() gives without initialize: nothing to restore
    amp = _require_initialized()
    if not amp.enabled:
        return
    expected = [f"loss_scaler{i}" for i in range(len(amp.scalers))]
    if not isinstance(state, dict):
        raise TypeError(f"amp state_dict must be a dict such as ampkit.state_dict() returns, got "
                        f"{type(state).__name__} {state!r}; valid: a dict with keys {expected}")
    if sorted(state) != sorted(expected):
        raise ValueError(f"amp state_dict has keys {sorted(state)}; valid: exactly {expected} "
                         f"(num_losses={len(amp.scalers)} in initialize)")
    full = [_scaler_state(key, state[key], scaler) for key, scaler in zip(expected, amp.scalers)]
    for scaler, entry in zip(amp.scalers, full):
        scaler._parse_state_dict(entry)  # validates: every entry before any scaler changes
    for scaler, entry in zip(amp.scalers, full):
        scaler.load_state_dict(entry)


def _scaler_state(key: str, entry: Any, scaler: GradScaler) -> dict[str, Any]:
    if not (isinstance(entry, dict) and "loss_scale" in entry and "unskipped" in entry):
        raise ValueError(f"amp state_dict[{key!r}] is {entry!r}; valid: a dict with 'loss_scale' "
                         "and 'unskipped'")
    # The scale and the clean-step count; settings (bounds, interval) stay this scaler's.
    return {"scale": entry["loss_scale"], "_growth_tracker": entry["unskipped"],
            "growth_factor": scaler.get_growth_factor(),
            "backoff_factor": scaler.get_backoff_factor(),
            "growth_interval": scaler.get_growth_interval()}


# --- apex's private attributes that public apex clients use -----------------------------
class _LossScaler:
    """apex's ``LossScaler`` as training scripts use it, over one of ampkit's loss scalers.

    ``loss_scale()`` and ``_loss_scale`` read the current scale, ``_unskipped`` the clean
    steps since it last changed; writing either sets the scaler (the next ``scale_loss``
    uses the new scale). Each read or write syncs with the device.
    """

    def __init__(self, amp: _AmpState, scaler: GradScaler) -> None:
        self._amp = amp
        self._scaler = scaler

    def loss_scale(self) -> float:
        return self._scaler.get_scale()

    @property
    def _loss_scale(self) -> float:
        return self._scaler.get_scale()

    @_loss_scale.setter
    def _loss_scale(self, value: float) -> None:
        scale = _check_scale_bound("_loss_scale", value, allow_none=False)
        self._set(scale=scale)
        if scale != 1.0:
            self._amp.scaling = True  # a fixed 1.0 becomes a real scale: scale_loss applies it

    @property
    def _unskipped(self) -> int:
        return int(self._scaler.state_dict()["_growth_tracker"])

    @_unskipped.setter
    def _unskipped(self, value: int) -> None:
        self._set(_growth_tracker=_check_count("_unskipped", value, 0))

    def _set(self, **entries: Any) -> None:
        state = self._scaler.state_dict()
        state.update(entries)
        self._scaler.load_state_dict(state)


class _AmpStateView:
    """``ampkit._amp_state``: apex's process-wide state, the parts apex clients read.

    ``loss_scalers[i]`` follows the active ``initialize`` (empty before it or when it was
    disabled), so a script that writes ``_amp_state.loss_scalers[0]._loss_scale`` after
    initialize sets the scale its next ``scale_loss`` uses.
    """

    @property
    def loss_scalers(self) -> list[_LossScaler]:
        amp = _amp
        if amp is None or not amp.enabled:
            return []
        return [_LossScaler(amp, scaler) for scaler in amp.scalers]


_amp_state = _AmpStateView()
