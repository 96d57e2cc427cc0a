"""convert_to_fp8: swap a model's eligible nn.Linear layers for Float8Linear in place."""

from __future__ import annotations

import inspect
import logging
from typing import Any, Callable, Iterable, Optional, Union

import torch
from torch import nn

from .._torch_compat import ddp_ignore, local_modules, move_hooks
from .._warn import warn_once
from ..keep import kept_modules
from .config import Float8Config, Recipe
from .linear import Float8Linear, check_fp8_backend, check_fp8_dims

logger = logging.getLogger("ampkit.fp8")

ModuleFilter = Callable[[nn.Module, str], bool]


def _skip_reason(module: nn.Linear, fqn: str, module_filter: Optional[ModuleFilter]) -> Optional[str]:
    if type(module) is not nn.Linear:
        # A subclass may have its own forward (or be read by its owner, as
        # MultiheadAttention reads out_proj.weight), which a swap would silently drop.
        return f"{type(module).__name__} is a subclass of nn.Linear, not nn.Linear itself"
    reason = check_fp8_dims(module.in_features, module.out_features)
    if reason is not None:
        return reason
    computed = [name for name in ("weight", "bias")
                if getattr(module, name) is not None
                and not isinstance(getattr(module, name), nn.Parameter)]
    if computed:
        # torch.nn.utils.prune, weight_norm, spectral_norm (the hook-based ones) recompute
        # it before each forward from parameters of their own, which a swap would drop.
        return (f"its {computed[0]} is not a Parameter but computed by a hook (pruning, "
                "weight_norm, spectral_norm)")
    if module_filter is not None and not module_filter(module, fqn):
        return "refused by module_filter"
    return None


def _plan(model: nn.Module, module_filter: Optional[ModuleFilter]
          ) -> tuple[list[tuple[nn.Module, str, nn.Linear]], list[tuple[str, str]]]:
    """The (parent, attribute, linear) triples to swap and the (fqn, reason) skips."""
    swaps: list[tuple[nn.Module, str, nn.Linear]] = []
    skips: list[tuple[str, str]] = []
    kept = {id(m) for m in kept_modules(model)}
    decided: dict[int, dict[str, bool]] = {}  # per layer: fqn -> swapped
    for parent_name, parent in model.named_modules():
        # Not named_children(): that skips a layer placed in two slots.
        for name, child in local_modules(parent).items():
            if not isinstance(child, nn.Linear) or isinstance(child, Float8Linear):
                continue
            fqn = f"{parent_name}.{name}" if parent_name else name
            reason = ("kept in fp32 (ampkit.keep_fp32)" if id(child) in kept
                      else _skip_reason(child, fqn, module_filter))
            if reason is None:
                swaps.append((parent, name, child))
            else:
                skips.append((fqn, reason))
            decided.setdefault(id(child), {})[fqn] = reason is None
    split = next((names for names in decided.values() if len(set(names.values())) > 1), None)
    if split is not None:
        taken = [name for name, swap in split.items() if swap]
        left = [name for name, swap in split.items() if not swap]
        raise ValueError(f"convert_to_fp8: one layer is used as {taken[0]!r} and {left[0]!r}, "
                         f"and module_filter accepts {taken[0]!r} but refuses {left[0]!r}: the "
                         "swap would make two layers of it; valid: a module_filter that decides "
                         "alike for every name of a layer")
    return swaps, skips


def eligible_linears(model: nn.Module, module_filter: Optional[ModuleFilter] = None
                     ) -> list[tuple[str, nn.Linear]]:
    """The (name, layer) pairs :func:`convert_to_fp8` would swap, in module order.

    Example:
        >>> [name for name, _ in eligible_linears(nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 10)))]
        ['0']
    """
    if isinstance(model, nn.Linear) and not isinstance(model, Float8Linear):
        return [] if _skip_reason(model, "", module_filter) else [("", model)]
    swaps, _ = _plan(model, module_filter)
    names = {id(module): name for name, module in model.named_modules()}
    seen: set[int] = set()
    out = []
    for _, _, linear in swaps:
        if id(linear) not in seen:
            seen.add(id(linear))
            out.append((names[id(linear)], linear))
    return out


def selecting(model: nn.Module, names: Iterable[str]) -> ModuleFilter:
    """A ``module_filter`` that takes exactly the layers ``names`` name in ``model``, by
    identity: a layer also reached under another name (registered under two parents) is
    taken under every one of them, as convert_to_fp8 requires."""
    chosen = {id(model.get_submodule(name)) for name in names}
    return lambda module, _fqn: id(module) in chosen


def _check_devices(config: Float8Config, linears: list[nn.Linear]) -> None:
    """Refuse emulate=False before the first swap, not at the first forward."""
    # A "meta" model is checked at its first forward, once it is on a real device.
    for device in {linear.weight.device for linear in linears} - {torch.device("meta")}:
        check_fp8_backend(config, device)


def convert_to_fp8(model: nn.Module, *,
                   recipe: Union[str, Recipe, Float8Config] = Recipe.TENSORWISE,
                   module_filter: Optional[ModuleFilter] = None) -> nn.Module:
    """Swap every eligible nn.Linear of ``model`` for a Float8Linear, in place.

    Eligible: exactly nn.Linear (not a subclass), in/out features positive multiples of 16, and
    accepted by ``module_filter``. Skipped layers stay as they are and are reported on
    the ``ampkit.fp8`` logger (INFO), one line each with the reason; a call without
    ``module_filter`` that swaps no layer at all warns (UserWarning). The new layers share
    the old Parameters, so state_dict keys and dtypes, optimizers and tied weights are
    unchanged, and they take over the old layers' hooks (the user's, and the fp32
    state-dict hooks of an earlier O2/O3 ``initialize``). Everything is checked before
    the first swap. Under the delayed recipe each DDP rank keeps its own amax histories:
    wrap ``model`` (or a module inside it) in DDP, not a parent it is part of, which would
    broadcast rank 0's histories to every rank before each forward.

    Args:
        model: the model; a bare nn.Linear is returned converted (it cannot be swapped
            inside itself).
        recipe: "tensorwise", "delayed", "rowwise", a Recipe, or a Float8Config;
            ``Float8Config(emulate=False)`` on a device without fp8 tensor cores raises
            RuntimeError before any swap.
        module_filter: ``module_filter(linear, fqn) -> bool``; False keeps that layer.

    Returns:
        The model.

    Example:
        >>> m = convert_to_fp8(nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 10)))
        >>> [type(layer).__name__ for layer in m]
        ['Float8Linear', 'Linear']
    """
    config = Float8Config.coerce(recipe)
    if not isinstance(model, nn.Module):
        raise TypeError(f"convert_to_fp8 needs an nn.Module, got {type(model).__name__}")
    _check_filter(module_filter)
    if isinstance(model, nn.Linear) and not isinstance(model, Float8Linear):
        reason = _skip_reason(model, "", module_filter)
        if reason is not None:
            logger.info("convert_to_fp8: kept the model (%s) as it is: %s",
                        type(model).__name__, reason)
            if module_filter is None:
                _warn_nothing_converted(model, [("", reason)])
            return model
        _check_devices(config, [model])
        converted = Float8Linear.from_linear(model, config)
        move_hooks(model, converted)  # as for a nested layer (O2's fp32 state-dict hooks)
        return _histories_per_rank(converted)
    _refuse_other_recipes(model, config, module_filter)
    swaps, skips = _plan(model, module_filter)
    _check_devices(config, [linear for _, _, linear in swaps])
    converted: dict[int, Float8Linear] = {}  # one layer used in several slots stays one layer
    for parent, name, linear in swaps:
        if id(linear) not in converted:
            converted[id(linear)] = Float8Linear.from_linear(linear, config)
            # initialize's fp32 state-dict hooks (O2/O3) and the user's own hooks go along.
            move_hooks(linear, converted[id(linear)])
        setattr(parent, name, converted[id(linear)])
    for fqn, reason in skips:
        logger.info("convert_to_fp8: kept %s as nn.Linear: %s", fqn, reason)
    logger.info("convert_to_fp8: %d linear layer(s) now %s fp8, %d kept",
                len(converted), config.short, len(skips))  # a layer in two slots counts once
    if (not converted and module_filter is None
            and not any(isinstance(m, Float8Linear) for m in model.modules())):
        _warn_nothing_converted(model, skips)
    return _histories_per_rank(model)


def _warn_nothing_converted(model: nn.Module, skips: list[tuple[str, str]]) -> None:
    """A call that left every layer as it was is said out loud, not only at INFO: the user
    asked for fp8 and would otherwise train in full precision unawares."""
    name = type(model).__name__
    if not skips:
        message = (f"convert_to_fp8: {name} has no nn.Linear layer, so nothing in it runs in "
                   "fp8; only nn.Linear layers are swapped (transformers' Conv1D, for one, is "
                   "not an nn.Linear)")
    else:
        fqn, reason = skips[0]
        what = f"{fqn!r} was kept" if fqn else "it was kept as it is"
        message = (f"convert_to_fp8: none of the {len(skips)} nn.Linear layer(s) of {name} "
                   f"could be swapped, so nothing in it runs in fp8; {what}: {reason}")
    warn_once(("fp8-nothing-converted", message), message)


def _check_filter(module_filter: Any) -> None:
    if module_filter is None:
        return
    valid = "valid: a callable (module, fqn) -> bool, or None"
    if not callable(module_filter):
        raise TypeError(f"module_filter must be a callable (module, fqn) -> bool or None, "
                        f"got {module_filter!r}")
    try:
        signature = inspect.signature(module_filter)
    except (TypeError, ValueError):  # a builtin without one: called as it is
        return
    try:
        signature.bind(None, "")
    except TypeError as err:
        raise TypeError(f"module_filter {module_filter!r} cannot be called with (module, fqn): "
                        f"{err}; {valid}") from None


def _histories_per_rank(model: nn.Module) -> nn.Module:
    """Keep the delayed recipe's amax histories out of DDP's buffer broadcast, whichever
    of ``model``'s modules DDP wraps: DDP sends rank 0's buffers to every rank before each
    forward, and a rank would then scale its activations and gradients by rank 0's amaxes
    (and saturate where its own are larger). Each rank keeps the history of what it saw."""
    histories = [name for name, _ in model.named_buffers() if ".amax_history_" in f".{name}"]
    if not histories:
        return model
    # Each history under every module above it (its name relative to that module): one
    # pass over the names' prefixes, not over every name per module.
    under: dict[str, list[str]] = {}
    for name in histories:
        parts = name.split(".")
        for i in range(len(parts)):
            under.setdefault(".".join(parts[:i]), []).append(".".join(parts[i:]))
    for prefix, module in model.named_modules():
        ddp_ignore(module, under.get(prefix, []))
    return model


def _refuse_other_recipes(model: nn.Module, config: Float8Config,
                          module_filter: Optional[ModuleFilter]) -> None:
    """Converting again with the same config is a no-op; a layer this call selects that
    is fp8 with another config already would silently keep it: refused, naming them."""
    other = [(name, module.config) for name, module in model.named_modules()
             if isinstance(module, Float8Linear) and module.config != config
             and (module_filter is None or module_filter(module, name))]
    if other:
        # The recipe names them apart; where only other settings differ, the whole config.
        label = {cfg: cfg.short if cfg.short != config.short else repr(cfg) for _, cfg in other}
        names = ", ".join(f"{name!r} ({label[cfg]})" for name, cfg in other[:4])
        more = f" and {len(other) - 4} more" if len(other) > 4 else ""
        asked = repr(config) if any(cfg.short == config.short for _, cfg in other) else config.short
        raise ValueError(f"convert_to_fp8(recipe={asked}): layers already fp8 with another "
                         f"config would stay so: {names}{more}; valid: the same config again "
                         "(a no-op), a module_filter that leaves them out (per-layer recipes), "
                         "or a model not converted yet")


def _delayed_layers(model: nn.Module) -> dict[str, Float8Linear]:
    """The delayed-recipe Float8Linear layers of ``model`` by name (a shared one once)."""
    return {name: module for name, module in model.named_modules()
            if isinstance(module, Float8Linear) and module.config.recipe is Recipe.DELAYED}


def fp8_state_dict(model: nn.Module) -> dict[str, dict[str, Any]]:
    """The delayed-scaling state of every Float8Linear in ``model``, by module name.

    Not part of ``model.state_dict()`` (whose keys stay those of the original model);
    save it beside it to resume a delayed-recipe run exactly.

    Example:
        >>> m = convert_to_fp8(nn.Sequential(nn.Linear(32, 32)), recipe="delayed")
        >>> sorted(fp8_state_dict(m)["0"])
        ['amax_history_grad_output', 'amax_history_input', 'amax_history_weight', 'started']
    """
    return {name: layer.fp8_state_dict() for name, layer in _delayed_layers(model).items()}


def load_fp8_state_dict(model: nn.Module, state: dict[str, dict[str, Any]]) -> None:
    """Restore what :func:`fp8_state_dict` saved.

    Every entry is checked before any is loaded: the layer names, each layer's keys,
    amax histories (float32, ``amax_history_len`` long, finite, >= 0) and ``started``
    flags (bool). A bad entry raises ValueError or TypeError naming it, and the model is
    left as it was.
    """
    layers = _delayed_layers(model)
    if not isinstance(state, dict) or set(state) != set(layers):
        got = sorted(state, key=str) if isinstance(state, dict) else type(state).__name__
        raise ValueError(f"fp8 state has modules {got}; valid: exactly {sorted(layers)} "
                         "(the delayed-recipe Float8Linear layers of this model)")
    for name, layer in layers.items():
        layer.check_fp8_state_dict(state[name], where=f"fp8 state[{name!r}]")
    for name, layer in layers.items():
        layer.load_fp8_state_dict(state[name])
