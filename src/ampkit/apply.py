"""The one seam: apply a :class:`~ampkit.policy.Policy` to models and optimizers.

``initialize`` (apex's keywords), ``ampkit bench`` and ``ampkit train`` all come here:
:func:`plan` validates everything and decides the loss scalers without changing
anything; :meth:`Plan.apply` then converts the models (``convert.py``: parameter dtype,
forward casts, fp32 state dicts) and prepares the optimizers (``optim.py``: one wrapper,
fp32 masters under master-weight policies). :func:`apply_policy` does both.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union

import torch
from torch import Tensor, nn
from torch.nn.parameter import is_lazy

from . import _state
from ._checks import as_list, check_bool, check_int, check_positive
from ._select import as_selectors
from ._sharding import is_sharded
from ._dtypes import HALF_DTYPES, default_device_type
from ._torch_compat import local_buffers
from .autocast import region_factory
from . import keep
from .convert import BATCHNORM_TYPES, ForwardCasts, conversion_of, convert_model
from ._declared import warn_declared_fp32
from ._tables import warn_buffer_tables
from .master import ONE_MASTER_RULE, MasterWeights, master_of, release_masters
from .optim import as_optimizers, stash_of, wrap
from .policy import Policy, get_policy
from .scaler import FP16_GRAD_MIN_SCALE, GradScaler

ModelArg = Union[nn.Module, Sequence[nn.Module]]
OptimizerArg = Union[torch.optim.Optimizer, Sequence[torch.optim.Optimizer]]
_DYNAMIC_INIT_SCALE = 2.0**16  # apex's first dynamic scale
_GROWTH_INTERVAL = 2000  # apex's clean steps before the scale doubles


@dataclass(eq=False)
class Plan:
    """A validated policy application: what :meth:`apply` will do, nothing done yet.

    Attributes:
        policy: the policy to apply.
        models, optimizers: what it applies to.
        device_type: the models' device type.
        scalers: one loss scaler per loss, as the policy's loss scaling says.
        explicit_outputs: floating outputs are cast to ``policy.output_dtype`` even where
            the policy alone would not cast them (apex's ``cast_model_outputs``).
        keep_fp32: per model, the module names ``keep_fp32`` selected (None: leave each
            model's own earlier ``ampkit.keep_fp32`` selection as it is).
        master_weights: the optimizers step fp32 masters of their half parameters: the
            policy's ``master_weights``, or (apex's ``cast_model_type=False`` under O2)
            masters of half parameters the model already had while its own stay fp32.
    """

    policy: Policy
    models: list[nn.Module]
    optimizers: list[torch.optim.Optimizer]
    device_type: str
    scalers: list[GradScaler]
    explicit_outputs: bool = False
    keep_fp32: Optional[list[list[str]]] = None
    master_weights: bool = False

    def apply(self) -> "Plan":
        """Convert the models and prepare the optimizers; returns self."""
        _apply(self)
        return self

    def activate(self, *, log_level: int = logging.INFO,
                 opt_level: Optional[str] = None) -> "Plan":
        """Make this plan the active amp state, then :meth:`apply` it; returns self.

        What ``initialize`` does once everything is checked, and ``TuneResult.apply``
        too (one path, so the two configure a policy alike): ``scale_loss`` then uses
        this plan's loss scalers, ``autocast`` its device and half dtype. Like a second
        ``initialize``, it replaces the active state whole (an earlier one's scalers).
        """
        policy = self.policy
        active = _state.ActiveAmp(self.device_type, policy.half_dtype, policy=policy,
                                  scalers=self.scalers, log_level=log_level,
                                  scaling=policy.loss_scaling.kind != "none",
                                  fixed_unskipped=([] if policy.dynamic_loss_scale
                                                   else [0] * len(self.scalers)),
                                  opt_level=opt_level)
        _state.set_active(active)
        self.apply()
        for optimizer in self.optimizers:
            stash_of(optimizer).prepared_by = active  # scale_loss tells a replaced one
        return self


def plan(policy: Union[Policy, str], models: ModelArg, optimizers: Optional[OptimizerArg] = None,
         *, num_losses: int = 1, min_loss_scale: Optional[float] = None,
         max_loss_scale: Optional[float] = 2.0**24, explicit_outputs: bool = False,
         keep_fp32: Optional[keep.Modules] = None,
         masters_of_half_params: bool = False) -> Plan:
    """Validate an application of ``policy`` and decide its loss scalers; changes nothing.

    ``keep_fp32``: modules to run in fp32 (see :func:`ampkit.keep_fp32`), selected in
    every model; a name or pattern must match a module in at least one of them.
    ``masters_of_half_params``: fp32 masters for the half parameters a model already has
    even where the policy keeps parameters fp32 (apex made masters of whatever half
    parameters its optimizer held).
    """
    policy = get_policy(policy)
    model_list = check_models(models)
    opt_list = check_optimizers(optimizers)
    count = check_int("num_losses", num_losses, 1)
    device_type = device_type_of(model_list)
    scalers = make_scalers(policy, count, device_type, min_loss_scale, max_loss_scale)
    masters = policy.master_weights or check_bool("masters_of_half_params", masters_of_half_params)
    check_params(model_list, opt_list, masters, only_half=not policy.master_weights)
    kept = None if keep_fp32 is None else _select_kept(model_list, keep_fp32)
    if policy.param_dtype in HALF_DTYPES:  # the selection decides which parameters stay fp32
        for model, names in zip(model_list, kept or [keep.kept_names(m) for m in model_list]):
            keep.check_shared(model, names, policy.param_dtype)
            warn_declared_fp32(model, names, policy.param_dtype)
            warn_buffer_tables(model, names, policy.param_dtype)
    return Plan(policy, model_list, opt_list, device_type, scalers, explicit_outputs, kept,
                masters)


def _select_kept(models: list[nn.Module], modules: keep.Modules) -> list[list[str]]:
    """Each model's selection; a name or pattern must match in one model at least."""
    for selector in as_selectors(modules):
        if isinstance(selector, str) and not any(
                keep.select(model, selector, strict=False) for model in models):
            keep.select(models[0], selector)  # raises, naming the pattern and real names
    selections = [keep.select(model, modules, strict=False) for model in models]
    for model, names in zip(models, selections):
        keep.check_not_fp8(model, names, caller="keep_fp32= argument")
    return selections


def apply_policy(policy: Union[Policy, str], models: ModelArg,
                 optimizers: Optional[OptimizerArg] = None, **kwargs: Any) -> Plan:
    """Apply ``policy`` to models and optimizers (validated first: a refusal changes nothing).

    Example:
        >>> handle = apply_policy("O2", model, optimizer)  # doctest: +SKIP
        >>> handle.scalers[0].get_scale()  # doctest: +SKIP
        65536.0
    """
    return plan(policy, models, optimizers, **kwargs).apply()


# --- validation ----------------------------------------------------------------------------
def check_models(models: Any) -> list[nn.Module]:
    model_list = as_list(models, "models", nn.Module, "torch.nn.Module")
    if not model_list:
        raise ValueError("models is an empty list; pass a torch.nn.Module or a list of them")
    for i, model in enumerate(model_list):
        if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            raise TypeError(f"models[{i}] is wrapped in {type(model).__name__}; pass the bare "
                            f"module (valid: a torch.nn.Module not wrapped in "
                            f"DistributedDataParallel/DataParallel) and wrap it in "
                            f"DistributedDataParallel after initialize (nn.DataParallel's "
                            f"replicas are not supported)")
        if is_sharded(model):
            raise TypeError(f"models[{i}] ({type(model).__name__}) is already sharded (FSDP2 "
                            "fully_shard, DTensor parameters), which initialize cannot cast or "
                            "wrap; valid: apply the policy while sharding, with "
                            "ampkit.distributed.shard(model, policy) instead of initialize")
    return model_list


def check_optimizers(optimizers: Any) -> list[torch.optim.Optimizer]:
    if optimizers is None:
        return []
    opt_list = as_optimizers(optimizers, "optimizers")
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


def device_type_of(models: list[nn.Module]) -> str:
    """The device type of the first parameter (a meta model is refused)."""
    for i, model in enumerate(models):
        for name, param in model.named_parameters():
            if param.device.type == "meta":
                raise ValueError(
                    f"models[{i}] has parameter {name!r} on the meta device (no data to train "
                    "or cast); valid: a model with real storage, e.g. materialize it first with "
                    "model.to_empty(device=...) and initialize its weights")
            return param.device.type
    return default_device_type()


def check_params(models: list[nn.Module], optimizers: list[torch.optim.Optimizer],
                 master_weights: bool, *, only_half: bool = False) -> None:
    """Each optimizer steps some of the models' parameters, in non-empty groups, and under
    master weights no parameter is stepped by two optimizers (one master per parameter;
    ``only_half``: the masters are of the parameters that are half already).
    """
    if master_weights:
        for i, model in enumerate(models):
            lazy = next((n for n, p in model.named_parameters() if is_lazy(p)), None)
            if lazy is not None:
                raise ValueError(
                    f"models[{i}] has parameter {lazy!r} not yet materialized (a lazy module, "
                    "nn.LazyLinear and the like): its fp32 master needs its shape and values; "
                    "valid: run one forward (a batch of the real shape) before "
                    "ampkit.initialize")
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
            if first != i and master_weights and (not only_half or p.dtype in HALF_DTYPES):
                raise ValueError(
                    f"a parameter of shape {tuple(p.shape)} is in optimizers[{first}] and "
                    f"optimizers[{i}]; {ONE_MASTER_RULE}; valid: each parameter in one "
                    "optimizer")


# --- loss scaling: the policy decides, a GradScaler carries it out -------------------------
def make_scalers(policy: Policy, count: int, device_type: str, min_loss_scale: Any = None,
                 max_loss_scale: Any = 2.0**24) -> list[GradScaler]:
    """One loss scaler per loss, as ``policy.loss_scaling`` says.

    Dynamic: apex's schedule (2**16, doubling after 2000 clean steps, up to
    ``max_loss_scale``), floored at ``min_loss_scale`` — 1.0 by default when the model's
    own gradients are fp16. Static and none: a scaler that only holds the fixed scale;
    the front end never updates it (apex's static scale never skips a step).
    """
    low = check_positive("min_loss_scale", min_loss_scale, allow_none=True)
    high = check_positive("max_loss_scale", max_loss_scale)
    if low is not None and high is not None and low > high:
        raise ValueError(f"min_loss_scale={min_loss_scale!r} is greater than "
                         f"max_loss_scale={max_loss_scale!r}; valid: min_loss_scale <= max_loss_scale")
    scaling = policy.loss_scaling
    if not scaling.dynamic:
        return [GradScaler(device_type, init_scale=scaling.scale) for _ in range(count)]
    if low is None and policy.param_dtype == torch.float16:
        # The model's own gradients are fp16: below a scale of 1 every step flushes more of
        # them to zero (at the fp32 floor all of them) instead of skipping; Megatron's and
        # DeepSpeed's fp16 floor too. Gradients beyond fp16's range even unscaled need
        # min_loss_scale below 1, which the floor's warning names.
        low = FP16_GRAD_MIN_SCALE
    return [GradScaler(device_type, init_scale=_DYNAMIC_INIT_SCALE, growth_interval=_GROWTH_INTERVAL,
                       min_scale=low, max_scale=high) for _ in range(count)]


def loop_scaler(policy: Policy, device_type: str) -> GradScaler:
    """The GradScaler a torch-style loop (``scale``/``step``/``update``) uses for ``policy``.

    None: disabled (every method a no-op). Dynamic: :func:`make_scalers`'s. Static: the
    fixed scale, pinned by equal bounds; torch's GradScaler contract checks every step, so
    here an overflowing step is still skipped (scale_loss's static scale, apex's, is not).
    """
    scaling = policy.loss_scaling
    if scaling.kind == "none":
        return GradScaler(device_type, enabled=False)
    if scaling.kind == "static":
        return GradScaler(device_type, init_scale=scaling.scale, min_scale=scaling.scale,
                          max_scale=scaling.scale)
    return make_scalers(policy, 1, device_type)[0]


# --- applying ---------------------------------------------------------------------------------
def _apply(p: Plan) -> None:
    policy = p.policy
    params = [param for model in p.models for param in model.parameters()]
    # An earlier initialize's masters of these parameters would keep taking their grads;
    # their fp32 values seed the new masters (the half params are rounded from them).
    earlier = {id(param): m for param in params if (m := master_of(param)) is not None}
    release_masters(params)
    casts = _forward_casts(policy, p.device_type, p.explicit_outputs)
    keep_types = BATCHNORM_TYPES if policy.keep_batchnorm_fp32 else ()
    for model in p.models:
        if conversion_of(model) is not None:
            _restore_fp32(model, earlier)
    if p.keep_fp32 is not None:
        for model, names in zip(p.models, p.keep_fp32):
            keep.install(model, names)
    # The fp32 values before the cast (references to their storage, no copies): the new
    # masters start from them, not from the half values rounded from them.
    fp32_values = {id(param): param.data for param in params if param.dtype == torch.float32}
    for model in p.models:
        # A kept root runs the whole forward in fp32 under its own hooks: no casts around it.
        root_kept = "" in keep.kept_names(model)
        convert_model(model, param_dtype=policy.param_dtype, keep_fp32=keep_types,
                      keep_modules=keep.kept_modules(model),
                      casts=ForwardCasts() if root_kept else casts)
        keep.follow_conversion(model)  # the half dtype its kept modules' outputs go back to
    names = _param_names(p.models)
    for optimizer in p.optimizers:
        masters = wrap(optimizer, master_weights=p.master_weights).masters
        if masters is not None:
            _seed_masters(masters, fp32_values)
            masters.name_params(names)


def _param_names(models: Sequence[nn.Module]) -> dict[int, str]:
    """``id(param) -> name`` over the models (``models[i].`` before the name with several)."""
    names: dict[int, str] = {}
    for i, model in enumerate(models):
        prefix = f"models[{i}]." if len(models) > 1 else ""
        for name, param in model.named_parameters():
            names.setdefault(id(param), prefix + name)
    return names


@torch.no_grad()
def _restore_fp32(model: nn.Module, earlier: dict[int, Tensor]) -> None:
    """Undo an earlier initialize's cast: params back to fp32 (their masters' values when
    they had masters, so nothing is lost) and half buffers back to fp32, in place, so the
    new policy starts from the fp32 model the earlier call was given.
    """
    for param in model.parameters():
        if param.dtype in HALF_DTYPES:
            master = earlier.get(id(param))
            param.data = master.detach().clone() if master is not None else param.data.float()
    for module in model.modules():
        buffers = local_buffers(module)
        for name, buffer in buffers.items():
            if buffer is not None and buffer.dtype in HALF_DTYPES:
                buffers[name] = buffer.float()


@torch.no_grad()
def _seed_masters(masters: MasterWeights, earlier: dict[int, Tensor]) -> None:
    for param, master in zip(masters.model_params, masters.master_params):
        previous = earlier.get(id(param))
        if previous is not None and previous.shape == master.shape:
            master.copy_(previous)


def _forward_casts(policy: Policy, device_type: str, explicit_outputs: bool) -> ForwardCasts:
    region = region_factory(device_type, policy.compute_dtype) if policy.autocast else None
    return ForwardCasts(input_dtype=policy.input_dtype,
                        output_dtype=policy.cast_outputs_to(explicit_outputs),
                        autocast=region)
