"""Per-module precision: ``keep_fp32(model, modules)``.

The selected modules run in fp32 inside any autocast region (autocast is off in their
forward, floating inputs are cast to fp32, floating outputs stay fp32) and keep fp32
parameters when a policy casts the model to half (O2/O3: no masters are needed for
them; ``ampkit.apply`` reads the selection). Outside an autocast region, where the
model around them is half (O2/O3), their floating outputs go back to the half dtype
their inputs had (with no floating input, token ids, the model's: see
:func:`follow_conversion`), so the half layers after them get what they expect. A kept
module whose parameters the user cast since (``model.to(dtype)``, ``.half()``) runs as it
would without keep_fp32.

The selection lives on the model (one record, its hooks and forwards); calling
``keep_fp32`` again replaces it and ``[]`` clears it. Hooks are small classes, so the
model still pickles.

Eagerly, a forward pre-hook turns autocast off and a forward hook turns it back on. While
torch.compile traces, that split region is a ``with torch.autocast(device, enabled=False)``
statement around the module's forward instead (``module.forward``, a wrapper installed
with the hooks, which passes calls straight through eagerly): dynamo cannot reconcile
switches set in one hook and undone in another with a ``torch.autocast`` region of the
compiled function (torch 2.13: "Global autocast state changed while dynamo tracing"; 2.11:
the switches are untraceable, so fullgraph=True raised and every call broke the graph),
and every dynamo traces torch's own class in a with statement.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from typing import Any, Callable, Iterable, Optional, Sequence

import torch
from torch import nn
# Bound at import: code that sets ``torch.autocast = ampkit.autocast`` must not send the
# compiled region back into ampkit's switches (see autocast.py).
from torch.amp.autocast_mode import autocast as _TorchAutocast
from torch.utils.hooks import RemovableHandle

from ._dtypes import HALF_DTYPES, cast_tree, has_autocast, iter_tensors
from ._select import Modules, Selector, as_selectors, matching
from ._torch_compat import is_compiling
from .convert import BoundForward, conversion_of

_ATTR = "_ampkit_keep_fp32"


class _Kept:
    """The selection on one model: module names, and the hooks and forwards that enforce
    them."""

    # Class defaults: records pickled before these existed.
    forwards: Sequence["_KeptForward"] = ()
    regions: Sequence["_Fp32Region"] = ()

    def __init__(self, names: list[str], handles: list[RemovableHandle],
                 forwards: Sequence["_KeptForward"], regions: Sequence["_Fp32Region"]) -> None:
        self.names = names
        self.handles = handles
        self.forwards = forwards
        self.regions = regions

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        for forward in self.forwards:
            forward.remove()
        self.forwards = ()


def keep_fp32(model: nn.Module, modules: Modules) -> nn.Module:
    """Run the selected modules of ``model`` in fp32, whatever the policy around them.

    Args:
        model: the model.
        modules: module names or fnmatch patterns over ``model.named_modules()`` names
            ("head", "blocks.*.ln_*"; a module used under two names matches either),
            nn.Module subclasses, a callable ``(name, module) -> bool``, or a list of
            these; ``[]`` clears the selection.

    Returns:
        ``model``, with the selection replacing any earlier one.

    Raises:
        ValueError: a pattern or name matches no module (the message lists some), a
            selected module already has half parameters (``initialize`` ran: select
            before it, or pass ``initialize(..., keep_fp32=...)``), or already holds fp8
            layers (``convert_to_fp8`` ran: select before it).

    Example:
        >>> model = keep_fp32(model, ["head", "blocks.*.attn"])  # doctest: +SKIP
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"keep_fp32 takes a torch.nn.Module, got {type(model).__name__} {model!r}")
    names = select(model, modules)
    _check_change(model, kept_names(model), names)
    install(model, names)
    return model


def _check_change(model: nn.Module, before: list[str], after: list[str]) -> None:
    """Refuse a selection the model's current precision cannot follow (after initialize).

    Newly selected modules must still be fp32 throughout (their children too), and the
    root cannot join once a conversion runs the whole forward in its casts or autocast
    region. A module that initialize kept fp32 inside a half model cannot leave the
    selection: its fp32 parameters (a buffer table's buffers) would get half inputs.
    """
    added = [n for n in after if n not in before]
    check_not_fp8(model, added)
    for name in added:
        half = next((f"{name}.{p}".strip(".") for p, t in
                     model.get_submodule(name).named_parameters() if t.dtype in HALF_DTYPES), None)
        if half is not None:
            raise ValueError(f"keep_fp32: module {name!r} already has half parameters ({half!r}: "
                             "initialize cast it); valid: call keep_fp32 before "
                             "ampkit.initialize, or pass initialize(..., keep_fp32=...)")
    if "" in added:
        handle = conversion_of(model)
        if handle is not None and handle.casts is not None and handle.casts.active:
            raise ValueError("keep_fp32: the root module ('') of a model whose forward "
                             "ampkit.initialize already casts cannot be selected; valid: select "
                             "it before ampkit.initialize, or pass initialize(..., keep_fp32=[''])")
    covered = [model.get_submodule(n) for n in after]
    if not any(p.dtype in HALF_DTYPES for p in model.parameters()):
        return
    for name in before:
        module = model.get_submodule(name)
        if any(module is sub for outer in covered for sub in outer.modules()):
            continue
        fp32 = [kind for kind, tensors in (("parameters", module.parameters()),
                                           ("buffers", module.buffers()))
                if any(t.is_floating_point() and t.dtype not in HALF_DTYPES for t in tensors)]
        if fp32:
            why = ("initialize ran while it was selected" if fp32[0] == "parameters" else
                   "a buffer table, which initialize keeps")
            raise ValueError(
                f"keep_fp32: module {name!r} keeps fp32 {fp32[0]} in a half model ({why}), "
                "so it cannot leave the selection: it would get half inputs; valid: a "
                f"selection that still holds it, e.g. {sorted(set(after) | {name})}")


def check_not_fp8(model: nn.Module, names: Iterable[str], caller: str = "keep_fp32") -> None:
    """Refuse to keep a module that already holds fp8 layers: they would go on computing
    in fp8 behind fp32 outputs (``convert_to_fp8`` leaves kept modules alone instead).
    ``caller``: what the message names (``keep_fp32``, or the ``keep_fp32=`` argument)."""
    from .fp8.linear import Float8Linear  # here: ampkit.fp8 imports this module

    for name in names:
        fp8 = next((f"{name}.{n}".strip(".") for n, m in model.get_submodule(name).named_modules()
                    if isinstance(m, Float8Linear)), None)
        if fp8 is not None:
            raise ValueError(f"{caller}: module {name!r} already computes in fp8 ({fp8!r}: "
                             "convert_to_fp8 swapped it), and would keep doing so; valid: keep it "
                             "in fp32 before convert_to_fp8 (which then leaves it alone), or "
                             "leave it out with convert_to_fp8(..., module_filter=...)")


def check_shared(model: nn.Module, names: Iterable[str], half: torch.dtype) -> None:
    """Refuse a selection that keeps a parameter in fp32 which a module outside it uses too
    (tied weights: GPT-2's lm_head and its token embedding), under a policy that casts the
    parameters to ``half``: a parameter has one dtype, and whichever it got, one of the
    two modules would meet a dtype it does not expect."""
    names = list(names)
    inside = {id(m) for name in names for m in model.get_submodule(name).modules()}
    kept = {id(p): f"{name}.{pname}".strip(".") for name in names
            for pname, p in model.get_submodule(name).named_parameters()}
    for module_name, module in model.named_modules(remove_duplicate=False):
        if id(module) in inside:
            continue
        for pname, param in module.named_parameters(recurse=False):
            if id(param) in kept:
                other = f"{module_name}.{pname}".strip(".")
                holder = next(n for n in names if kept[id(param)].startswith(f"{n}.".lstrip(".")))
                raise ValueError(
                    f"keep_fp32: {holder!r} is kept in fp32, but its parameter "
                    f"{kept[id(param)]!r} is also {other!r}, outside the selection, which the "
                    f"policy casts to {half}; a parameter has one dtype; valid: keep both "
                    f"{holder!r} and {module_name!r} in fp32, or neither")


def select(model: nn.Module, modules: Modules, *, strict: bool = True) -> list[str]:
    """The names of ``model``'s modules that ``modules`` selects (validated, in model order).

    ``strict``: a name or pattern that matches nothing raises ValueError naming a few
    real module names.
    """
    chosen: set[str] = set()
    for selector in as_selectors(modules):
        hits = matching(model, selector)
        if strict and not hits and isinstance(selector, str):
            named = [name for name, _ in model.named_modules(remove_duplicate=False)]
            examples = ", ".join(repr(name) for name in named[1:7]) or "'' (the root; no submodules)"
            raise ValueError(f"keep_fp32: {_describe(selector)} matches no module of "
                             f"{type(model).__name__}; valid: names or patterns over "
                             f"model.named_modules(), e.g. {examples}")
        chosen.update(hits)
    return [name for name, _ in model.named_modules() if name in chosen]


def _describe(selector: Selector) -> str:
    if isinstance(selector, str):
        return f"pattern {selector!r}"
    if isinstance(selector, type):
        return f"type {selector.__name__}"
    return f"callable {selector!r}"


def install(model: nn.Module, names: Iterable[str]) -> None:
    """Replace ``model``'s selection by ``names`` (already validated) and its hooks."""
    previous: Optional[_Kept] = getattr(model, _ATTR, None)
    if previous is not None:
        previous.remove()
        delattr(model, _ATTR)
    names = list(names)
    if not names:
        return
    handles: list[RemovableHandle] = []
    forwards: list[_KeptForward] = []
    regions: list[_Fp32Region] = []
    for name in names:
        region = _Fp32Region(traced_by_forward=True)
        regions.append(region)
        module = model.get_submodule(name)
        handles.append(module.register_forward_pre_hook(region.enter, with_kwargs=True,
                                                        prepend=True))
        handles.append(module.register_forward_hook(region.leave, prepend=True,
                                                    always_call=True))
        forwards.append(_KeptForward(module, module.__dict__.get("forward")))
        module.forward = forwards[-1]  # type: ignore[method-assign]
    setattr(model, _ATTR, _Kept(names, handles, forwards, regions))
    follow_conversion(model)


def follow_conversion(model: nn.Module) -> None:
    """Tell the kept regions of ``model`` the dtype of the model around them: that of a
    parameter its current conversion (``ampkit.initialize``) cast to half, read at each
    forward (the converted forward follows that parameter too), for outputs computed from
    no floating input (token ids) to go back to. Kept modules inside kept modules have
    fp32 around them. Called by :func:`install` and after every conversion."""
    kept: Optional[_Kept] = getattr(model, _ATTR, None)
    if kept is None:
        return
    handle = conversion_of(model)
    around = handle.cast_param if handle is not None else None
    modules = [model.get_submodule(name) for name in kept.names]
    for module, region in zip(modules, kept.regions):
        nested = any(outer is not module and any(sub is module for sub in outer.modules())
                     for outer in modules)
        region.around = None if nested else around


def kept_names(model: nn.Module) -> list[str]:
    """The names ``keep_fp32`` selected on ``model`` (empty when none)."""
    kept: Optional[_Kept] = getattr(model, _ATTR, None)
    return [] if kept is None else list(kept.names)


def kept_modules(model: nn.Module) -> list[nn.Module]:
    """The modules ``keep_fp32`` selected on ``model`` and every module inside them."""
    return [sub for name in kept_names(model) for sub in model.get_submodule(name).modules()]


class _Fp32Region:
    """Autocast off for one module's forward, fp32 inputs; per-thread stack (recursion).

    ``traced_by_forward``: while dynamo traces, the module's :class:`_KeptForward` is the
    region (False for a model pickled before it had one: the hooks stay the region).
    ``around``: a parameter of the model around the module that a policy cast to half
    (None: none), whose dtype outputs computed from no floating input go back to
    (:func:`follow_conversion`).
    """

    def __init__(self, traced_by_forward: bool = False,
                 around: Optional[torch.Tensor] = None) -> None:
        self._local = threading.local()
        self.traced_by_forward = traced_by_forward
        self.around = around

    def __getstate__(self) -> dict:
        # Open regions belong to this process's threads.
        return {"traced_by_forward": self.traced_by_forward, "around": self.around}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state.get("traced_by_forward", False),  # type: ignore[misc]
                      state.get("around"))

    def enter(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        from .autocast import autocast  # autocast imports nothing of this module

        device = _device_type(module, args)
        # getattr, not ``__dict__.setdefault``: the dynamo of torch 2.11 traces only this.
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        autocasting = has_autocast(device) and torch.is_autocast_enabled(device)
        # Outside autocast (a half O2/O3 model), the outputs go back to the half dtype
        # around the module (see _restore_dtype).
        restore = None if autocasting else self._restore_dtype((args, kwargs))
        if not _runs_fp32(module) or (not autocasting and restore is None):
            # Cast since keep_fp32 (model.to(dtype), .half()), or no region and no half
            # around (an fp32 or fp64 model, the meta device): the module's forward runs
            # as it would without keep_fp32.
            stack.append((None, None))
            return args, kwargs
        region = None
        if not (self.traced_by_forward and is_compiling()):
            region = autocast(device, enabled=False)
            region.__enter__()
        stack.append((region, restore))
        return cast_tree(args, torch.float32), cast_tree(kwargs, torch.float32)

    def leave(self, module: nn.Module, args: tuple, output: Any) -> Any:
        stack = getattr(self._local, "stack", None)
        if not stack:
            return output
        region, restore = stack.pop()
        if region is not None:
            region.__exit__(None, None, None)
        return output if restore is None else cast_tree(output, restore)

    def _restore_dtype(self, inputs: Any) -> Optional[torch.dtype]:
        """The half dtype outputs go back to outside autocast: the first half input's (one
        given by keyword counts: ``block(hidden_states=h)``); with no floating input at all
        (token ids into a kept embedding), the dtype of the half model around; else none."""
        floating = False
        for tensor in iter_tensors(inputs):
            if tensor.dtype in HALF_DTYPES:
                return tensor.dtype
            floating = floating or tensor.is_floating_point()
        around = None if floating or self.around is None else self.around.dtype
        return around if around in HALF_DTYPES else None


class _KeptForward(BoundForward):
    """``module.forward`` of a kept module: the forward it had, called as is eagerly (the
    hooks of :class:`_Fp32Region` are the region); while dynamo traces, inside ``with
    torch.autocast(device, enabled=False)`` where autocast is on (see the module docstring).

    Shaped like a bound method (:class:`ampkit.convert.BoundForward`), as ampkit's
    converted forward is.
    It holds the module weakly (no reference cycle) and pickles and deep-copies with it.
    """

    def __init__(self, module: nn.Module, inner: Optional[Callable[..., Any]]) -> None:
        self._module = weakref.ref(module)
        self.inner = inner  # the module's own ``forward`` attribute before (None: its class's)
        self.active = True  # False once removed while someone's wrapper holds it

    def __getstate__(self) -> dict:
        return {"module": self._module(), "inner": self.inner, "active": self.active}

    def __setstate__(self, state: dict) -> None:
        self._module = weakref.ref(state["module"])
        self.inner, self.active = state["inner"], state["active"]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module = self._module()
        if is_compiling() and self.active:
            return _traced_forward(self, module, args, kwargs)
        return _inner_forward(self, module, args, kwargs)  # eagerly the hooks are the region

    def remove(self) -> None:
        """Put back the forward the module had, unless someone wrapped this one since
        (then it stays inside theirs and passes calls through)."""
        self.active = False
        module = self._module()
        if module is None or module.__dict__.get("forward") is not self:
            return
        if self.inner is None:
            del module.__dict__["forward"]
        else:
            module.forward = self.inner  # type: ignore[method-assign]

    def _inner(self) -> Optional[Callable[..., Any]]:
        return self.inner

    @property
    def __func__(self) -> Callable[..., Any]:
        def forward(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
            return _kept_forward(self, module, args, kwargs)
        return forward

    def __repr__(self) -> str:
        return f"<ampkit keep_fp32 forward of {type(self.__self__).__name__}>"


def _kept_forward(kept: _KeptForward, module: nn.Module, args: tuple, kwargs: dict) -> Any:
    """What ``kept`` does for ``module`` (``kept.__func__``; ``kept()`` inlines it)."""
    if is_compiling() and kept.active:
        return _traced_forward(kept, module, args, kwargs)
    return _inner_forward(kept, module, args, kwargs)


def _inner_forward(kept: _KeptForward, module: nn.Module, args: tuple, kwargs: dict) -> Any:
    if kept.inner is not None:
        return kept.inner(*args, **kwargs)
    return type(module).forward(module, *args, **kwargs)


def _traced_forward(kept: _KeptForward, module: nn.Module, args: tuple, kwargs: dict) -> Any:
    """The forward while dynamo traces: autocast off in a with statement where it is on
    (the pre-hook already cast the inputs), with the dtype the eager region sets.

    No ampkit frame is pushed: registered overrides follow torch's switch (off here, as in
    the eager region), and pushing one where overrides are registered but not in place
    would break the graph (overrides.push_frame).
    """
    from .autocast import autocast  # autocast imports nothing of this module

    device = _device_type(module, args)
    if not (has_autocast(device) and torch.is_autocast_enabled(device) and _runs_fp32(module)):
        return _inner_forward(kept, module, args, kwargs)
    dtype = autocast(device, enabled=False).fast_dtype  # what the eager region sets
    with _TorchAutocast(device, dtype, enabled=False):
        return _inner_forward(kept, module, args, kwargs)


def _device_type(module: nn.Module, args: tuple) -> str:
    for tensor in iter_tensors(args):
        return tensor.device.type
    for param in module.parameters():
        return param.device.type
    return "cpu"


def _runs_fp32(module: nn.Module) -> bool:
    """Whether a kept module's region applies: its floating parameters are fp32 (or it has
    none). Cast since keep_fp32 (``model.to(dtype)``, ``.half()``, ``.double()``, the last
    thing the user asked for), it runs as it would without keep_fp32; ``.float()`` makes
    it kept again. Its first floating parameter decides (those casts and ``initialize``
    cast all of them); without one, its first floating buffer (a buffer table)."""
    for tensor in itertools.chain(module.parameters(), module.buffers()):
        if tensor.is_floating_point():
            return tensor.dtype == torch.float32
    return True
