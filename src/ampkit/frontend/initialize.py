"""``initialize``: apex.amp's keywords resolved to a Policy, applied through ``ampkit.apply``."""

from __future__ import annotations

import logging
import warnings
from typing import Any, Optional, Union

import torch

from .. import _state
from .._checks import check_bool, check_int
from .._dtypes import FLOAT_DTYPES, HALF_DTYPES, autocast_default_dtype, resolve_dtype
from ..apply import ModelArg, OptimizerArg, check_models, check_optimizers, device_type_of, plan
from ..convert import conversion_of
from ..keep import Modules
from ..policy import OPT_LEVELS, Policy, get_policy

logger = logging.getLogger("ampkit")

# verbosity -> logging level of ampkit's messages (overflows, the chosen opt level).
# 2 is WARNING so the messages show without any logging configuration, like apex's prints.
_LEVELS = {0: logging.DEBUG, 1: logging.INFO, 2: logging.WARNING}


def initialize(models: ModelArg, optimizers: Optional[OptimizerArg] = None, enabled: bool = True,
               opt_level: str = "O1", cast_model_type: Optional[torch.dtype] = None,
               patch_torch_functions: Optional[bool] = None,
               keep_batchnorm_fp32: Union[bool, str, None] = None,
               master_weights: Optional[bool] = None, loss_scale: Union[float, str, None] = None,
               cast_model_outputs: Optional[torch.dtype] = None, num_losses: int = 1,
               verbosity: int = 1, min_loss_scale: Optional[float] = None,
               max_loss_scale: float = 2.0**24, *,
               half_dtype: Union[torch.dtype, str, None] = None,
               keep_fp32: Optional[Modules] = None) -> Any:
    """Prepare models and optimizers for an opt level, as ``apex.amp.initialize`` did.

    Everything is validated before any model or optimizer changes. A later call replaces
    this one's settings and loss scalers (scale_loss with this call's optimizers then
    warns); a model passed again loses this call's casts and hooks.

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
        keep_fp32: modules that run in fp32 and keep fp32 params, as
            :func:`ampkit.keep_fp32` selects them (None: each model's own selection).

    Returns:
        ``models`` when ``optimizers`` is None, else ``(models, optimizers)``: the same
        objects that were passed, modified in place.

    Example:
        >>> model, optimizer = initialize(model, optimizer, opt_level="O2")  # doctest: +SKIP
    """
    model_list = check_models(models)
    check_optimizers(optimizers)
    enabled = check_bool("enabled", enabled)
    level = _check_opt_level(opt_level)
    log_level = _LEVELS[min(check_int("verbosity", verbosity, 0), 2)]
    device_type = device_type_of(model_list)
    half = (autocast_default_dtype(device_type) if half_dtype is None
            else resolve_dtype(half_dtype, allowed=HALF_DTYPES, what="half_dtype"))
    policy = _resolve_policy(level, half, cast_model_type=cast_model_type,
                             patch_torch_functions=patch_torch_functions,
                             keep_batchnorm_fp32=keep_batchnorm_fp32,
                             master_weights=master_weights, loss_scale=loss_scale,
                             cast_model_outputs=cast_model_outputs)
    application = plan(policy, models, optimizers if enabled else None, num_losses=num_losses,
                       min_loss_scale=min_loss_scale, max_loss_scale=max_loss_scale,
                       explicit_outputs=cast_model_outputs is not None, keep_fp32=keep_fp32,
                       masters_of_half_params=_masters_of_half_params(level, policy,
                                                                      master_weights))
    if enabled and not application.master_weights:  # (masters: half params are fine)
        _warn_about_half_params(application.models, policy, level)
    # Nothing was modified above this line.
    if not enabled:
        _state.set_active(_state.ActiveAmp(device_type, None, enabled=False, opt_level=level))
        return models if optimizers is None else (models, optimizers)
    application.activate(log_level=log_level, opt_level=level)
    _warn_about_bf16_o3(level, policy)
    if application.master_weights:
        _warn_about_renormed_embeddings(application.models)
    logger.log(log_level, "ampkit.initialize: opt_level %s on %s, policy %s, %d loss scaler(s)",
               level, device_type, policy, len(application.scalers))
    return models if optimizers is None else (models, optimizers)


def _check_opt_level(opt_level: Any) -> str:
    if isinstance(opt_level, str) and opt_level in OPT_LEVELS:
        return opt_level
    text = str(opt_level).strip()
    digit = text[1:] if len(text) == 2 and text[0] in "0o" else text  # "02", "o2"
    hint = ""
    if digit in ("0", "1", "2", "3"):
        what = "a digit" if digit == text else "a zero" if text[0] == "0" else "a lower-case o"
        hint = f" ({what}: did you mean 'O{digit}', with the capital letter O?)"
    raise ValueError(f"unknown opt_level {opt_level!r}{hint}; valid: "
                     f"{', '.join(repr(level) for level in OPT_LEVELS)}")


def _warn_about_half_params(models: list[torch.nn.Module], policy: Policy, level: str) -> None:
    """apex's warning: a level with fp32 parameters given a model already cast to half
    trains it in pure half, without masters (initialize does not cast it back)."""
    if policy.param_dtype != torch.float32:
        return
    for model in models:
        if conversion_of(model) is not None:
            continue  # an earlier initialize's cast: undone before this one applies
        for name, param in model.named_parameters():
            if param.dtype in HALF_DTYPES:
                warnings.warn(
                    f"ampkit.initialize: parameter {name!r} is {param.dtype}, but opt_level "
                    f"{level} trains fp32 parameters; it stays {param.dtype}, without fp32 "
                    "master weights, so small updates are lost. You do not need to call "
                    ".half() (or .to(bfloat16)) on a model before initialize: pass the fp32 "
                    "model, and initialize casts what the level needs", UserWarning,
                    stacklevel=3)
                return


def _warn_about_bf16_o3(level: str, policy: Policy) -> None:
    if level == "O3" and policy.param_dtype == torch.bfloat16 and not policy.master_weights:
        warnings.warn(
            "ampkit.initialize: opt_level O3 here trains the whole model in bfloat16 without "
            "fp32 master weights, and bf16 keeps 8 bits of mantissa: updates smaller than about "
            "1/256 of a weight are lost, so small-learning-rate recipes that trained under "
            "apex's fp16 O3 can stall. Pass half_dtype=torch.float16 for apex's O3, or use "
            "opt_level='O2' for fp32 master weights", UserWarning, stacklevel=3)


def _warn_about_renormed_embeddings(models: list[torch.nn.Module]) -> None:
    """An Embedding with ``max_norm`` renormalises the rows it looks up in place, in the
    half weight; each step copies the fp32 masters over it, so the renorm never lasts and
    the masters, which ``state_dict`` saves, grow unbounded rows. One warning naming them
    all (per model where there are several)."""
    found = [(i, name, module) for i, model in enumerate(models)
             for name, module in model.named_modules()
             if isinstance(module, (torch.nn.Embedding, torch.nn.EmbeddingBag))
             and module.max_norm is not None and module.weight.dtype in HALF_DTYPES]
    if not found:
        return
    several = len(models) > 1

    def label(i: int, name: str) -> str:
        if several:
            return f"models[{i}]" + (f".{name}" if name else "")
        return name or "the model"

    named = ", ".join(f"{label(i, name)} ({type(module).__name__}, max_norm={module.max_norm})"
                      for i, name, module in found[:4])
    more = f" and {len(found) - 4} more" if len(found) > 4 else ""
    fix = ("ampkit.keep_fp32(model, [...]) on each model with these names, before initialize"
           if several else f"initialize(..., keep_fp32={[name for _, name, _ in found]!r})")
    warnings.warn(
        f"ampkit.initialize: {named}{more}: an embedding with max_norm renormalises rows of "
        "its half weight in place in the forward, and each step copies the fp32 master "
        "weights over them, so rows are never renormalised as in fp32 training (nor in the "
        f"state_dict). Keep them fp32: {fix}", UserWarning, stacklevel=3)


# --- initialize: the policy and the loss scalers -------------------------------------------
def _resolve_policy(level: str, half: torch.dtype, *, cast_model_type: Any,
                    patch_torch_functions: Any, keep_batchnorm_fp32: Any, master_weights: Any,
                    loss_scale: Any, cast_model_outputs: Any) -> Policy:
    """The opt level's policy in ``half``, with apex's keyword overrides applied."""
    policy = get_policy(level).with_half_dtype(half)
    changes: dict[str, Any] = {}
    if patch_torch_functions is not None:
        changes["autocast"] = check_bool("patch_torch_functions", patch_torch_functions)
    if cast_model_type is False:  # apex's "do not cast the model" (its own tests pass it)
        changes["param_dtype"] = torch.float32
    elif cast_model_type is not None:
        changes["param_dtype"] = resolve_dtype(cast_model_type, allowed=FLOAT_DTYPES,
                                               what="cast_model_type")
    use_autocast = changes.get("autocast", policy.autocast)
    param_dtype = changes.get("param_dtype", policy.param_dtype)
    if changes:  # autocast or param_dtype changed: compute is autocast's, else the params'
        changes["compute_dtype"] = half if use_autocast else param_dtype
    if param_dtype not in HALF_DTYPES:
        changes["master_weights"] = False  # fp32 params are their own masters (see below)
    elif master_weights is not None:
        changes["master_weights"] = check_bool("master_weights", master_weights)
    if keep_batchnorm_fp32 is not None:
        changes["keep_batchnorm_fp32"] = check_bool("keep_batchnorm_fp32", keep_batchnorm_fp32,
                                                     strings=True)
    if loss_scale is not None:
        changes["loss_scale"] = _numeric_string(loss_scale)
    if cast_model_outputs is not None:
        changes["output_dtype"] = resolve_dtype(cast_model_outputs, allowed=FLOAT_DTYPES,
                                                what="cast_model_outputs")
    return policy.replace(**changes) if changes else policy


def _masters_of_half_params(level: str, policy: Policy, master_weights: Any) -> bool:
    """Masters for half parameters the model already has, where the params stay fp32: apex
    made them for whatever half parameters the optimizer held when the level (O2 with
    ``cast_model_type=False``) or ``master_weights=True`` (O0, O1) asked for masters."""
    if policy.param_dtype in HALF_DTYPES:
        return False  # the policy's own masters decide
    wanted = get_policy(level).master_weights if master_weights is None else master_weights
    return check_bool("master_weights", wanted)


def _numeric_string(loss_scale: Any) -> Any:
    """apex accepted loss_scale from argparse, e.g. "128.0"; anything else goes to Policy."""
    if isinstance(loss_scale, str) and loss_scale != "dynamic":
        try:
            return float(loss_scale)
        except ValueError:
            pass
    return loss_scale
