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
import types
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional, Sequence, Union

import torch
from torch import Tensor, nn

from . import _state
from ._dtypes import FLOAT_DTYPES, HALF_DTYPES, autocast_default_dtype, default_device_type, resolve_dtype
from .autocast import autocast
from .convert import BATCHNORM_TYPES, ForwardCasts, conversion_of, convert_model
from .master import MasterWeights, attach_master_weights, master_of, master_weights_of, release_masters
from .policy import OPT_LEVELS, Policy, get_policy
from .scaler import GradScaler, unscale_grads_

logger = logging.getLogger("ampkit")

# verbosity -> logging level of ampkit's messages (overflows, the chosen opt level).
# 2 is WARNING so the messages show without any logging configuration, like apex's prints.
_LEVELS = {0: logging.DEBUG, 1: logging.INFO, 2: logging.WARNING}
_OPT_ATTR = "_ampkit_amp"
_DYNAMIC_INIT_SCALE = 2.0**16  # apex's first dynamic scale
_GROWTH_INTERVAL = 2000  # apex's clean steps before the scale doubles
ModelArg = Union[nn.Module, Sequence[nn.Module]]
OptimizerArg = Union[torch.optim.Optimizer, Sequence[torch.optim.Optimizer]]


@dataclass
class _OptimizerAmp:
    """What ``scale_loss`` tracks per optimizer (kept on the optimizer itself)."""

    skip_next: bool = False  # an overflow: the next step() is a no-op
    # Fused optimizers: the overflow flag stays on the device and the fused kernel skips
    # the update itself, so scale_loss needs no host sync.
    found_inf: Optional[Tensor] = None
    grads_unscaled: bool = False  # .grad holds unscaled values (a non-delayed scale_loss ran)
    stash: Optional[list[Optional[Tensor]]] = None  # those values, set aside during a backward


@dataclass
class _AmpState:
    """The active initialize: its policy, loss scalers and log level."""

    enabled: bool
    policy: Optional[Policy] = None
    scalers: list[GradScaler] = field(default_factory=list)
    log_level: int = logging.INFO

    @property
    def dynamic(self) -> bool:
        return self.policy is not None and self.policy.dynamic_loss_scale

    @property
    def scaling(self) -> bool:
        """False when the loss scale is a fixed 1.0: scale_loss has nothing to do."""
        return self.policy is not None and self.policy.loss_scale != 1.0


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
    # Nothing was modified above this line.
    global _amp
    if not enabled:
        _amp = _AmpState(enabled=False)
        _state.set_active(None)
    else:
        _amp = _AmpState(True, policy, scalers, log_level)
        _state.set_active(_state.ActiveAmp(device_type, policy.half_dtype))
        _apply(policy, model_list, opt_list, device_type, cast_model_outputs is not None)
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
        if policy.master_weights:
            _seed_masters(attach_master_weights(optimizer), fp32_values)
        _install_step_guard(optimizer)


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


def _install_step_guard(optimizer: torch.optim.Optimizer) -> None:
    """Wrap step/zero_grad so an overflow found by scale_loss makes the next step a no-op."""
    amp_state = _OptimizerAmp()
    setattr(optimizer, _OPT_ATTR, amp_state)
    step, zero_grad = optimizer.step, optimizer.zero_grad

    def guarded_step(self: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        if amp_state.skip_next:
            # The overflowing step: params, masters and optimizer state stay as they are;
            # the inf/NaN grads are dropped so they do not leak into the next iteration.
            amp_state.skip_next = False
            self.zero_grad(set_to_none=True)
            return None
        if amp_state.found_inf is not None:
            return _fused_step(self, step, amp_state, args, kwargs)
        return step(*args, **kwargs)

    def guarded_zero_grad(self: torch.optim.Optimizer, set_to_none: bool = True) -> None:
        zero_grad(set_to_none=set_to_none)
        amp_state.grads_unscaled = False
        amp_state.stash = None

    # Bound methods, as LRScheduler re-wraps ``optimizer.step.__func__``.
    optimizer.step = types.MethodType(guarded_step, optimizer)  # type: ignore[method-assign]
    optimizer.zero_grad = types.MethodType(guarded_zero_grad, optimizer)  # type: ignore[method-assign]


def _fused_step(optimizer: torch.optim.Optimizer, step: Any, amp_state: _OptimizerAmp,
                args: tuple, kwargs: dict) -> Any:
    """Step a fused optimizer that reads found_inf on the device (as torch's GradScaler does).

    The grads are unscaled already (grad_scale None); a non-zero found_inf makes the fused
    kernel leave params and state untouched, including the step count.
    """
    found_inf, amp_state.found_inf = amp_state.found_inf, None
    optimizer.grad_scale, optimizer.found_inf = None, found_inf  # type: ignore[attr-defined]
    try:
        return step(*args, **kwargs)
    finally:
        del optimizer.grad_scale, optimizer.found_inf  # type: ignore[attr-defined]


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
        if hasattr(optimizer, _OPT_ATTR) or master_weights_of(optimizer) is not None:
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
    for model in models:
        for param in model.parameters():
            return param.device.type
    return default_device_type()


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

    On exit (unless ``delay_unscale``): each optimizer's gradients (the fp32 masters' under
    O2) are unscaled and checked for inf/NaN, loss scaler ``loss_id`` is updated and, after
    an overflow, the next ``step()`` of exactly these optimizers does nothing (their
    params, masters and state stay as they are; their grads are dropped). Several
    scale_loss calls before one step accumulate: each unscales its own backward's grads.

    Host syncs: none when every optimizer is fused (``fused=True`` Adam/AdamW/SGD: the
    overflow flag stays on the device and the fused kernel skips the update, as with
    torch's GradScaler) unless the ``ampkit`` logger is enabled at the overflow message's
    level; otherwise one per call with a dynamic scale (reading the overflow flag, as apex
    did); none with a fixed scale or ``delay_overflow_check``. A skipped fused step keeps
    its (inf/NaN) grads until the next ``zero_grad``.

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
    if not amp.scaling:  # a fixed scale of 1.0: nothing to unscale, nothing to check
        yield loss.float()
        return
    scaler = amp.scalers[loss_id]
    scaled = scaler.scale(loss.float())
    inv_scale = scaler._inverse_scale()
    masters_unscaled = [_prepare(opt, inv_scale, stash=not delay_unscale) for opt in opts]
    try:
        yield scaled
    except BaseException:
        for opt in opts:
            _restore_stash(opt)
        raise
    if delay_unscale:
        return
    found_inf = torch.zeros((), dtype=torch.float32, device=inv_scale.device)
    for opt, unscaled in zip(opts, masters_unscaled):
        _unscale(opt, inv_scale, found_inf, unscaled)
    if amp.dynamic and not delay_overflow_check:
        _update(scaler, found_inf, opts, loss_id, amp.log_level)


def _prepare(optimizer: torch.optim.Optimizer, inv_scale: Tensor, stash: bool) -> bool:
    """Before a backward: keep grads that an earlier scale_loss unscaled apart from new ones.

    Returns whether the optimizer's masters hold unscaled grads already.
    """
    amp_state: _OptimizerAmp = getattr(optimizer, _OPT_ATTR)
    masters = master_weights_of(optimizer)
    masters_unscaled = masters is not None and masters.grads_unscaled
    if masters_unscaled:
        # The grad hooks unscale this backward's grads by this loss's scale as they arrive.
        masters.note_unscaled(inv_scale)
    if stash and amp_state.grads_unscaled:
        own = _own_params(optimizer)
        grads = [p.grad for p in own]
        if any(g is not None for g in grads):
            amp_state.stash = grads
            for p in own:
                p.grad = None
    return masters_unscaled


def _unscale(optimizer: torch.optim.Optimizer, inv_scale: Tensor, found_inf: Tensor,
             masters_unscaled: bool) -> None:
    amp_state: _OptimizerAmp = getattr(optimizer, _OPT_ATTR)
    masters = master_weights_of(optimizer)
    if masters is not None:
        masters.sync_grads()
    if masters is not None and masters_unscaled:
        own = [p.grad for p in _own_params(optimizer) if p.grad is not None]
        _unscale_grads(own, inv_scale, found_inf)
        # Unscaled already as they arrived: only checked for inf/NaN (multiplied by 1).
        _unscale_grads(masters.master_grads(), torch.ones_like(inv_scale), found_inf)
    else:
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        _unscale_grads(grads, inv_scale, found_inf)
    if masters is not None:
        masters.note_unscaled(inv_scale)
    if amp_state.stash is not None:
        _add_stash(_own_params(optimizer), amp_state.stash)
        amp_state.stash = None
    amp_state.grads_unscaled = True


def _unscale_grads(grads: list[Tensor], inv_scale: Tensor, found_inf: Tensor) -> None:
    if grads:
        unscale_grads_(grads, inv_scale, found_inf)


def _own_params(optimizer: torch.optim.Optimizer) -> list[Tensor]:
    """The parameters an optimizer steps that are not fp32 masters (their grads live in .grad)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    masters = master_weights_of(optimizer)
    if masters is None:
        return params
    master_ids = {id(m) for m in masters.master_params}
    return [p for p in params if id(p) not in master_ids]


@torch.no_grad()
def _add_stash(params: list[Tensor], stash: list[Optional[Tensor]]) -> None:
    pairs = [(p, old) for p, old in zip(params, stash) if old is not None]
    summed = [(p.grad, old) for p, old in pairs if p.grad is not None]
    if summed:
        torch._foreach_add_([g for g, _ in summed], [old for _, old in summed])
    for p, old in pairs:
        if p.grad is None:
            p.grad = old


def _restore_stash(optimizer: torch.optim.Optimizer) -> None:
    """The body raised: put the grads set aside by _prepare back (partial new ones dropped)."""
    amp_state: _OptimizerAmp = getattr(optimizer, _OPT_ATTR)
    if amp_state.stash is not None:
        for p, old in zip(_own_params(optimizer), amp_state.stash):
            p.grad = old
        amp_state.stash = None


def _update(scaler: GradScaler, found_inf: Tensor, optimizers: list[torch.optim.Optimizer],
            loss_id: int, log_level: int) -> None:
    scaler._apply_update(found_inf)
    if all(getattr(opt, "_step_supports_amp_scaling", False) for opt in optimizers):
        # Fused optimizers skip on the device: no host sync unless the log wants the answer.
        for optimizer in optimizers:
            _hold_found_inf(getattr(optimizer, _OPT_ATTR), found_inf)
        if not (logger.isEnabledFor(log_level) and found_inf.item()):
            return
    else:
        # The one host sync of scale_loss with plain optimizers (apex had it too): Python
        # must know now whether the next optimizer.step() runs.
        if not found_inf.item():
            return
        for optimizer in optimizers:
            getattr(optimizer, _OPT_ATTR).skip_next = True
    if logger.isEnabledFor(log_level):
        names = ", ".join(type(opt).__name__ for opt in optimizers)
        logger.log(log_level, "Gradient overflow: skipping the next step() of %s; loss scaler %d "
                   "now at %g", names, loss_id, scaler.get_scale())


def _hold_found_inf(amp_state: _OptimizerAmp, found_inf: Tensor) -> None:
    """Keep the overflow flag for the next fused step (several losses: any overflow skips)."""
    flag = found_inf.detach().reshape(())
    held = amp_state.found_inf
    amp_state.found_inf = flag.clone() if held is None else torch.maximum(held, flag.to(held.device))


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
        if not hasattr(opt, _OPT_ATTR):
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
