"""FP8 all-gather under FSDP2: Float8Linear weights travel in fp8, not in bf16 or fp32.

A tensorwise Float8Linear casts its whole weight to e4m3 with one scale before every
matmul. Under FSDP2 that cast can happen on the shards instead, before the all-gather:
each rank casts its shard with the scale of the *global* amax (one all-reduce of the
amaxes of an FSDP2 group's fp8 weights per gather), and the ranks exchange 1 byte per
element instead of 2 (bf16) or 4 (fp32). The gathered weight is then exactly the fp8 tensor the unsharded layer would
have cast from the same fp32 values (the cast is elementwise and the scale the same), so
the layer's matmuls do not change.

Two tensor subclasses carry this through FSDP2's extension points
(``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``):

- :class:`Fp8ShardedWeight` wraps the high-precision weight a rank keeps (the local
  tensor of the sharded DTensor parameter, which the optimizer steps). Every op on it
  runs on the wrapped tensor; the few that FSDP2 uses to lay out and pad shards return
  the wrapper again, all others a plain tensor, so optimizer state stays plain.
- :class:`Fp8GatheredWeight` is the all-gathered weight: fp8 data and its inverse
  scale, presenting the dtype FSDP2 would have gathered (``param_dtype``). A
  Float8Linear uses its fp8 data as is; any other op sees the dequantized tensor.

Only the tensorwise recipe gathers in fp8: the rowwise recipe scales the weight along
both of its dimensions (the backward needs the high-precision weight) and the delayed
recipe pushes the weight's amax into its history once per forward, which a gather
repeated in the backward would do twice.
"""

from __future__ import annotations

import weakref
from typing import Any, Optional, Sequence

import torch
from torch import Tensor

from .._torch_compat import (TORCH_VERSION, aten_to_copy, disabled_torch_function_impl,
                             local_parameters, make_wrapper_subclass, op_mutates,
                             register_load_state_dict_pre_hook, register_state_dict_post_hook,
                             tree_leaves, tree_map_only)
from .scaling import E4M3, Fp8, amax_to_scale, compute_amax, dequantize, quantize

aten = torch.ops.aten

# Ops FSDP2 applies to a sharded parameter to move, pad, slice and lay out its shards
# (and ``Module.to_empty`` to materialize one from the meta device): their results stay
# wrapped, so the padded local shard keeps the all-gather hooks. Every other op (the
# optimizer's arithmetic, zeros_like for its state, clone) returns plain tensors.
_SHARD_LAYOUT_OPS = frozenset({
    aten.new_zeros.default, aten.new_empty.default, aten.empty_like.default,
    aten.slice.Tensor, aten.copy_.default,
    aten.view.default, aten.as_strided.default, aten.split.Tensor, aten.detach.default,
    aten.alias.default, aten.narrow.default,
    # fully_shard moves a CPU-built model's parameters to the mesh's device (.to()), and
    # Module.to()/.half() after sharding apply it too: the moved shard keeps the hooks.
    aten_to_copy,
})
# Ops that only re-view the gathered fp8 data: applied to it, the scale kept.
_GATHERED_VIEW_OPS = frozenset({
    aten.as_strided.default, aten.view.default, aten.detach.default, aten.alias.default,
})


# torch 2.5's FSDP2 calls fsdp_pre_all_gather with the mesh alone and refuses the hooks on
# shards of uneven size on the ranks that hold one (the others then wait for ever):
# gathers stay in the policy's dtype there.
FP8_ALL_GATHER_SINCE = (2, 6)


class Fp8ShardedWeight(Tensor):
    """A rank's shard of a tensorwise Float8Linear weight that FSDP2 gathers in fp8.

    It behaves as the high-precision tensor it wraps (same shape, dtype and values); only
    FSDP2's all-gather sees the difference.

    Args:
        tensor: the high-precision weight (or shard), fp32/bf16/fp16.
        margin: the layer's ``Float8Config.margin`` (its scale is ``2**margin`` lower).
    """

    _tensor: Tensor
    _margin: int
    __torch_function__ = disabled_torch_function_impl

    @staticmethod
    def __new__(cls, tensor: Tensor, margin: int = 0) -> "Fp8ShardedWeight":
        return make_wrapper_subclass(
            cls, tensor.size(), strides=tensor.stride(), storage_offset=tensor.storage_offset(),
            dtype=tensor.dtype, layout=tensor.layout, device=tensor.device,
            requires_grad=tensor.requires_grad)

    def __init__(self, tensor: Tensor, margin: int = 0) -> None:
        self._tensor = tensor
        self._margin = margin

    def __repr__(self) -> str:  # type: ignore[override]
        return f"Fp8ShardedWeight({self._tensor!r}, margin={self._margin})"

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        margins = [t._margin for t in tree_leaves((args, kwargs)) if isinstance(t, cls)]
        args, kwargs = tree_map_only(cls, lambda t: t._tensor, (args, kwargs or {}))
        out = func(*args, **kwargs)
        if func not in _SHARD_LAYOUT_OPS:
            return out
        return tree_map_only(Tensor, lambda t: cls(t, margins[0]), out)

    # What torch refuses for tensor subclasses, done by the tensor it wraps: a plain
    # tensor's values, and pickling (torch.save) as that plain tensor, which
    # torch.load(weights_only=True) reads without ampkit.
    def tolist(self) -> Any:  # type: ignore[override]
        return self._tensor.tolist()

    def numpy(self, *, force: bool = False) -> Any:  # type: ignore[override]
        return self._tensor.numpy(force=force)

    def __reduce_ex__(self, protocol: Any) -> Any:
        return self._tensor.__reduce_ex__(protocol)

    def __tensor_flatten__(self) -> tuple[list[str], int]:
        return ["_tensor"], self._margin

    @staticmethod
    def __tensor_unflatten__(inner: dict[str, Tensor], margin: int, outer_size: Any,
                             outer_stride: Any) -> "Fp8ShardedWeight":
        return Fp8ShardedWeight(inner["_tensor"], margin)

    def fsdp_pre_all_gather(self, mesh: Any, outer_size: Optional[torch.Size] = None,
                            outer_stride: Any = None, module: Any = None,
                            mp_policy: Any = None) -> tuple[tuple[Tensor, ...], Tensor]:
        """FSDP2's hook before the all-gather: this shard in e4m3, scaled by the amax of
        the whole weight, padded to FSDP2's shard size; the inverse scale rides along as
        metadata. The data travels as uint8 (fp8's bytes), which every backend gathers.
        """
        # FSDP2 shards along the mesh's last dimension (the first holds HSDP's replicas,
        # which have the same values): the amax of the whole weight is the max over it.
        group = mesh.get_group(mesh.ndim - 1)
        local = self._tensor
        batch = _BATCHES.get(module) if module is not None else None
        amax = batch.amax(module, local, group) if batch is not None else _global_amaxes([local], group)[0]
        # The layer's own cast (scaling.quantize), with the whole weight's scale.
        data, inv_scale = quantize(local, E4M3, scale=amax_to_scale(amax, E4M3, self._margin))
        if outer_size is not None:
            rows = -(-outer_size[0] // group.size())  # every shard padded to this many rows
            if data.shape[0] != rows:
                padded = data.new_zeros((rows, *data.shape[1:]))
                padded[: data.shape[0]] = data
                data = padded
        return (data.view(torch.uint8),), inv_scale

    def fsdp_post_all_gather(self, outputs: tuple[Tensor, ...], inv_scale: Tensor,
                             param_dtype: torch.dtype, *,
                             out: Optional[Tensor] = None) -> Any:
        """FSDP2's hook after the all-gather: the gathered bytes as an
        :class:`Fp8GatheredWeight` of ``param_dtype`` (and the buffers FSDP2 frees after
        use), or, on a later gather into the same buffer (``out``), its new scale."""
        (data,) = outputs
        data = data.view(E4M3)
        if out is not None:
            # FSDP2 refilled the buffer of the previous gather, which ``out`` views: only
            # the scale is new. A new tensor, not written into the old one: a forward
            # that saved the old scale for its backward keeps it (it is the same number
            # while the shard does not change between forward and backward).
            if not (isinstance(out, Fp8GatheredWeight) and out._data.untyped_storage().data_ptr()
                    == data.untyped_storage().data_ptr()):
                raise RuntimeError(f"fsdp_post_all_gather: out is a {type(out).__name__} that "
                                   "does not view this gather's buffer; expected the "
                                   "Fp8GatheredWeight of the previous gather into it")
            out._inv_scale = inv_scale
            return None
        return Fp8GatheredWeight(data, inv_scale, param_dtype), (data,)


def _global_amaxes(shards: list[Tensor], group: Any) -> list[Tensor]:
    """The amax of each whole weight from its shards on every rank: one all-reduce."""
    amaxes = torch.stack([compute_amax(t) if t.numel() else
                          torch.zeros((), dtype=torch.float32, device=t.device) for t in shards])
    torch.distributed.all_reduce(amaxes, op=torch.distributed.ReduceOp.MAX, group=group)
    return list(amaxes.unbind())


class _AmaxBatch:
    """The tensorwise fp8 weights of one FSDP2 group: one all-reduce for all their amaxes
    per gather instead of one per weight.

    FSDP2 gathers a group's parameters together, calling their pre-all-gather hooks one
    after another before the one all-gather (``_get_param_all_gather_inputs``): the first
    hook called reduces every member's amax, and each of the others takes its own once,
    so the reduced amaxes never outlive that gather. Every rank calls the hooks in the
    same order, so every rank reduces at the same call.
    """

    def __init__(self, modules: list[torch.nn.Module]) -> None:
        self.modules = [weakref.ref(module) for module in modules]
        self.ready: dict[int, Tensor] = {}  # id(layer) -> its amax, until its hook takes it

    def amax(self, module: torch.nn.Module, local: Tensor, group: Any) -> Tensor:
        ready = self.ready.pop(id(module), None)
        if ready is not None:
            return ready
        shards = [_shard_of(ref()) for ref in self.modules]
        if any(shard is None for shard in shards):  # a member not sharded now: on its own
            self.ready = {}
            return _global_amaxes([local], group)[0]
        amaxes = _global_amaxes(shards, group)  # type: ignore[arg-type]
        self.ready = {id(ref()): amax for ref, amax in zip(self.modules, amaxes)}
        return self.ready.pop(id(module))


def _shard_of(module: Optional[torch.nn.Module]) -> Optional[Tensor]:
    """The high-precision shard a sharded Float8Linear's weight wraps, None otherwise."""
    local = _dtensor_local(getattr(module, "weight", None))  # FSDP2's sharded parameter
    return local._tensor if isinstance(local, Fp8ShardedWeight) else None


# The batch of each layer whose weight gathers in fp8 (gather_in_fp8); weak keys: the
# layers' lifetimes are the model's.
_BATCHES: "weakref.WeakKeyDictionary[torch.nn.Module, _AmaxBatch]" = weakref.WeakKeyDictionary()


class Fp8GatheredWeight(Tensor):
    """An all-gathered tensorwise weight: e4m3 data and its fp32 inverse scale.

    It presents ``dtype`` (FSDP2's ``param_dtype``), so autograd gives it gradients of
    that dtype; ops other than re-views see its dequantized value.
    """

    _data: Tensor
    _inv_scale: Tensor
    __torch_function__ = disabled_torch_function_impl

    @staticmethod
    def __new__(cls, data: Tensor, inv_scale: Tensor, dtype: torch.dtype,
                requires_grad: bool = False) -> "Fp8GatheredWeight":
        return make_wrapper_subclass(
            cls, data.size(), strides=data.stride(), storage_offset=data.storage_offset(),
            dtype=dtype, device=data.device, requires_grad=requires_grad)

    def __init__(self, data: Tensor, inv_scale: Tensor, dtype: torch.dtype,
                 requires_grad: bool = False) -> None:
        self._data = data
        self._inv_scale = inv_scale

    def __repr__(self) -> str:  # type: ignore[override]
        return (f"Fp8GatheredWeight(shape={tuple(self.shape)}, dtype={self.dtype}, "
                f"inv_scale={self._inv_scale!r})")

    def fp8(self) -> Fp8:
        """The e4m3 data and inverse scale, as Float8Linear's matmuls take them."""
        return Fp8(self._data, self._inv_scale)

    def dequantize(self) -> Tensor:
        """The value it stands for, in its dtype."""
        return dequantize(self.fp8(), self.dtype)

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in _GATHERED_VIEW_OPS and isinstance(args[0], cls):
            self = args[0]
            data = func(self._data, *args[1:], **kwargs)
            return cls(data, self._inv_scale, self.dtype)
        if op_mutates(func):
            # Anything else sees a dequantized copy, where a write would be lost.
            raise RuntimeError(f"{func} would write into an all-gathered fp8 weight, a copy "
                               "that FSDP2 frees after use; valid: change the sharded "
                               "parameter (outside forward/backward, or after reshard())")
        args, kwargs = tree_map_only(cls, lambda t: t.dequantize(), (args, kwargs))
        return func(*args, **kwargs)

    def __tensor_flatten__(self) -> tuple[list[str], torch.dtype]:
        return ["_data", "_inv_scale"], self.dtype

    @staticmethod
    def __tensor_unflatten__(inner: dict[str, Tensor], dtype: torch.dtype, outer_size: Any,
                             outer_stride: Any) -> "Fp8GatheredWeight":
        return Fp8GatheredWeight(inner["_data"], inner["_inv_scale"], dtype)


def gather_in_fp8(model: torch.nn.Module, groups: Optional[Sequence[str]] = None) -> list[str]:
    """Wrap the weight of every tensorwise Float8Linear of ``model`` in an
    :class:`Fp8ShardedWeight`, before ``fully_shard``; the names of those layers.

    ``groups``: the names of the modules that become FSDP2 groups (the root is one too),
    exactly as ``fully_shard`` will be applied: the weights of one group then share one
    all-reduce of their amaxes per gather. None: each weight reduces its own.

    A weight that is also a parameter elsewhere (tied to an embedding, say) stays as it
    is: the other user would see its fp8 rounding. The Parameter objects are replaced
    (same values, dtype and ``requires_grad``): build the optimizer afterwards, as
    sharding requires anyway.
    """
    from .config import Recipe  # the config module is light; imported here to stay acyclic
    from .linear import Float8Linear

    if TORCH_VERSION < FP8_ALL_GATHER_SINCE:
        return []

    owners: dict[int, set[int]] = {}  # id(parameter) -> ids of the modules holding it
    for module in model.modules():
        for param in local_parameters(module).values():
            if param is not None:
                owners.setdefault(id(param), set()).add(id(module))
    names = []
    for name, module in model.named_modules():  # a layer used in two places: once
        if not isinstance(module, Float8Linear) or module.config.recipe is not Recipe.TENSORWISE:
            continue
        weight = module.weight
        if owners[id(weight)] != {id(module)} or isinstance(weight.data, Fp8ShardedWeight):
            continue
        module.weight = torch.nn.Parameter(Fp8ShardedWeight(weight.data, module.config.margin),
                                           requires_grad=weight.requires_grad)
        register_state_dict_post_hook(module, _plain_weight)
        register_load_state_dict_pre_hook(module, _wrapped_weight)
        names.append(name)
    if groups is None:
        return names
    by_group: dict[str, list[torch.nn.Module]] = {}
    for name in names:  # each layer in the innermost group holding it
        inside = [g for g in groups if name == g or name.startswith(g + ".")]
        by_group.setdefault(max(inside, key=len, default=""), []).append(model.get_submodule(name))
    for members in by_group.values():
        batch = _AmaxBatch(members)
        for member in members:
            _BATCHES[member] = batch
    return names


def unwrap(value: Any) -> Any:
    """``value`` with an :class:`Fp8ShardedWeight` inside it (as is, or as the local
    tensor of a DTensor) replaced by the tensor it wraps, sharing its storage."""
    if isinstance(value, Fp8ShardedWeight):
        return value._tensor
    local = _dtensor_local(value)
    return _with_local(value, local._tensor) if isinstance(local, Fp8ShardedWeight) else value


def _dtensor_local(value: Any) -> Optional[Tensor]:
    """A DTensor's local tensor (FSDP2's shard), None for anything else."""
    to_local = getattr(value, "to_local", None)
    if to_local is None:
        return None
    with torch.no_grad():
        return to_local()


def _with_local(value: Any, local: Tensor) -> Tensor:
    """The DTensor ``value`` (same mesh, placements, shape) over another local tensor."""
    from torch.distributed.tensor import DTensor  # imported already where shards exist

    with torch.no_grad():
        return DTensor.from_local(local, value.device_mesh, value.placements, run_check=False,
                                  shape=value.shape, stride=value.stride())


def _wrapped_weight(module: torch.nn.Module, state_dict: dict[str, Any], prefix: str,
                    *args: Any) -> None:
    # load_state_dict(assign=True) (torch's set_model_state_dict loading into a meta
    # model, for one) makes the loaded tensor the parameter: wrapped again, it keeps the
    # gather hooks FSDP2 has set itself up for (a plain one would gather in the policy's
    # dtype into buffers laid out for fp8 bytes). A copying load writes through it.
    key = prefix + "weight"
    local = _dtensor_local(state_dict.get(key))
    if local is not None and not isinstance(local, Fp8ShardedWeight):
        state_dict[key] = _with_local(state_dict[key], Fp8ShardedWeight(local, module.config.margin))


def _plain_weight(module: torch.nn.Module, state_dict: dict[str, Any], prefix: str,
                  local_metadata: Any) -> None:
    # Checkpoints hold plain tensors: they load with or without fp8 all-gather, and
    # without ampkit (torch.load's weights_only refuses unknown tensor classes).
    key = prefix + "weight"
    if key in state_dict:
        state_dict[key] = unwrap(state_dict[key])
