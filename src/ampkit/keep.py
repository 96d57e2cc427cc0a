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

The region each kept module runs in, and its forward, are in ``_kept_region.py``.
"""

from __future__ import annotations

from typing import Iterable, Optional, Sequence

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ._dtypes import HALF_DTYPES
from ._kept_region import Fp32Region, KeptForward
from ._select import Matcher, Modules, Selector, as_selectors
from ._sharding import is_sharded
from .convert import conversion_of

_ATTR = "_ampkit_keep_fp32"
# The region classes by the names they had here: models pickled before they moved.
_Fp32Region, _KeptForward = Fp32Region, KeptForward


class _Kept:
    """The selection on one model: module names, and the hooks and forwards that enforce
    them."""

    # Class defaults: records pickled before these existed.
    forwards: Sequence["KeptForward"] = ()
    regions: Sequence["Fp32Region"] = ()

    def __init__(self, names: list[str], handles: list[RemovableHandle],
                 forwards: Sequence["KeptForward"], regions: Sequence["Fp32Region"]) -> None:
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
            layers (``convert_to_fp8`` ran: select before it), or the selection changes on
            a model already sharded (``ampkit.distributed.shard``: select before it).

    Example:
        >>> model = keep_fp32(model, ["head", "blocks.*.attn"])  # doctest: +SKIP
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"keep_fp32 takes a torch.nn.Module, got {type(model).__name__} {model!r}")
    names = select(model, modules)
    before = kept_names(model)
    if names != before and is_sharded(model):
        raise ValueError("keep_fp32: the model is already sharded (ampkit.distributed.shard or "
                         "fully_shard fixed each group's precision then), so a new selection "
                         f"would change nothing (kept now: {before}); valid: call keep_fp32 "
                         "before ampkit.distributed.shard")
    _check_change(model, before, names)
    install(model, names)
    return model


def _check_change(model: nn.Module, before: list[str], after: list[str]) -> None:
    """Refuse a selection the model's current precision cannot follow (after initialize).

    Newly selected modules must still be fp32 throughout (their children too), and the
    root cannot join once a conversion runs the whole forward in its casts or autocast
    region. A module that initialize kept fp32 inside a half model cannot leave the
    selection: its fp32 parameters (or buffers: a table's) would get half inputs.
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
            raise ValueError(
                f"keep_fp32: module {name!r} keeps fp32 {fp32[0]} in a half model (initialize "
                "ran while it was selected), "
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
    matcher = Matcher(model)
    for selector in as_selectors(modules):
        hits = matcher.hits(selector)
        if strict and not hits and isinstance(selector, str):
            named = [name for name, _ in matcher.named]
            examples = ", ".join(repr(name) for name in named[1:7]) or "'' (the root; no submodules)"
            raise ValueError(f"keep_fp32: {_describe(selector)} matches no module of "
                             f"{type(model).__name__}; valid: names or patterns over "
                             f"model.named_modules(), e.g. {examples}")
        chosen.update(hits)
    names = [name for name, _ in model.named_modules() if name in chosen]
    _check_forward_runs(model, names)
    return names


def _check_forward_runs(model: nn.Module, names: list[str]) -> None:
    """Refuse a module whose owner reads its weights without calling its forward
    (``nn.MultiheadAttention``'s ``out_proj``): no hook of it would run, so it would stay
    in half under autocast, and hold fp32 weights among half ones under O2/O3."""
    inside = {id(m) for name in names for m in model.get_submodule(name).modules()}
    for owner_name, owner in model.named_modules():
        if isinstance(owner, nn.MultiheadAttention) and id(owner) not in inside \
                and id(owner.out_proj) in inside:
            name = f"{owner_name}.out_proj".lstrip(".")
            raise ValueError(
                f"keep_fp32: {name!r} is the out_proj of nn.MultiheadAttention {owner_name!r}, "
                "which uses its weight directly and never calls its forward, so it cannot run "
                f"in fp32 alone; valid: keep the whole attention ({owner_name!r}), or a "
                "selection without its out_proj")


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
    forwards: list[KeptForward] = []
    regions: list[Fp32Region] = []
    for name in names:
        region = Fp32Region(traced_by_forward=True)
        regions.append(region)
        module = model.get_submodule(name)
        handles.append(module.register_forward_pre_hook(region.enter, with_kwargs=True,
                                                        prepend=True))
        handles.append(module.register_forward_hook(region.leave, prepend=True,
                                                    always_call=True))
        forwards.append(KeptForward(module, module.__dict__.get("forward")))
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
    inside = {id(sub) for outer in modules for sub in outer.modules() if sub is not outer}
    for module, region in zip(modules, kept.regions):
        region.around = None if id(module) in inside else around  # nested: fp32 around


def kept_names(model: nn.Module) -> list[str]:
    """The names ``keep_fp32`` selected on ``model`` (empty when none)."""
    kept: Optional[_Kept] = getattr(model, _ATTR, None)
    return [] if kept is None else list(kept.names)


def kept_modules(model: nn.Module) -> list[nn.Module]:
    """The modules ``keep_fp32`` selected on ``model`` and every module inside them."""
    return [sub for name in kept_names(model) for sub in model.get_submodule(name).modules()]
