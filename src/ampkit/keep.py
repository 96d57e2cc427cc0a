"""Per-module precision: ``keep_fp32(model, modules)``.

The selected modules run in fp32 inside any autocast region (autocast is off in their
forward, floating inputs are cast to fp32, floating outputs stay fp32) and keep fp32
parameters when a policy casts the model to half (O2/O3: no masters are needed for
them; ``ampkit.apply`` reads the selection). Outside an autocast region, where the
model around them is half (O2/O3), their floating outputs go back to the half dtype
their inputs had, so the half layers after them get what they expect.

The selection lives on the model (one record, its hooks); calling ``keep_fp32`` again
replaces it and ``[]`` clears it. Hooks are small classes, so the model still pickles.
"""

from __future__ import annotations

import fnmatch
import threading
from typing import Any, Callable, Iterable, Optional, Sequence, Union

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ._dtypes import HALF_DTYPES, cast_tree, has_autocast, iter_tensors
from .convert import conversion_of

Selector = Union[str, type, Callable[[str, nn.Module], bool]]
Modules = Union[Selector, Sequence[Selector]]
_ATTR = "_ampkit_keep_fp32"


class _Kept:
    """The selection on one model: module names and the hooks that enforce them."""

    def __init__(self, names: list[str], handles: list[RemovableHandle]) -> None:
        self.names = names
        self.handles = handles

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()


def keep_fp32(model: nn.Module, modules: Modules) -> nn.Module:
    """Run the selected modules of ``model`` in fp32, whatever the policy around them.

    Args:
        model: the model.
        modules: module names or fnmatch patterns over ``model.named_modules()`` names
            ("head", "blocks.*.ln_*"), nn.Module subclasses, a callable
            ``(name, module) -> bool``, or a list of these; ``[]`` clears the selection.

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
    selection: its fp32 parameters would get half inputs.
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
        if any(p.is_floating_point() and p.dtype not in HALF_DTYPES for p in module.parameters()):
            raise ValueError(
                f"keep_fp32: module {name!r} keeps fp32 parameters in a half model (initialize "
                "ran while it was selected), so it cannot leave the selection: it would get "
                f"half inputs; valid: a selection that still holds it, e.g. {sorted(set(after) | {name})}")


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


def select(model: nn.Module, modules: Modules, *, strict: bool = True) -> list[str]:
    """The names of ``model``'s modules that ``modules`` selects (validated, in model order).

    ``strict``: a name or pattern that matches nothing raises ValueError naming a few
    real module names.
    """
    selectors = as_selectors(modules)
    named = list(model.named_modules())  # the root first, named ""
    chosen: set[str] = set()
    for selector in selectors:
        hits = {name for name, module in named if _matches(selector, name, module)}
        if strict and not hits and isinstance(selector, str):
            examples = ", ".join(repr(name) for name, _ in named[1:7]) or "'' (the root; no submodules)"
            raise ValueError(f"keep_fp32: {_describe(selector)} matches no module of "
                             f"{type(model).__name__}; valid: names or patterns over "
                             f"model.named_modules(), e.g. {examples}")
        chosen |= hits
    return [name for name, _ in named if name in chosen]


def as_selectors(modules: Modules) -> list[Selector]:
    """``modules`` as a list of selectors, each checked (TypeError names a bad one)."""
    items = list(modules) if isinstance(modules, (list, tuple, set, frozenset)) else [modules]
    for item in items:
        ok = isinstance(item, str) or (isinstance(item, type) and issubclass(item, nn.Module))
        if not ok and not (callable(item) and not isinstance(item, (type, nn.Module))):
            raise TypeError(f"keep_fp32: {item!r} is not a module selector; valid: a module "
                            "name or fnmatch pattern (str), an nn.Module subclass, or a "
                            "callable (name, module) -> bool")
    return items


def _matches(selector: Selector, name: str, module: nn.Module) -> bool:
    if isinstance(selector, str):
        return name == selector or fnmatch.fnmatchcase(name, selector)
    if isinstance(selector, type):
        return isinstance(module, selector)
    return bool(selector(name, module))


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
    for name in names:
        region = _Fp32Region()
        module = model.get_submodule(name)
        handles.append(module.register_forward_pre_hook(region.enter, with_kwargs=True,
                                                        prepend=True))
        handles.append(module.register_forward_hook(region.leave, prepend=True,
                                                    always_call=True))
    setattr(model, _ATTR, _Kept(names, handles))


def kept_names(model: nn.Module) -> list[str]:
    """The names ``keep_fp32`` selected on ``model`` (empty when none)."""
    kept: Optional[_Kept] = getattr(model, _ATTR, None)
    return [] if kept is None else list(kept.names)


def kept_modules(model: nn.Module) -> list[nn.Module]:
    """The modules ``keep_fp32`` selected on ``model`` and every module inside them."""
    return [sub for name in kept_names(model) for sub in model.get_submodule(name).modules()]


class _Fp32Region:
    """Autocast off for one module's forward, fp32 inputs; per-thread stack (recursion)."""

    def __init__(self) -> None:
        self._local = threading.local()

    def __getstate__(self) -> dict:
        return {}  # open regions belong to this process's threads

    def __setstate__(self, state: dict) -> None:
        self.__init__()  # type: ignore[misc]

    def enter(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        from .autocast import autocast  # autocast imports nothing of this module

        device = _device_type(module, args)
        stack = self._local.__dict__.setdefault("stack", [])
        autocasting = has_autocast(device) and torch.is_autocast_enabled(device)
        # Outside autocast (a half O2/O3 model), the outputs go back to the inputs' dtype
        # (a half input given by keyword counts: ``block(hidden_states=h)``).
        restore = None if autocasting else _half_dtype_of((args, kwargs))
        if not autocasting and restore is None:
            # No region and no half input (an fp32 or fp64 model, the meta device): the
            # module's forward runs as it would without keep_fp32.
            stack.append((None, None))
            return args, kwargs
        region = autocast(device, enabled=False)
        region.__enter__()
        stack.append((region, restore))
        return cast_tree(args, torch.float32), cast_tree(kwargs, torch.float32)

    def leave(self, module: nn.Module, args: tuple, output: Any) -> Any:
        stack = self._local.__dict__.get("stack")
        if not stack:
            return output
        region, restore = stack.pop()
        if region is None:
            return output
        region.__exit__(None, None, None)
        return output if restore is None else cast_tree(output, restore)


def _device_type(module: nn.Module, args: tuple) -> str:
    for tensor in iter_tensors(args):
        return tensor.device.type
    for param in module.parameters():
        return param.device.type
    return "cpu"


def _half_dtype_of(args: Any) -> Optional[torch.dtype]:
    for tensor in iter_tensors(args):
        if tensor.dtype in HALF_DTYPES:
            return tensor.dtype
    return None
