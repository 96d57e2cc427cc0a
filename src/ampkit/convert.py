"""Casting a model for the opt levels: parameters to half, forward inputs/outputs, state dicts.

Everything here is attached with module hooks (never by replacing ``forward``), and all
of it is undone by :meth:`ConvertHandle.remove`, so a model can be initialized again
without stale casts. What the hooks do:

* forward pre-hook: cast floating inputs (nested in lists, tuples, dicts) to half, and/or
  enter ``ampkit.autocast`` (O1);
* forward hook (also run when forward raises): leave that autocast region and cast
  floating outputs (O1: fp32; O2: fp32 or ``cast_model_outputs``);
* state-dict hooks (half models): ``model.state_dict()`` holds fp32 tensors (the fp32
  master of a parameter when it has one, so a checkpoint resumes bitwise), and
  ``model.load_state_dict()`` writes the loaded fp32 values into the masters as well.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Collection, ContextManager, Optional

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from ._dtypes import HALF_DTYPES, cast_tensor, cast_tree
from ._torch_compat import (
    BatchNormBase,
    local_buffers,
    local_parameters,
    register_load_state_dict_pre_hook,
    register_state_dict_post_hook,
)
from .master import master_of

# apex kept batch-norm layers (and only those) in fp32 under O2; SyncBatchNorm is one too.
BATCHNORM_TYPES: tuple[type[nn.Module], ...] = (BatchNormBase,)
_HANDLE_ATTR = "_ampkit_convert_handle"


def cast_floating(obj: Any, dtype: torch.dtype) -> Any:
    """Cast every floating tensor in ``obj`` (nested lists, tuples, dicts) to ``dtype``.

    Other objects, integer tensors and tensors already in ``dtype`` pass through as they are.

    Example:
        >>> cast_floating({"x": [torch.ones(1)], "n": 3}, torch.float16)["x"][0].dtype
        torch.float16
    """
    return cast_tree(obj, dtype)


def cast_model(model: nn.Module, dtype: torch.dtype, *,
               keep_fp32: tuple[type[nn.Module], ...] = BATCHNORM_TYPES,
               keep_modules: Collection[nn.Module] = ()) -> nn.Module:
    """Cast floating parameters, gradients and buffers to ``dtype`` in place.

    Parameters keep their identity (an optimizer built on them still holds them).

    Args:
        model: the module to cast.
        dtype: the target floating dtype.
        keep_fp32: modules of these types keep their own parameters and buffers in fp32.
        keep_modules: these modules (``ampkit.keep_fp32``'s) keep theirs in fp32 too.

    Returns:
        ``model``.

    Example:
        >>> m = cast_model(nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2)), torch.float16)
        >>> m[0].weight.dtype, m[1].weight.dtype
        (torch.float16, torch.float32)
    """
    kept = {id(m) for m in keep_modules}
    with torch.no_grad():
        for module in model.modules():
            keep = isinstance(module, keep_fp32) or id(module) in kept
            target = torch.float32 if keep else dtype
            for param in module.parameters(recurse=False):
                if param.is_floating_point() and param.dtype != target:
                    param.data = param.data.to(target)
                    if param.grad is not None:
                        param.grad = param.grad.to(target)
            for name, buf in module.named_buffers(recurse=False):
                if buf is not None and buf.is_floating_point() and buf.dtype != target:
                    setattr(module, name, buf.to(target))
    return model


@dataclass(frozen=True)
class ForwardCasts:
    """What the forward hooks of one model do.

    Args:
        input_dtype: floating inputs are cast to this dtype (None: left as they are).
        output_dtype: floating outputs are cast to this dtype (None: left as they are).
        autocast: a factory of the autocast region forward runs in (None: no region).
    """

    input_dtype: Optional[torch.dtype] = None
    output_dtype: Optional[torch.dtype] = None
    autocast: Optional[Callable[[], ContextManager[Any]]] = None

    @property
    def active(self) -> bool:
        return any(v is not None for v in (self.input_dtype, self.output_dtype, self.autocast))


class ConvertHandle:
    """The hooks one conversion installed on a model; ``remove()`` takes them all off."""

    def __init__(self, model: nn.Module) -> None:
        self._model: Optional[weakref.ref] = weakref.ref(model)
        self.handles: list[RemovableHandle] = []

    def __getstate__(self) -> dict:
        # A weak reference does not pickle; an unpickled model finds its handle through
        # its own attribute (conversion_of), so the copy needs none.
        return {"_model": None, "handles": self.handles}

    def remove(self) -> None:
        """Remove every hook (the parameters keep the dtype they were cast to)."""
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        model = self._model() if self._model is not None else None
        if model is not None and getattr(model, _HANDLE_ATTR, None) is self:
            delattr(model, _HANDLE_ATTR)


def conversion_of(model: nn.Module) -> Optional[ConvertHandle]:
    """The handle of the conversion currently installed on ``model``, or None."""
    return getattr(model, _HANDLE_ATTR, None)


def remove_conversion(model: nn.Module) -> None:
    """Take off the hooks of an earlier conversion of ``model`` (no-op without one)."""
    handle = conversion_of(model)
    if handle is not None:
        handle.remove()
        if getattr(model, _HANDLE_ATTR, None) is handle:  # an unpickled copy's handle
            delattr(model, _HANDLE_ATTR)


def convert_model(model: nn.Module, *, param_dtype: torch.dtype = torch.float32,
                  keep_fp32: tuple[type[nn.Module], ...] = BATCHNORM_TYPES,
                  keep_modules: Collection[nn.Module] = (),
                  casts: ForwardCasts = ForwardCasts()) -> ConvertHandle:
    """Cast ``model`` to ``param_dtype`` and install its forward and state-dict hooks.

    An earlier conversion's hooks are removed first. Half models get the fp32 state-dict
    hooks; ``casts`` decides the forward hooks.

    Args:
        model: the module to convert.
        param_dtype: dtype of the parameters (fp32: left as they are).
        keep_fp32: module types that stay fp32 when ``param_dtype`` is half.
        keep_modules: modules that stay fp32 too (``ampkit.keep_fp32``'s selection).
        casts: the forward input/output casts and autocast region.

    Returns:
        A handle whose ``remove()`` takes every hook off again.

    Example:
        >>> m = nn.Linear(2, 2)
        >>> h = convert_model(m, param_dtype=torch.bfloat16,
        ...                   casts=ForwardCasts(torch.bfloat16, torch.float32))
        >>> m(torch.ones(1, 2)).dtype, m.state_dict()["weight"].dtype
        (torch.float32, torch.float32)
    """
    remove_conversion(model)
    handle = ConvertHandle(model)
    if param_dtype != torch.float32:
        cast_model(model, param_dtype, keep_fp32=keep_fp32, keep_modules=keep_modules)
    if param_dtype in HALF_DTYPES:
        handle.handles += _install_fp32_state_dict(model)
    if casts.active:
        handle.handles += _install_forward_casts(model, casts)
    setattr(model, _HANDLE_ATTR, handle)
    return handle


# --- forward hooks ------------------------------------------------------------------------
def _install_forward_casts(model: nn.Module, casts: ForwardCasts) -> list[RemovableHandle]:
    handles = []
    if casts.autocast is not None:
        handles += _install_autocast_region(model, casts.autocast)
    if casts.input_dtype is not None:
        handles.append(model.register_forward_pre_hook(_CastInputs(casts.input_dtype),
                                                       with_kwargs=True))
    if casts.output_dtype is not None:
        handles.append(model.register_forward_hook(_CastOutputs(casts.output_dtype)))
    return handles


# The hooks are small classes, not closures, so a converted model still pickles
# (torch.save(model), multiprocessing) as a plain one does.
class _CastInputs:
    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return cast_floating(args, self.dtype), cast_floating(kwargs, self.dtype) if kwargs else kwargs


class _CastOutputs:
    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def __call__(self, module: nn.Module, args: tuple, output: Any) -> Any:
        if output.__class__ is Tensor:  # the usual output, cast without the tree walk
            dtype = self.dtype
            return (cast_tensor(output, dtype) if output.is_floating_point() and output.dtype != dtype
                    else output)
        return cast_floating(output, self.dtype)


class _Region:
    """The autocast regions forward runs in: a stack per thread (recursion, threads)."""

    def __init__(self, factory: Callable[[], ContextManager[Any]]) -> None:
        self.factory = factory
        self._local = threading.local()

    def __getstate__(self) -> dict:
        return {"factory": self.factory}  # open regions belong to this process's threads

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["factory"])  # type: ignore[misc]

    def enter(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        region = self.factory()
        region.__enter__()
        local = self._local.__dict__
        if "stack" not in local:
            local["stack"] = []
        local["stack"].append(region)

    def leave(self, module: nn.Module, args: tuple, output: Any) -> None:
        stack = self._local.__dict__.get("stack")
        if stack:
            stack.pop().__exit__(None, None, None)


def _install_autocast_region(model: nn.Module,
                             factory: Callable[[], ContextManager[Any]]) -> list[RemovableHandle]:
    """Run ``model.forward`` inside a fresh autocast region, left even when forward raises."""
    region = _Region(factory)
    # First among the module's pre-hooks, so no other pre-hook can fail before the region
    # is entered; always_call, so the region is left when forward (or a later hook) raises.
    return [model.register_forward_pre_hook(region.enter, with_kwargs=True, prepend=True),
            model.register_forward_hook(region.leave, prepend=True, always_call=True)]


# --- state-dict hooks ---------------------------------------------------------------------
def _install_fp32_state_dict(model: nn.Module) -> list[RemovableHandle]:
    """Per-module hooks, so ``model.state_dict()`` and ``model.sub.state_dict()`` both work."""
    handles = []
    for module in model.modules():
        if not (local_parameters(module) or local_buffers(module)):
            continue
        handles.append(register_state_dict_post_hook(module, _save_fp32))
        handles.append(register_load_state_dict_pre_hook(module, _load_into_masters))
    return handles


def _save_fp32(module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict) -> None:
    for name, param in local_parameters(module).items():
        key = prefix + name
        if param is None or key not in state_dict:
            continue
        master = master_of(param)
        # The fp32 master, not the half parameter rounded from it: the exact training state.
        state_dict[key] = master.detach() if master is not None else _fp32(state_dict[key])
    for name, buf in local_buffers(module).items():
        key = prefix + name
        if buf is not None and key in state_dict:
            state_dict[key] = _fp32(state_dict[key])


def _fp32(tensor: Tensor) -> Tensor:
    return tensor.detach().float() if tensor.dtype in HALF_DTYPES else tensor


def _load_into_masters(module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict,
                       strict: bool, missing_keys: list, unexpected_keys: list,
                       error_msgs: list) -> None:
    # torch itself copies the value into the half parameter (rounding to nearest, the same
    # rounding as the master -> model copy after a step), so model == half(master) holds.
    with torch.no_grad():
        for name, param in local_parameters(module).items():
            value = state_dict.get(prefix + name)
            master = master_of(param) if param is not None else None
            if master is not None and isinstance(value, Tensor) and value.shape == master.shape:
                master.copy_(value)
