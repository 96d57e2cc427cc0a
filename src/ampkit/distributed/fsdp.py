"""FSDP2 under a policy: ``fsdp_policy`` (the MixedPrecisionPolicy) and ``shard``.

FSDP2 casts at module boundaries: each ``fully_shard`` group all-gathers its parameters
in ``param_dtype`` before its forward (and backward), casts the floating inputs of its
forward to that dtype, reduce-scatters the gradients in ``reduce_dtype`` and keeps the
sharded parameters, which the optimizer steps, in the dtype they had when sharded. So
a policy maps onto it as: compute dtype -> ``param_dtype``; sharded parameters fp32 for
the mixed policies and O2 (there they are the fp32 masters: no separate copy exists)
and half for the pure-half ones (O3, "16-true", "bf16-true"); gradients reduced in fp32.

Modules that stay fp32 (``ampkit.keep_fp32``'s selection, and batch norm where the
policy keeps it fp32) are each sharded as their own group with an fp32 policy whose
output is cast back to the compute dtype, so the half layers after them get what
they expect (as ``keep_fp32`` does in a single process outside autocast).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Optional, Union

import torch
from torch import nn

from .. import keep
from .._select import Matcher, Modules, Selector, as_selectors
from .._dtypes import FLOAT_DTYPES, HALF_DTYPES, resolve_dtype
from .._tables import warn_buffer_tables
from .._torch_compat import fsdp2
from .._sharding import is_sharded
from ..convert import BATCHNORM_TYPES, cast_model, conversion_of
from ..fp8.allgather import gather_in_fp8
from ..policy import Policy, get_policy

if TYPE_CHECKING:  # importing FSDP2 costs about a second: only where it is used
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

_CONTAINERS = (nn.ModuleList, nn.ModuleDict)  # no forward of their own for FSDP2 to hook


def fsdp_policy(policy: Union[Policy, str], *,
                reduce_dtype: Union[torch.dtype, str] = torch.float32) -> "MixedPrecisionPolicy":
    """The FSDP2 ``MixedPrecisionPolicy`` that carries out ``policy``.

    Args:
        policy: a Policy or any name ``ampkit.get_policy`` takes ("bf16-mixed", "O2", ...).
        reduce_dtype: dtype of the gradient reduce-scatter (fp32 by default: summing
            half gradients over many ranks loses their low bits).

    Returns:
        ``MixedPrecisionPolicy(param_dtype=compute dtype, reduce_dtype, output_dtype=the
        policy's output dtype)``; for a pure-fp32 policy one that casts nothing.

    Example:
        >>> fsdp_policy("bf16-mixed").param_dtype  # doctest: +SKIP
        torch.bfloat16
    """
    pol = get_policy(policy)
    reduce = resolve_dtype(reduce_dtype, allowed=FLOAT_DTYPES, what="reduce_dtype")
    mp_type = fsdp2().MixedPrecisionPolicy
    if pol.half_dtype is None:
        return mp_type(reduce_dtype=None if reduce == torch.float32 else reduce)
    return mp_type(param_dtype=pol.compute_dtype, reduce_dtype=reduce,
                   output_dtype=pol.output_dtype)


def shard(model: nn.Module, policy: Union[Policy, str], *, mesh: Optional["DeviceMesh"] = None,
          modules: Optional[Modules] = None, fp8_all_gather: bool = True) -> nn.Module:
    """Shard ``model`` with FSDP2 (``fully_shard``) per block and at the root, under ``policy``.

    Every rank calls it (``fully_shard`` builds the mesh from the process group). Build
    the optimizer over ``model.parameters()`` afterwards: they are the sharded DTensors.

    Args:
        model: an fp32 model, not yet sharded nor passed through ``ampkit.initialize``
            (on the meta device is fine: ``model.to_empty(...)`` after sharding).
        policy: a Policy or any name ``ampkit.get_policy`` takes.
        mesh: the DeviceMesh to shard over; None: all ranks of the default process group.
        modules: the blocks, each one ``fully_shard`` group: module names or fnmatch
            patterns over ``model.named_modules()`` ("layers.*", "encoder.block_?"; a
            module used under two names matches either), nn.Module subclasses, or
            callables ``(name, module) -> bool``: ``keep_fp32``'s selectors. A match
            inside another match joins it; a ModuleList or
            ModuleDict stands for its children. None: the children of the first
            non-empty nn.ModuleList in the model, else, where the model is an
            nn.Sequential, its children that hold parameters; ``[]``: the root group only.
        fp8_all_gather: the weights of tensorwise ``Float8Linear`` layers are cast to
            fp8 on each shard (with the scale of the whole weight's amax) and
            all-gathered in fp8: 1 byte per element instead of 2 or 4, and the same fp8
            weight the layer casts in one process (torch 2.6 or later). Other recipes,
            and a weight shared with another module, gather in the policy's dtype.
            False: every weight does. docs/distributed.md, "FP8 all-gather".

    Returns:
        ``model``, sharded in place (its class becomes an ``FSDPModule`` subclass).

    Raises:
        ValueError: an unknown policy, a pattern that matches no module, a model without
            blocks (a ModuleList, or a Sequential's layers) and no ``modules``, or an already sharded or
            initialized model; raised before anything changes.
        TypeError: a model, mesh, ``modules`` item or ``fp8_all_gather`` of the wrong
            type; raised before anything changes.

    Example:
        >>> model = shard(Transformer(), "bf16-mixed")  # doctest: +SKIP
        >>> optimizer = torch.optim.AdamW(model.parameters())  # doctest: +SKIP
    """
    pol = get_policy(policy)
    _check_model(model)
    _check_mesh(mesh)
    if not isinstance(fp8_all_gather, bool):
        raise TypeError(f"shard: fp8_all_gather={fp8_all_gather!r} is not a bool; valid: True "
                        "(tensorwise Float8Linear weights all-gathered in fp8) or False")
    blocks = _select_blocks(model, modules)
    kept = _fp32_units(model, pol)
    api = fsdp2()
    half_mp, fp32_mp, root_mp = _unit_policies(pol)
    if pol.param_dtype in HALF_DTYPES and not pol.master_weights:  # cast below
        # First: a kept module is an fp32 group of its own, so the group check below would
        # refuse the same tie with advice (one group for both) a kept module cannot take.
        keep.check_shared(model, keep.kept_names(model), pol.param_dtype)
    units = _ordered_units(blocks, kept)
    _check_shared(model, [name for name, _ in units])
    # Nothing was modified above this line.
    if pol.param_dtype in HALF_DTYPES and not pol.master_weights:
        # Pure-half policies (O3, "16-true"): the sharded parameters, which the optimizer
        # steps, are half themselves; fp32 modules and (if kept) batch norm stay fp32.
        warn_buffer_tables(model, keep.kept_names(model), pol.param_dtype)
        cast_model(model, pol.param_dtype,
                   keep_fp32=BATCHNORM_TYPES if pol.keep_batchnorm_fp32 else (),
                   keep_modules=keep.kept_modules(model))
    if fp8_all_gather:
        gather_in_fp8(model, groups=[name for name, _ in units])
    for name, fp32 in units:
        # Innermost first: a group made later leaves out the parameters of groups inside it.
        api.fully_shard(model.get_submodule(name), mesh=mesh,
                        mp_policy=fp32_mp if fp32 else half_mp)
    api.fully_shard(model, mesh=mesh, mp_policy=root_mp)
    return model


# --- validation: everything is checked before the model changes ------------------------------
def _check_model(model: Any) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"shard takes a torch.nn.Module, got {type(model).__name__} {model!r}")
    if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
        raise TypeError(f"model is wrapped in {type(model).__name__}; valid: the bare module "
                        "(shard replaces DDP: FSDP2 reduces the gradients itself)")
    if is_sharded(model):
        raise ValueError(f"{type(model).__name__} is already sharded (FSDP2 modules or DTensor "
                         "parameters); valid: an unsharded model, sharded once by shard")
    if conversion_of(model) is not None:
        raise ValueError(f"{type(model).__name__} went through ampkit.initialize; valid: the "
                         "fp32 model itself: shard applies the policy instead of initialize")


def _check_mesh(mesh: Any) -> None:
    import torch.distributed as dist

    if mesh is None:
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("shard(mesh=None) shards over the default process group, which "
                               "is not initialized; valid: call torch.distributed."
                               "init_process_group first (torchrun sets its environment), or "
                               "pass mesh=")
        return
    from torch.distributed.device_mesh import DeviceMesh

    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh={mesh!r} is not a DeviceMesh; valid: None (every rank of the "
                        "default group) or a torch.distributed.device_mesh.DeviceMesh")


# --- which modules become groups -----------------------------------------------------------
def _select_blocks(model: nn.Module, modules: Optional[Modules]) -> list[str]:
    """The names of the blocks: ``modules``' matches, or the first ModuleList's children."""
    named = [(name, module) for name, module in model.named_modules() if name]
    if modules is None:
        return _default_blocks(model, named)
    names: list[str] = []
    matcher = Matcher(model)
    for selector in as_selectors(modules, what="shard: modules item "):
        hits = [name for name in matcher.hits(selector) if name]
        if not hits:
            raise ValueError(f"shard: modules={_describe(selector)} matches no module of "
                             f"{type(model).__name__}; valid: names or fnmatch patterns over "
                             f"model.named_modules(), e.g. {_examples(named)}")
        if not any(_without_containers(model, name) for name in hits):
            raise ValueError(f"shard: modules={_describe(selector)} matches only empty "
                             f"containers ({', '.join(repr(n) for n in hits[:4])}), which stand "
                             "for their children and hold none to shard; valid: names or "
                             f"patterns of modules with parameters, e.g. {_examples(named)}")
        names += hits
    return _outermost(model, names)


def _default_blocks(model: nn.Module, named: list[tuple[str, nn.Module]]) -> list[str]:
    """The first non-empty ModuleList's children; for a model that is an nn.Sequential
    and holds no ModuleList, its children with parameters (its layers are its blocks)."""
    for name, module in named:
        if isinstance(module, nn.ModuleList) and len(module) > 0:
            return [f"{name}.{child}" for child, _ in module.named_children()]
    if isinstance(model, nn.Sequential):
        # Layers that share a parameter with another (tied embeddings) stay in the root.
        owners: dict[int, set[str]] = {}
        for name, child in model.named_children():
            for param in child.parameters():
                owners.setdefault(id(param), set()).add(name)
        layers = [name for name, child in model.named_children()
                  if next(child.parameters(), None) is not None
                  and all(len(owners[id(p)]) == 1 for p in child.parameters())]
        if layers:
            return layers
    raise ValueError(f"shard: {type(model).__name__} has no blocks to shard one by one (an "
                     "nn.ModuleList's children, or an nn.Sequential's layers, with modules=None); "
                     "valid: pass modules= names or fnmatch patterns, "
                     f"e.g. {_examples(named)}, or modules=[] for one group at the root")


def _fp32_units(model: nn.Module, pol: Policy) -> list[str]:
    """Modules that stay fp32 (keep_fp32's, batch norm if kept) and hold parameters."""
    if pol.half_dtype is None:
        return []
    names = keep.kept_names(model)
    if pol.keep_batchnorm_fp32:
        names += [name for name, module in model.named_modules()
                  if name and isinstance(module, BATCHNORM_TYPES)]
    return [name for name in _outermost(model, names)
            if any(True for _ in model.get_submodule(name).parameters())]


def _outermost(model: nn.Module, names: list[str]) -> list[str]:
    """``names`` in model order, containers replaced by their children, nested ones dropped."""
    expanded = set()
    for name in names:
        expanded.update(_without_containers(model, name))
    return [name for name, _ in model.named_modules()
            if name in expanded and not any(_inside(name, other) for other in expanded)]


def _without_containers(model: nn.Module, name: str) -> list[str]:
    module = model.get_submodule(name)
    if not isinstance(module, _CONTAINERS):
        return [name]
    return [leaf for child, _ in module.named_children()
            for leaf in _without_containers(model, f"{name}.{child}")]


def _check_shared(model: nn.Module, units: list[str]) -> None:
    """Refuse groups that split a shared parameter (tied weights): fully_shard would fail
    on the second group, with the first one sharded already."""
    # A name's group: its innermost prefix that is a unit, by identity (a unit reached by
    # a second name, ``self.dec = self.enc``, holds what is under either name).
    unit_of = {id(model.get_submodule(unit)): unit for unit in units}
    owner: dict[int, tuple[str, str]] = {}  # id(param) -> (its group, its name)
    for module_name, module in model.named_modules(remove_duplicate=False):
        parts = module_name.split(".") if module_name else []
        group = next((unit_of[id(sub)] for i in range(len(parts), 0, -1)
                      if id(sub := model.get_submodule(".".join(parts[:i]))) in unit_of), "")
        for param_name, param in module.named_parameters(recurse=False):
            name = f"{module_name}.{param_name}".strip(".")
            first = owner.setdefault(id(param), (group, name))
            if first[0] != group:
                raise ValueError(
                    f"shard: parameter {first[1]!r} is shared with {name!r}, but they would be "
                    f"in different groups ({first[0] or 'the root'!r} and {group or 'the root'!r}); "
                    "valid: modules= that puts both in one group, or leaves both to the root")


def _inside(name: str, other: str) -> bool:
    return name.startswith(other + ".")


def _ordered_units(blocks: list[str], kept: list[str]) -> list[tuple[str, bool]]:
    """(name, fp32) per group, innermost first; a block inside an fp32 module is fp32 with it."""
    units = [(name, True) for name in kept]
    units += [(name, False) for name in blocks
              if not any(name == k or _inside(name, k) for k in kept)]
    return sorted(units, key=lambda unit: -unit[0].count("."))


def _unit_policies(pol: Policy) -> tuple[Any, Any, Any]:
    """The MixedPrecisionPolicy of the blocks, of the fp32 modules, and of the root."""
    root = fsdp_policy(pol)
    # Blocks hand their output to the next block in the compute dtype; only the root
    # casts the model's output to the policy's output dtype (once, not per block).
    blocks = dataclasses.replace(root, output_dtype=None)
    half = pol.compute_dtype if pol.compute_dtype in HALF_DTYPES else None
    fp32 = fsdp2().MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32,
                                        output_dtype=half)
    return blocks, fp32, root


def _describe(selector: Selector) -> str:
    if isinstance(selector, str):
        return repr(selector)
    return getattr(selector, "__name__", repr(selector))


def _examples(named: list[tuple[str, nn.Module]]) -> str:
    return ", ".join(repr(name) for name, _ in named[:6]) or "none (the model has no submodules)"
