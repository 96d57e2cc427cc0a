"""State-dict hooks of a half model: ``model.state_dict()`` holds fp32 tensors (the fp32
master of a parameter when it has one, so a checkpoint resumes bitwise), and
``model.load_state_dict()`` writes the loaded fp32 values into the masters as well.
Installed per module by a conversion (``convert.py``), and on modules added since, as a
save or load reaches them.
"""

from __future__ import annotations

import weakref
from typing import Any, Iterable, Optional

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from ._dtypes import HALF_DTYPES
from ._torch_compat import (
    local_buffers,
    local_parameters,
    register_load_state_dict_post_hook,
    register_load_state_dict_pre_hook,
    register_state_dict_post_hook,
    register_state_dict_pre_hook,
    swaps_params_on_load,
)
from .master import master_of, resume_after_swap, suspend_for_swap

class Hooks:
    """One conversion's state-dict hooks: its ``handles`` (what ``remove`` takes off) and
    a ``token`` that marks the modules it hooked. The token, not this object, is what
    the modules' hooks and marks hold, so a submodule pickled alone carries none of the
    other modules (the handles reach every module's hook dicts)."""

    def __init__(self, handles: Optional[list[RemovableHandle]] = None) -> None:
        self.token = _Token()
        self.handles: list[RemovableHandle] = handles or []
        _LIVE[self.token] = self

    def __getstate__(self) -> dict:
        return {"token": self.token, "handles": self.handles}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        _LIVE[self.token] = self  # the copy's modules find it by their token

    def install(self, modules: Iterable[nn.Module]) -> None:
        """Per-module hooks, so ``model.state_dict()`` and ``model.sub.state_dict()`` both
        work, on each of ``modules`` not hooked by this conversion yet (marked).

        The assign check comes first: a load's first hook runs on the module it was called
        on, before anything is loaded."""
        descend = _Descend(self.token)
        for module in modules:
            marks = _marks(module)
            if any(mark is self.token for mark in marks):
                continue
            # Pickles and deep-copies with the module; a module shared by two converted
            # models carries both marks.
            module.__dict__[_HOOKED_ATTR] = [*marks, self.token]
            self.handles += [register_load_state_dict_pre_hook(module, _refuse_assign),
                             register_state_dict_pre_hook(module, descend.before_save),
                             register_load_state_dict_pre_hook(module, descend.before_load),
                             register_state_dict_post_hook(module, _save_fp32),
                             register_load_state_dict_pre_hook(module, _load_into_masters),
                             register_load_state_dict_post_hook(module, _after_load)]

    def remove(self, model: Optional[nn.Module]) -> None:
        """Take every hook off, and the marks off ``model``'s modules (None: gone)."""
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        for module in model.modules() if model is not None else ():
            marks = [mark for mark in _marks(module) if mark is not self.token]
            if marks:
                module.__dict__[_HOOKED_ATTR] = marks
            else:
                module.__dict__.pop(_HOOKED_ATTR, None)


def _marks(module: nn.Module) -> list["_Token"]:
    """The tokens of the conversions that hooked ``module`` (an earlier build marked it
    with one object, not a list of tokens: none of today's)."""
    marks = module.__dict__.get(_HOOKED_ATTR)
    return marks if isinstance(marks, list) else []


class _Token:
    """The mark of one conversion's hooks (tiny; its identity survives a pickle)."""

    __slots__ = ("__weakref__",)


_LIVE: "weakref.WeakValueDictionary[_Token, Hooks]" = weakref.WeakValueDictionary()
_HOOKED_ATTR = "_ampkit_state_dict_hooks"  # on each module: the tokens of its conversions


class _Descend:
    """A save's or load's pre-hook on every module of a conversion: hooks the module's
    children that the conversion has not hooked yet (added since ``initialize``: a new
    head whose half parameters ``add_param_group`` gave masters, torch's parametrization
    container), just before torch descends into them. It holds the conversion's token
    (a submodule pickled alone finds no conversion, and hooks nothing)."""

    def __init__(self, token: _Token) -> None:
        self.token = token

    def __setstate__(self, state: dict) -> None:
        # An earlier build held the conversion itself: its copy finds no conversion.
        self.token = state.get("token")

    def before_save(self, module: nn.Module, prefix: str, keep_vars: bool) -> None:
        hooks = _LIVE.get(self.token)
        if hooks is not None:
            hooks.install(module.children())

    def before_load(self, module: nn.Module, *_: Any) -> None:
        self.before_save(module, "", False)


def _save_fp32(module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict) -> None:
    for name, param in local_parameters(module).items():
        key = prefix + name
        if param is None or key not in state_dict:
            continue
        master = master_of(param)
        keep_vars = state_dict[key] is param  # state_dict(keep_vars=True): the variables
        if master is None:
            value = _fp32_of(state_dict, param, state_dict[key])
            # An fp32 copy of a half parameter still says whether it trains, as the
            # parameter would (``{k: v ... if v.requires_grad}`` picks the trained ones).
            state_dict[key] = (value.requires_grad_(param.requires_grad)
                               if keep_vars and value is not param else value)
        else:
            # The fp32 master, not the half parameter rounded from it: the exact training
            # state; with keep_vars the master itself, the variable the optimizer steps,
            # saying whether it trains as the parameter says now (frozen or unfrozen since).
            if keep_vars and master.requires_grad != param.requires_grad:
                master.requires_grad_(param.requires_grad)
            state_dict[key] = master if keep_vars else master.detach()
    for name, buf in local_buffers(module).items():
        key = prefix + name
        if buf is not None and key in state_dict:
            state_dict[key] = _fp32(state_dict[key])


def _fp32(tensor: Tensor) -> Tensor:
    return tensor.detach().float() if tensor.dtype in HALF_DTYPES else tensor


# Per state dict being written (by id, while it lives): the fp32 copy made of each half
# parameter (by id), so one parameter under two names (tied weights) is one tensor in it,
# as in an fp32 model's state dict, and a checkpoint holds it once. A copy is reused only
# while it still holds the parameter's values exactly: a destination written again after
# the parameter changed (through ``.data`` too, which autograd's version count misses)
# gets a new copy. No reference to the parameter is kept, not even a weak one: torch's
# swap_tensors (swap mode's load_state_dict and .to()) refuses weakly referenced tensors.
_COPIES: dict[int, dict[int, Tensor]] = {}


def _fp32_of(state_dict: dict, param: Tensor, value: Tensor) -> Tensor:
    if value.dtype not in HALF_DTYPES:
        return value
    copies = _COPIES.get(id(state_dict))
    if copies is None:
        try:
            weakref.finalize(state_dict, _COPIES.pop, id(state_dict), None)
        except TypeError:  # a destination that takes no weak reference (a plain dict)
            return _fp32(value)
        copies = _COPIES[id(state_dict)] = {}
    seen = copies.get(id(param))
    if (seen is not None and seen.shape == value.shape
            and torch.equal(seen.to(value.dtype), value)):  # a tie, or a destination reused
        return seen
    copy = copies[id(param)] = _fp32(value)
    return copy


def _refuse_assign(module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict,
                   *_: Any) -> None:
    """``load_state_dict(assign=True)`` would put new tensors in place of half parameters
    whose fp32 masters the optimizer steps: training would never reach the model again
    (nor its state_dict the masters). Refused before anything is loaded."""
    if not prefix:  # the first hook of a load: what a load that raised left goes
        _LOADING.clear()
    if not local_metadata.get("assign_to_params_buffers", False):
        return
    if any(master_of(param) is not None for param in module.parameters()):
        raise ValueError(
            f"load_state_dict(assign=True) on {type(module).__name__}, whose half parameters "
            "have fp32 masters (O2): it would replace the parameters the masters write "
            "into, and training would no longer reach the model; valid: assign=False (the "
            "values are copied into the masters and the half parameters), or assign=True "
            "before ampkit.initialize. Nothing was loaded")


# The state dict each module's load reads, from its pre-hook to its post-hook. The values
# go into the masters in the pre-hook, as torch is about to load them into the parameters,
# and again in the post-hook, after every pre-hook of the load has run: a user's hook
# registered after initialize (renaming keys, resizing a position table) has changed them
# by then, as torch loaded them. A load that raises before a module's post-hook leaves
# its entry (and the state dict) here until the next load begins.
_LOADING: "weakref.WeakKeyDictionary[nn.Module, tuple[dict, str]]" = weakref.WeakKeyDictionary()


def _load_into_masters(module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict,
                       strict: bool, missing_keys: list, unexpected_keys: list,
                       error_msgs: list) -> None:
    _copy_into_masters(module, state_dict, prefix)
    _LOADING[module] = (state_dict, prefix)
    if swaps_params_on_load():
        params = [param for param in local_parameters(module).values() if param is not None]
        suspend_for_swap(params)  # until _after_load: swap_tensors refuses weak references


def _after_load(module: nn.Module, incompatible_keys: Any) -> None:
    resume_after_swap()
    state_dict, prefix = _LOADING.pop(module, (None, ""))
    if state_dict is not None:
        _copy_into_masters(module, state_dict, prefix)


def _copy_into_masters(module: nn.Module, state_dict: dict, prefix: str) -> None:
    """The loaded values of ``module``'s own half parameters into their masters. torch
    copies each into its parameter (rounding to nearest, as the master -> model copy after
    a step does), so model == half(master) holds."""
    with torch.no_grad():
        for name, param in local_parameters(module).items():
            value = state_dict.get(prefix + name)
            master = master_of(param) if param is not None else None
            if master is None or not isinstance(value, Tensor):
                continue
            if master.dim() == 0 and value.dim() == 1:
                value = value[0]  # torch loads a (1,) value into a 0-dim parameter too
            if value.shape == master.shape:  # else torch refused it as well
                master.copy_(value)