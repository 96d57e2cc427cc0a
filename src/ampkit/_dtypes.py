"""Dtype names and aliases, per-device defaults, and hardware capability.

This is the one module that knows about hardware: every other module asks here
whether a device runs bf16, fp16 or fp8 natively, and which device to use when
the caller did not say.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from collections import abc
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Union

import torch

from . import _torch_compat

DtypeLike = Union[torch.dtype, str]

# One alias table for every dtype ampkit accepts by name (jmp-style).
_ALIASES: dict[str, torch.dtype] = {
    "f32": torch.float32, "fp32": torch.float32, "float32": torch.float32, "float": torch.float32,
    "f16": torch.float16, "fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
}
# Canonical short name of each dtype, used by str(Policy).
_SHORT: dict[torch.dtype, str] = {
    torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16",
}
HALF_DTYPES: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16)
FLOAT_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16)
_DTYPE_NAMES = "fp16/float16/half, bf16/bfloat16, fp32/float32/float"


def resolve_dtype(value: DtypeLike, *, allowed: tuple[torch.dtype, ...] = FLOAT_DTYPES,
                  what: str = "dtype") -> torch.dtype:
    """Turn a dtype or one of its names into a torch.dtype that is in ``allowed``.

    Example: ``resolve_dtype("bf16") is torch.bfloat16``.
    """
    if isinstance(value, str):
        dtype = _ALIASES.get(value.strip().lower())
        if dtype is None:
            raise ValueError(f"unknown {what} {value!r}; valid names: {_valid_names(allowed)}")
    elif isinstance(value, torch.dtype):
        dtype = value
    else:
        raise TypeError(f"{what} must be a torch.dtype or a name, got {type(value).__name__} "
                        f"{value!r}; valid names: {_valid_names(allowed)}")
    if dtype not in allowed:
        raise ValueError(f"{what} {value!r} is not allowed here; valid: {_valid_names(allowed)}")
    return dtype


def _valid_names(allowed: tuple[torch.dtype, ...]) -> str:
    names = [name for name, d in _ALIASES.items() if d in allowed]
    return ", ".join(names) if names else _DTYPE_NAMES


# Tensor.float() and its siblings run the same op as Tensor.to(dtype) (aten._to_copy, the
# same autograd node, ``self`` back when nothing changes) for about 60% of its host time:
# ``to`` parses its arguments against several signatures. The casts made every forward
# (inputs, outputs, fp32 regions) use them.
_CAST_METHODS: dict[torch.dtype, Any] = {
    torch.float32: torch.Tensor.float, torch.float16: torch.Tensor.half,
    torch.bfloat16: torch.Tensor.bfloat16, torch.float64: torch.Tensor.double,
}


def cast_tensor(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``tensor.to(dtype)``, at less host cost for the common float dtypes."""
    method = _CAST_METHODS.get(dtype)
    return tensor.to(dtype) if method is None else method(tensor)


def cast_tree(obj: Any, dtype: torch.dtype,
              sources: Optional[tuple[torch.dtype, ...]] = None) -> Any:
    """Cast the floating tensors in ``obj`` (nested lists, tuples, namedtuples, dicts,
    dataclass instances).

    Args:
        obj: a tensor or a nest of them; anything else passes through.
        dtype: the target dtype.
        sources: only tensors of these dtypes are cast (None: every floating tensor).

    Returns:
        ``obj`` with its tensors cast, rebuilt as :func:`map_tensors` rebuilds it: new
        containers, a dataclass instance copied without running its ``__init__`` (itself
        when none of its tensors is cast); ``obj``'s own containers are never changed.

    Example:
        >>> cast_tree({"x": [torch.ones(1)], "n": 3}, torch.float16)["x"][0].dtype
        torch.float16
    """
    def cast(tensor: torch.Tensor) -> torch.Tensor:
        wanted = tensor.is_floating_point() if sources is None else tensor.dtype in sources
        return cast_tensor(tensor, dtype) if wanted and tensor.dtype != dtype else tensor
    return cast(obj) if isinstance(obj, torch.Tensor) else map_tensors(obj, cast)


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """``obj`` with ``fn(t)`` in place of each tensor ``t`` in it: the one walker that
    rebuilds (cast_tree, inspect's detach, autotune's move to the device).

    Lists, tuples, namedtuples and dicts come back as new containers of their own type (a
    dict subclass as a refilled copy: a defaultdict keeps its factory; a dict that is also
    a dataclass, like transformers' ModelOutput, as a mapping). Any other mapping (a
    ``collections.UserDict`` such as transformers' ``BatchEncoding``) comes back as itself
    when ``fn`` changed none of its values, else as a refilled copy of its type (a plain
    dict where it cannot be copied or set). A dataclass instance,
    frozen or not, comes back as itself when ``fn`` changed nothing in it, else as
    ``copy.copy`` of it with every field (``init=False`` ones too) set to its mapped value:
    its ``__init__`` and ``__post_init__`` do not run again, so a field set after
    construction, an ``InitVar`` or a subclass's own ``__init__`` cannot get in the way.
    Each dataclass instance is walked once: met again, it maps to the same result; met
    again while it is being walked (a cycle, such as a parent pointer), it stays the
    caller's original. ``obj``'s own containers and instances are never changed.

    Example:
        >>> map_tensors([torch.ones(1), 3], lambda t: t * 2)
        [tensor([2.]), 3]
    """
    return _map(obj, fn, {})


def _map(obj: Any, fn: Callable[[torch.Tensor], Any], memo: dict[int, Any]) -> Any:
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if type(obj) in _LEAVES:
        return obj
    if isinstance(obj, (list, tuple)):
        items = [_map(v, fn, memo) for v in obj]
        if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a namedtuple
            return type(obj)(*items)
        return items if type(obj) is list else type(obj)(items)
    # Dicts before dataclasses: a dict that is one too (transformers' ModelOutput) is
    # rebuilt as a mapping, as before.
    if isinstance(obj, dict):
        mapped = {k: _map(v, fn, memo) for k, v in obj.items()}
        return mapped if type(obj) is dict else _rebuild_mapping(obj, mapped)
    if _is_dataclass_instance(obj):
        return _map_dataclass(obj, fn, memo)
    if isinstance(obj, abc.Mapping):  # a UserDict (transformers' BatchEncoding), a proxy
        mapped = {k: _map(v, fn, memo) for k, v in obj.items()}
        if all(value is obj[key] for key, value in mapped.items()):
            return obj
        return _rebuild_mapping(obj, mapped)
    return obj


def _map_dataclass(obj: Any, fn: Callable[[torch.Tensor], Any], memo: dict[int, Any]) -> Any:
    """``obj`` itself when no field changed, else a copy with the changed fields set.

    ``memo`` maps the id of each instance walked so far to its result (to ``obj`` itself
    while it is being walked); the instances are alive, held by the tree being walked,
    so no id is reused during the walk.
    """
    if id(obj) in memo:
        return memo[id(obj)]
    memo[id(obj)] = obj
    changed = {}
    for name in _field_names(obj):
        value = getattr(obj, name, _UNSET)  # an init=False field never set has no value
        mapped = value if value is _UNSET else _map(value, fn, memo)
        if mapped is not value:
            changed[name] = mapped
    result = obj
    if changed:
        result = copy.copy(obj)  # __new__ and the instance's state: no __init__ runs
        for name, value in changed.items():
            object.__setattr__(result, name, value)  # a frozen dataclass's too
    memo[id(obj)] = result
    return result


def iter_tensors(obj: Any) -> Iterator[torch.Tensor]:
    """The tensors in ``obj`` (nested lists, tuples, dicts, dataclass instances' fields),
    in order: the one reading walker. It walks what :func:`map_tensors` walks, each
    dataclass instance once (a cycle ends there)."""
    return _iter(obj, set())


def _iter(obj: Any, seen: set[int]) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif type(obj) in _LEAVES:
        return
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _iter(item, seen)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _iter(item, seen)
    elif _is_dataclass_instance(obj):
        if id(obj) not in seen:
            seen.add(id(obj))
            for name in _field_names(obj):
                yield from _iter(getattr(obj, name, None), seen)
    elif isinstance(obj, abc.Mapping):
        for item in obj.values():
            yield from _iter(item, seen)


_UNSET = object()
# The leaves met most (a forward's flags, sizes, names, dtypes), by exact type, answered
# before any other check: the walkers run on every converted forward, kept-module call and
# registered-override call, where each check on a leaf is host time on every step.
_LEAVES = frozenset({type(None), bool, int, float, str, torch.dtype, torch.device})


def _is_dataclass_instance(obj: Any) -> bool:
    # dataclasses.is_dataclass's own test, on the type: a dataclass class is no instance.
    return hasattr(type(obj), "__dataclass_fields__")


def _field_names(obj: Any) -> list[str]:
    """Every field of a dataclass instance, ``init=False`` ones too (not ``InitVar``s)."""
    return [f.name for f in dataclasses.fields(obj)]


def _rebuild_mapping(original: abc.Mapping, cast: dict) -> abc.Mapping:
    """A mapping of ``original``'s type holding ``cast`` (same keys): a copy with the
    changed items set one by one, so a defaultdict keeps its factory and transformers'
    ``ModelOutput`` (whose ``update`` and ``pop`` raise, and whose item assignment sets
    the attribute too) stays one. A plain dict where the type cannot be copied or set, or
    where its copy shares the original's storage (setting it changed the caller's
    mapping: that item is put back)."""
    try:
        rebuilt = copy.copy(original)  # the subclass and its state (default_factory, ...)
        for key, value in cast.items():
            old = original[key]
            if value is not old:
                rebuilt[key] = value
                if original[key] is value:  # the write reached it: one storage; undone
                    original[key] = old
                    return cast
        return rebuilt
    except Exception:  # noqa: BLE001 - a mapping that cannot be copied or set
        return cast


def short_name(dtype: torch.dtype) -> str:
    """The canonical short name of a floating dtype ("f32", "f16", "bf16")."""
    return _SHORT[dtype]


def default_device_type() -> str:
    """The device type ampkit uses when none is given: "cuda" when available, else "cpu"."""
    return "cuda" if torch.cuda.is_available() else "cpu"


class UnknownDeviceTypeError(ValueError, RuntimeError):
    """An unknown device type: a ValueError, and the RuntimeError torch raises for one."""


def check_device_type(device_type: str) -> str:
    """Validate a device type name (e.g. "cpu", "cuda") against what torch knows."""
    if not isinstance(device_type, str):
        raise TypeError(f"device_type must be a str such as 'cpu' or 'cuda', got {device_type!r}")
    try:
        return torch.device(device_type).type
    except RuntimeError as err:
        raise UnknownDeviceTypeError(f"unknown device type {device_type!r}; valid: 'cpu', 'cuda', "
                                     f"'xpu', 'mps', ... (any torch device type)") from err


def autocast_default_dtype(device_type: str) -> torch.dtype:
    """torch's default autocast dtype for a device type (fp16 on CUDA, bf16 on CPU)."""
    try:
        return _torch_compat.get_autocast_dtype(device_type)
    except RuntimeError:  # a device type without autocast
        return torch.float16 if device_type == "cuda" else torch.bfloat16


@dataclass(frozen=True)
class Capability:
    """What a device runs natively: half dtypes and fp8 matmuls."""

    device: str
    name: str
    bf16: bool
    fp16: bool
    fp8: bool
    compute_capability: int = 0  # CUDA's major * 10 + minor (90: Hopper); 0 elsewhere


@functools.lru_cache(maxsize=None)
def capability(device: Optional[str] = None) -> Capability:
    """Detect native bf16 / fp16 / fp8 support of a device (cached per device).

    CUDA: bf16 from compute capability 8.0, fp16 tensor cores from 7.0, fp8 from 8.9.
    CPU: bf16 with AVX512-BF16 or AMX-BF16, fp16 with AVX512-FP16 or AMX-FP16;
    fp8 matmuls have no CPU hardware (ampkit emulates them there).
    """
    dev = torch.device(device or default_device_type())
    if dev.type == "cuda":
        major, minor = torch.cuda.get_device_capability(dev)
        cc = major * 10 + minor
        return Capability(str(dev), torch.cuda.get_device_name(dev), cc >= 80, cc >= 70, cc >= 89, cc)
    if dev.type == "cpu":
        flags = _cpu_flags()
        bf16 = bool(flags.get("avx512_bf16") or flags.get("amx_bf16"))
        fp16 = bool(flags.get("avx512_fp16") or flags.get("amx_fp16"))
        return Capability("cpu", str(flags.get("cpu_name", "cpu")), bf16, fp16, False)
    return Capability(str(dev), dev.type, False, False, False)


def _cpu_flags() -> dict:
    return _torch_compat.cpu_capabilities()  # {} where torch cannot say: no half hardware assumed


def autocast_output_dtype(x: torch.Tensor) -> torch.dtype:
    """What a low-precision-listed op (a matmul, attention) returns for input ``x``: the
    autocast dtype inside an autocast region of x's device, else x's own dtype (float64
    too: autocast casts no fp64 tensor, so an fp64 op stays fp64)."""
    device_type = x.device.type
    if (x.dtype != torch.float64 and has_autocast(device_type)
            and _torch_compat.is_autocast_enabled(device_type)):
        return _torch_compat.get_autocast_dtype(device_type)
    return x.dtype  # also on a device without autocast (meta)


def to_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t.to(dtype)``, but never a no-op ``.to`` returning ``t`` itself.

    torch 2.11's dynamo mistraces an autograd.Function whose output is such an alias of
    an intermediate: the gradient reaching backward is all zeros (weight grads of 0 under
    torch.compile). Skipping the no-op call keeps the graph plain on every version.
    """
    return t if t.dtype == dtype else t.to(dtype)


def has_autocast(device_type: str) -> bool:
    """Whether torch.autocast takes this device type (meta does not). Assumed while
    torch.compile traces (its fake tensors have real device types): torch 2.11's dynamo
    cannot trace the check."""
    return _torch_compat.is_compiling() or torch.amp.is_autocast_available(device_type)


def fp8_supported(device: Optional[str] = None) -> bool:
    """True when the device has fp8 tensor cores that ``torch._scaled_mm`` can use."""
    dev = torch.device(device or default_device_type())
    return dev.type == "cuda" and capability(str(dev)).fp8  # _scaled_mm: every supported torch


# --- the policy for this device: one table, read by `ampkit info`/`train` (recommend_policy),
# `ampkit bench` (its default policies) and autotune (its candidates) -------------------------
# Per half dtype: its mixed policy, its O2, and why the mixed one is recommended where the
# device runs that dtype natively (bf16 first: fp32's exponent range, so no loss scaling).
_HALF_POLICIES = {"bf16": ("bf16-mixed", "O2-bf16"), "fp16": ("16-mixed", "O2-fp16")}
_REASONS = {
    ("cuda", "bf16"): "bf16 tensor cores and fp32's exponent range: no loss scaling needed",
    ("cuda", "fp16"): "fp16 tensor cores but no bf16: autocast fp16 with dynamic loss scaling",
    ("cpu", "bf16"): ("this CPU has bf16 instructions (AVX512-BF16/AMX): large bf16 matmuls run "
                      "faster than fp32, small models may not gain (`ampkit bench` measures it)"),
}
_NO_HALF = ("no native bf16/fp16 arithmetic on this device: half-precision matmuls run many "
            "times slower than fp32 here")


@dataclass(frozen=True)
class DevicePolicies:
    """What a device runs: the policy to use, autotune's candidates, bench's comparison.

    Attributes:
        device: the device they are for ("cpu", "cuda:0").
        recommended: the policy to use without measuring, and ``reason``, why.
        candidates: the policies the device runs natively, fp32 first (autotune's default
            candidates, ``ampkit bench --policies auto``), "fp8" where there are fp8 tensor
            cores (autotune: fp8 only in the layers measured faster; bench: every layer).
        bench: what ``ampkit bench`` compares by default: fp32, the device's half dtypes
            (on a CPU its autocast dtype even without hardware, to show what it costs), O2
            in the autocast dtype, and fp8 where there are fp8 tensor cores.

    Example:
        >>> device_policies("cpu").candidates[0]
        '32-true'
    """

    device: str
    recommended: str
    reason: str
    candidates: tuple[str, ...]
    bench: tuple[str, ...]


def device_policies(device: Optional[str] = None) -> DevicePolicies:
    """The one table of which policies a device runs, recommends and compares."""
    cap = capability(device)
    kind = torch.device(cap.device).type
    # The half dtypes that pay off here, preferred first: those with a reason in the table
    # (fp16 on a CPU is not: its AVX512-FP16 is not what torch's CPU kernels use).
    native = [name for name, ok in (("bf16", cap.bf16), ("fp16", cap.fp16))
              if ok and (kind, name) in _REASONS]
    recommended = _HALF_POLICIES[native[0]][0] if native else "32-true"
    reason = _REASONS[(kind, native[0])] if native else _NO_HALF
    candidates = ("32-true",) + tuple(p for name in native for p in _HALF_POLICIES[name])
    if fp8_supported(cap.device):
        candidates += ("fp8",)  # autotune converts only the layers measured faster in fp8
    if kind == "cuda":
        shown = ["16-mixed"] + (["bf16-mixed"] if cap.bf16 else []) + ["O2"]
        shown += ["fp8"] if fp8_supported(cap.device) else []
    else:
        shown = ["bf16-mixed", "O2"]  # O2 in the CPU's autocast dtype, bf16
    return DevicePolicies(cap.device, recommended, reason, candidates, ("32-true", *shown))


def recommend_policy(device: Optional[str] = None) -> tuple[str, str]:
    """The policy ampkit recommends on a device and the reason, e.g. ("bf16-mixed", "...")."""
    table = device_policies(device)
    return table.recommended, table.reason
