"""Casting a model for the opt levels: parameters to half, forward inputs/outputs, state dicts.

All of it is undone by :meth:`ConvertHandle.remove`, so a model can be initialized again
without stale casts. What a conversion installs:

* ``model.forward``, in the model's own ``__dict__``: the forward it had, with its floating
  inputs (nested in lists, tuples, dicts, dataclass instances) cast to half and/or inside an
  ``ampkit.autocast`` region (O1, left even when forward raises), and its floating outputs
  cast (O1: fp32; O2: fp32 or ``cast_model_outputs``). One Python frame, not module
  hooks: torch runs a module that has any forward hook through its slow call path, which
  cost more host time per call (about 20 us on a CPU) than the casts and the region
  together. It is shaped like a bound method (``__func__``, ``__self__``, ``__wrapped__``
  for ``inspect.signature``), so code that wraps ``model.forward`` again keeps the casts;
* state-dict hooks (half models; ``_state_dict_hooks.py``): ``model.state_dict()`` holds
  fp32 tensors (the fp32 master of a parameter when it has one, so a checkpoint resumes
  bitwise), and ``model.load_state_dict()`` writes the loaded fp32 values into the
  masters as well.
"""

from __future__ import annotations

import inspect
import types
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Collection, Optional

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from ._dtypes import HALF_DTYPES, cast_tensor, cast_tree
from ._torch_compat import AfterApply, BatchNormBase, local_modules, local_parameters
from . import _state_dict_hooks
from ._state_dict_hooks import Hooks

# apex kept batch-norm layers (and only those) in fp32 under O2; SyncBatchNorm is one too.
BATCHNORM_TYPES: tuple[type[nn.Module], ...] = (BatchNormBase,)
_HANDLE_ATTR = "_ampkit_convert_handle"
# The state-dict hooks by the names they had here: models pickled before they moved.
_save_fp32 = _state_dict_hooks._save_fp32
_refuse_assign = _state_dict_hooks._refuse_assign
_load_into_masters = _state_dict_hooks._load_into_masters
_after_load = _state_dict_hooks._after_load


def cast_floating(obj: Any, dtype: torch.dtype) -> Any:
    """Cast every floating tensor in ``obj`` (nested lists, tuples, dicts, dataclass
    instances, rebuilt: see :func:`ampkit._dtypes.cast_tree`) to ``dtype``.

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
            fp32_buffers = module.FP32_BUFFERS if isinstance(module, AfterApply) else ()
            for name, buf in module.named_buffers(recurse=False):
                if (buf is not None and buf.is_floating_point() and buf.dtype != target
                        and name not in fp32_buffers):  # fp8 amax histories stay fp32
                    setattr(module, name, buf.to(target))
            if isinstance(module, AfterApply):  # as after .half()
                module.after_apply()
    return model


@dataclass(frozen=True)
class ForwardCasts:
    """What the converted forward of one model does.

    Args:
        input_dtype: floating inputs are cast to this dtype (None: left as they are).
        output_dtype: floating outputs are cast to this dtype (None: left as they are).
        autocast: a factory of the autocast region forward runs in, whose regions
            ``run(func, *args)`` (:func:`ampkit.autocast.region_factory`; None: no region).
    """

    input_dtype: Optional[torch.dtype] = None
    output_dtype: Optional[torch.dtype] = None
    autocast: Optional[Callable[..., Any]] = None

    @property
    def active(self) -> bool:
        return any(v is not None for v in (self.input_dtype, self.output_dtype, self.autocast))


class ConvertHandle:
    """What one conversion installed on a model; ``remove()`` takes it all off.

    ``casts``: what the converted forward does (None once removed); ``inner_forward``:
    the model's own ``forward`` attribute before the conversion (None: its class's);
    ``cast_at``: (module, attribute) of one parameter the conversion cast to half (None:
    none was); ``cast_param`` is what that attribute holds now, whose dtype tells the
    forward when the user cast the model again (``.float()``) or calls it with other
    tensors in its place (``torch.func.functional_call`` with the fp32 state dict).
    """

    # (the module weakly, the attribute, the module's parameter dict): read as a dict, so
    # a parametrization added since is not evaluated for it at every forward.
    _cast_at: Optional[tuple["weakref.ref[nn.Module]", str, dict]] = None
    _cast_path: Optional[str] = None  # "module.path:attribute", from a pickle, not resolved yet
    _legacy_param: Optional[Tensor] = None  # class defaults: handles pickled before these
    param_dtype: torch.dtype = torch.float32

    def __init__(self, model: nn.Module) -> None:
        self._model: Optional[weakref.ref] = weakref.ref(model)
        self.hooks = Hooks()  # the fp32 state-dict hooks (half models)
        self.casts: Optional[ForwardCasts] = None
        self.inner_forward: Optional[Callable[..., Any]] = None
        self._cast_at = None
        self.param_dtype = torch.float32  # what the conversion cast the parameters to

    @property
    def cast_at(self) -> Optional[tuple[nn.Module, str]]:
        module = self._cast_at[0]() if self._cast_at is not None else None
        return None if module is None else (module, self._cast_at[1])

    @cast_at.setter
    def cast_at(self, at: Optional[tuple[nn.Module, str]]) -> None:
        # Weakly: the module may be the model, which holds this handle.
        self._cast_at = (None if at is None else
                         (weakref.ref(at[0]), at[1], local_parameters(at[0])))

    @property
    def cast_param(self) -> Optional[Tensor]:
        return _cast_param(self, self._cast_at)

    def resolve(self, model: nn.Module) -> None:
        """After unpickling: find the remembered parameter in ``model`` by its path."""
        where, _, name = (self._cast_path or "").rpartition(":")
        self._cast_path = None
        self._model = weakref.ref(model)
        try:
            self.cast_at = (model.get_submodule(where), name)
        except AttributeError:  # the model changed since: inputs follow the policy
            self._cast_at = None

    @property
    def handles(self) -> list[RemovableHandle]:
        """The state-dict hooks' handles (empty once removed)."""
        return self.hooks.handles

    def __setstate__(self, state: dict) -> None:
        # A handle pickled before cast_at held the parameter itself, one pickled before
        # _cast_path the (module, name) pair, one before Hooks its hooks' handles.
        self._legacy_param = state.pop("cast_param", None)
        at = state.pop("cast_at", None)
        legacy = state.pop("handles", None)
        self.__dict__.update(state)
        if at is not None:
            self.cast_at = at
        if "hooks" not in state:
            self.hooks = Hooks(legacy or [])

    def __getstate__(self) -> dict:
        # A weak reference does not pickle; an unpickled model finds its handle through
        # its own attribute (conversion_of), so the copy needs none. The parameter goes by
        # its path in the model: a submodule pickled alone must not carry another's.
        model = self._model() if self._model is not None else None
        at, path = self.cast_at, self._cast_path
        if at is not None and model is not None:
            path = next((f"{name}:{at[1]}" for name, m in model.named_modules() if m is at[0]),
                        None)
        return {"_model": None, "hooks": self.hooks, "casts": self.casts,
                "inner_forward": self.inner_forward, "_cast_path": path,
                "param_dtype": self.param_dtype}

    def remove(self) -> None:
        """Remove every hook and the converted forward (the parameters keep their dtype)."""
        model = self._model() if self._model is not None else None
        self.hooks.remove(model)
        if model is not None:
            _restore_forward(model, self)
            if getattr(model, _HANDLE_ATTR, None) is self:
                delattr(model, _HANDLE_ATTR)
        self.casts = None


def conversion_of(model: nn.Module) -> Optional[ConvertHandle]:
    """The handle of the conversion currently installed on ``model``, or None."""
    return getattr(model, _HANDLE_ATTR, None)


def remove_conversion(model: nn.Module) -> None:
    """Take off an earlier conversion of ``model`` (no-op without one)."""
    handle = conversion_of(model)
    if handle is not None:
        # (an unpickled copy's handle has no model to ask)
        _restore_forward(model, handle)
        handle.hooks.remove(model)
        handle.remove()
        if getattr(model, _HANDLE_ATTR, None) is handle:
            delattr(model, _HANDLE_ATTR)


def convert_model(model: nn.Module, *, param_dtype: torch.dtype = torch.float32,
                  keep_fp32: tuple[type[nn.Module], ...] = BATCHNORM_TYPES,
                  keep_modules: Collection[nn.Module] = (),
                  casts: ForwardCasts = ForwardCasts()) -> ConvertHandle:
    """Cast ``model`` to ``param_dtype`` and install its converted forward and state-dict hooks.

    An earlier conversion is removed first. Half models get the fp32 state-dict hooks;
    ``casts`` decides what the converted forward does (none when it does nothing).

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
        handle.param_dtype = param_dtype
        handle.cast_at = next(((module, name) for module in model.modules()
                               for name, p in local_parameters(module).items()
                               if p is not None and p.dtype == param_dtype), None)
    if param_dtype in HALF_DTYPES:
        handle.hooks.install(model.modules())
    if casts.active:
        _install_forward_casts(model, casts, handle)
    setattr(model, _HANDLE_ATTR, handle)
    return handle


# --- the converted forward --------------------------------------------------------------
def _install_forward_casts(model: nn.Module, casts: ForwardCasts, handle: ConvertHandle) -> None:
    handle.casts = casts
    handle.inner_forward = model.__dict__.get("forward")  # someone's wrapper, kept inside
    model.forward = _ConvertedForward(model, handle)  # type: ignore[method-assign]


def _restore_forward(model: nn.Module, handle: ConvertHandle) -> None:
    """Put back the forward the model had, unless someone wrapped ours since (then ours,
    inside theirs, passes calls through once its conversion is removed)."""
    current = model.__dict__.get("forward")
    if isinstance(current, _ConvertedForward) and current.handle is handle:
        if handle.inner_forward is None:
            del model.__dict__["forward"]
        else:
            model.forward = handle.inner_forward  # type: ignore[method-assign]


def converted_forward(handle: ConvertHandle, module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """``module``'s forward inside one conversion's casts and autocast region; the forward
    it wrapped alone once that conversion is removed (``handle.casts`` None)."""
    casts, inner = handle.casts, handle.inner_forward
    if casts is None:
        return _inner_forward(module, inner, args, kwargs)
    at = handle._cast_at
    if at is None and handle._cast_path is not None:
        handle.resolve(module)  # once, after unpickling
        at = handle._cast_at
    # handle.cast_param, inlined: one Python call a step
    cast_param = at[2].get(at[1]) if at is not None else handle._legacy_param
    if cast_param is None and at is not None:
        cast_param = _cast_param(handle, at)
    # Cast since (.float(), .to(float64)) or called with other tensors in place
    # (functional_call): the inputs follow the parameters, and half outputs are not forced.
    since = (cast_param.dtype if cast_param is not None
             and cast_param.dtype != handle.param_dtype else None)
    if casts.input_dtype is not None:
        dtype = casts.input_dtype if since is None else since
        args = cast_floating(args, dtype)
        if kwargs:
            kwargs = cast_floating(kwargs, dtype)
    if casts.autocast is None:
        output = _inner_forward(module, inner, args, kwargs)
    else:
        output = casts.autocast().run(_inner_forward, module, inner, args, kwargs)
    dtype = casts.output_dtype
    if dtype is None or (since is not None and dtype in HALF_DTYPES):
        return output
    if output.__class__ is Tensor:  # the usual output, cast without the tree walk
        return cast_tensor(output, dtype) if output.is_floating_point() and output.dtype != dtype else output
    return cast_floating(output, dtype)


def _cast_param(handle: ConvertHandle, at: Optional[tuple]) -> Optional[Tensor]:
    """What the remembered parameter's slot holds now: the parameter (or functional_call's
    tensor in its place), or, parametrized since, the original the parametrization keeps
    (read, not evaluated)."""
    if at is None:
        return handle._legacy_param
    found = at[2].get(at[1])
    owner = at[0]() if found is None else None
    if owner is not None:
        parametrizations = local_modules(owner).get("parametrizations")
        if parametrizations is not None and at[1] in parametrizations:
            found = parametrizations[at[1]].original
    return found


def _inner_forward(module: nn.Module, inner: Optional[Callable[..., Any]], args: tuple,
                   kwargs: dict) -> Any:
    """The forward a conversion wraps: the one the model had, else its class's."""
    if inner is not None:
        return inner(*args, **kwargs)
    return type(module).forward(module, *args, **kwargs)


class BoundForward:
    """A forward installed as ``module.forward``, shaped like a bound method of the module
    it holds weakly (``_module``): ``__self__``, ``__wrapped__`` (the forward inside, for
    ``inspect.signature``), ``__code__`` and ``__name__`` (torch.export reads them).
    Subclasses give ``_inner()``, the module's own forward attribute before (None: its
    class's), and ``__func__``."""

    _module: "weakref.ref[nn.Module]"

    def _inner(self) -> Optional[Callable[..., Any]]:
        return None

    @property
    def __self__(self) -> nn.Module:
        module = self._module()
        assert module is not None  # reached through the module, which is alive
        return module

    @property
    def __wrapped__(self) -> Callable[..., Any]:
        """The forward inside."""
        inner = self._inner()
        return inner if inner is not None else types.MethodType(type(self.__self__).forward,
                                                                self.__self__)

    @property
    def __code__(self) -> types.CodeType:
        return inspect.unwrap(self.__wrapped__).__code__

    @property
    def __name__(self) -> str:
        return getattr(self.__wrapped__, "__name__", "forward")


class _ConvertedForward(BoundForward):
    """``model.forward`` while a conversion is installed: :func:`converted_forward` of
    that conversion, bound to the model.

    Shaped like a bound method: ``__func__`` (bound to this conversion, so a wrapper
    around it made before a later ``initialize`` never re-enters the later one),
    ``__self__``, ``__wrapped__`` (``inspect.signature`` shows the model's parameters),
    ``__code__`` and ``__name__`` (torch.export reads them). It holds the model weakly, so
    the model and its forward form no reference cycle (``del model`` frees it at once), and
    it pickles and deep-copies with the model.
    """

    def __init__(self, module: nn.Module, handle: ConvertHandle) -> None:
        self._module = weakref.ref(module)
        self.handle = handle

    def __getstate__(self) -> dict:
        return {"module": self._module(), "handle": self.handle}

    def __setstate__(self, state: dict) -> None:
        self._module = weakref.ref(state["module"])
        self.handle = state["handle"]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return converted_forward(self.handle, self._module(), *args, **kwargs)

    def _inner(self) -> Optional[Callable[..., Any]]:
        return self.handle.inner_forward

    @property
    def __func__(self) -> Callable[..., Any]:
        handle = self.handle

        def forward(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
            return converted_forward(handle, module, *args, **kwargs)
        return forward

    def __repr__(self) -> str:
        return f"<ampkit converted forward of {type(self.__self__).__name__}>"
