"""Precision policies: which dtype the parameters, the computation and the outputs use.

A :class:`Policy` is resolved once from a name (``get_policy``) and carries its behaviour:
what to cast where (:attr:`Policy.input_dtype`, :meth:`Policy.cast_outputs_to`), which
loss scaling (:attr:`Policy.loss_scaling`), whether fp32 masters exist. ``ampkit.apply``
applies it to models and optimizers, ``autocast`` to ops.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Optional, Union

import torch

from ._dtypes import FLOAT_DTYPES, HALF_DTYPES, resolve_dtype, short_name

LossScale = Union[float, str]
_F32, _F16, _BF16 = torch.float32, torch.float16, torch.bfloat16


@dataclass(frozen=True)
class LossScaling:
    """How a policy scales the loss: the one rule, decided from ``Policy.loss_scale``.

    ``"dynamic"``: apex's/torch's dynamic scale (grows after clean steps, backs off and
    skips the step on an overflow). A fixed number other than 1: static, as apex's static
    scale: the loss is multiplied and the gradients divided by it, nothing is checked or
    skipped (and no host sync is spent on checking). 1.0: none. The presets decide which:
    the apex opt levels O1/O2 and 16-mixed are dynamic in either half dtype (apex's
    contract), bf16-mixed and the pure-half policies use none (bf16 has fp32's exponent
    range, so it needs no scaling unless asked for).
    """

    kind: str  # "none", "static" or "dynamic"
    scale: float = 1.0

    @property
    def dynamic(self) -> bool:
        return self.kind == "dynamic"

    def __str__(self) -> str:
        return f"static {self.scale:g}" if self.kind == "static" else self.kind


@dataclass(frozen=True)
class Policy:
    """What precision where: parameters, compute, outputs, and what the opt levels add.

    Args:
        param_dtype: dtype the model's parameters are stored in.
        compute_dtype: dtype of the arithmetic (the autocast dtype when ``autocast``).
        output_dtype: dtype the model's floating outputs are cast to.
        autocast: ops choose their precision per op (torch autocast) instead of running
            in the parameters' dtype.
        master_weights: the optimizer steps fp32 copies of half parameters.
        keep_batchnorm_fp32: batch-norm layers stay fp32 when the model is cast to half.
        loss_scale: "dynamic" or a fixed positive scale (1.0: no scaling).

    Example:
        >>> get_policy("p=f32,c=bf16,o=f32").compute_dtype
        torch.bfloat16
    """

    param_dtype: torch.dtype = _F32
    compute_dtype: torch.dtype = _F32
    output_dtype: torch.dtype = _F32
    autocast: bool = False
    master_weights: bool = False
    keep_batchnorm_fp32: bool = True
    loss_scale: LossScale = 1.0
    name: Optional[str] = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        for attr in ("param_dtype", "compute_dtype", "output_dtype"):
            value = getattr(self, attr)
            if value not in FLOAT_DTYPES:
                raise ValueError(f"Policy.{attr}={value!r} is not a floating dtype ampkit "
                                 f"supports; valid: float32, float16, bfloat16")
        for attr in ("autocast", "master_weights", "keep_batchnorm_fp32"):
            value = getattr(self, attr)
            if not isinstance(value, bool):  # "no" or "False" would read as True
                raise TypeError(f"Policy.{attr}={value!r} must be a bool; valid: True, False")
        object.__setattr__(self, "loss_scale", _check_loss_scale(self.loss_scale))
        if self.autocast and self.compute_dtype not in HALF_DTYPES:
            raise ValueError(f"Policy(autocast=True) needs a half compute_dtype, got "
                             f"{self.compute_dtype}; valid: float16, bfloat16")
        if self.master_weights and self.param_dtype not in HALF_DTYPES:
            raise ValueError("Policy(master_weights=True) needs half parameters "
                             f"(param_dtype float16 or bfloat16), got {self.param_dtype}")

    @property
    def half_dtype(self) -> Optional[torch.dtype]:
        """The low-precision dtype this policy uses, or None for a pure-fp32 policy."""
        for dtype in (self.compute_dtype, self.param_dtype, self.output_dtype):
            if dtype in HALF_DTYPES:
                return dtype
        return None

    @property
    def dynamic_loss_scale(self) -> bool:
        return self.loss_scale == "dynamic"

    @property
    def loss_scaling(self) -> LossScaling:
        """The loss scaling this policy asks for (see :class:`LossScaling`)."""
        if self.loss_scale == "dynamic":
            return LossScaling("dynamic")
        scale = float(self.loss_scale)
        return LossScaling("none") if scale == 1.0 else LossScaling("static", scale)

    @property
    def input_dtype(self) -> Optional[torch.dtype]:
        """The dtype floating inputs are cast to before forward: the params', when half."""
        return self.param_dtype if self.param_dtype in HALF_DTYPES else None

    def cast_outputs_to(self, explicit: bool = False) -> Optional[torch.dtype]:
        """The dtype floating outputs are cast to, or None to leave them.

        Half models and autocast regions cast them to ``output_dtype``; other policies
        only when asked (``explicit``, apex's ``cast_model_outputs``).
        """
        cast = self.param_dtype in HALF_DTYPES or self.autocast or explicit
        return self.output_dtype if cast else None

    def with_half_dtype(self, half_dtype: torch.dtype) -> "Policy":
        """The same policy with every half dtype replaced by ``half_dtype``."""
        half = resolve_dtype(half_dtype, allowed=HALF_DTYPES, what="half_dtype")
        swap = {f: (half if getattr(self, f) in HALF_DTYPES else getattr(self, f))
                for f in ("param_dtype", "compute_dtype", "output_dtype")}
        return self.replace(**swap)

    def replace(self, **changes: object) -> "Policy":
        """A copy with ``changes`` applied (validated again; the preset name is dropped)."""
        changes.setdefault("name", None)
        return dataclasses.replace(self, **changes)

    def __str__(self) -> str:
        if self.name is not None and _PRESETS.get(self.name) == self:
            return self.name
        for preset_name in _CANONICAL_ORDER:
            if _PRESETS[preset_name] == self:
                return preset_name
        return _format_explicit(self)


def _check_loss_scale(value: LossScale) -> LossScale:
    if isinstance(value, str):
        if value == "dynamic":
            return value
        raise ValueError(f"loss_scale {value!r} is neither 'dynamic' nor a positive number")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"loss_scale must be 'dynamic' or a positive number, got {value!r}")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"loss_scale {value!r} is neither 'dynamic' nor a positive finite number")
    return float(value)


def _preset(name: str, p: torch.dtype, c: torch.dtype, o: torch.dtype, **kw: object) -> Policy:
    return Policy(p, c, o, name=name, **kw)  # type: ignore[arg-type]


_PRESETS: dict[str, Policy] = {
    "O0": _preset("O0", _F32, _F32, _F32),
    "O1": _preset("O1", _F32, _F16, _F32, autocast=True, loss_scale="dynamic"),
    "O2": _preset("O2", _F16, _F16, _F32, master_weights=True, loss_scale="dynamic"),
    "O3": _preset("O3", _F16, _F16, _F16, keep_batchnorm_fp32=False),
    "32-true": _preset("32-true", _F32, _F32, _F32),
    "16-mixed": _preset("16-mixed", _F32, _F16, _F32, autocast=True, loss_scale="dynamic"),
    "bf16-mixed": _preset("bf16-mixed", _F32, _BF16, _F32, autocast=True),
    "16-true": _preset("16-true", _F16, _F16, _F16, keep_batchnorm_fp32=False),
    "bf16-true": _preset("bf16-true", _BF16, _BF16, _BF16, keep_batchnorm_fp32=False),
}
_ALIASES: dict[str, str] = {"fp32": "32-true", "fp16-mixed": "16-mixed"}
# When str() must pick a name for a policy equal to several presets, the first one wins.
_CANONICAL_ORDER = ("O0", "O1", "O2", "O3", "32-true", "16-mixed", "bf16-mixed",
                    "16-true", "bf16-true")
OPT_LEVELS = ("O0", "O1", "O2", "O3")

# Keys of the explicit form "params=float32,compute=bfloat16,output=float32".
_KEYS: dict[str, str] = {
    "params": "param_dtype", "p": "param_dtype", "param": "param_dtype",
    "compute": "compute_dtype", "c": "compute_dtype",
    "output": "output_dtype", "o": "output_dtype",
    "autocast": "autocast", "master": "master_weights", "master_weights": "master_weights",
    "bn": "keep_batchnorm_fp32", "keep_batchnorm_fp32": "keep_batchnorm_fp32",
    "scale": "loss_scale", "loss_scale": "loss_scale",
}
_BOOLS = {"1": True, "true": True, "yes": True, "0": False, "false": False, "no": False}


def preset_names() -> list[str]:
    """Every preset name and alias get_policy accepts."""
    return list(_PRESETS) + list(_ALIASES)


def get_policy(name: Union[str, Policy]) -> Policy:
    """Parse a policy name: an opt level, a preset, or "p=f32,c=bf16,o=f32".

    Example:
        >>> get_policy("bf16-mixed").compute_dtype
        torch.bfloat16
    """
    if isinstance(name, Policy):
        return name
    if not isinstance(name, str):
        raise TypeError(f"policy must be a name (str) or a Policy, got {name!r}")
    key = name.strip()
    key = _ALIASES.get(key, key)
    if key in _PRESETS:
        return _PRESETS[key]
    level, _, half = key.partition("-")
    if level in OPT_LEVELS and half and level != "O0":  # "O2-bf16": the level in that half dtype
        return _PRESETS[level].with_half_dtype(resolve_dtype(half, allowed=HALF_DTYPES,
                                                             what=f"half dtype in {name!r}"))
    if "=" in key:
        return _parse_explicit(key)
    raise ValueError(f"unknown policy {name!r}; valid: {', '.join(preset_names())}, an opt level "
                     "with a half dtype ('O2-bf16', 'O1-fp16'), or "
                     "'params=float32,compute=bfloat16,output=float32' (short: 'p=f32,c=bf16,o=f32')")


def _parse_explicit(text: str) -> Policy:
    fields: dict[str, object] = {}
    for item in text.split(","):
        key, sep, value = item.partition("=")
        attr = _KEYS.get(key.strip().lower())
        if not sep or attr is None:
            raise ValueError(f"bad policy item {item!r} in {text!r}; valid keys: "
                             f"{', '.join(sorted(set(_KEYS)))}")
        if attr in fields:
            raise ValueError(f"policy {text!r} sets {attr} twice (item {item.strip()!r}); "
                             "valid: each key at most once")
        fields[attr] = _parse_value(attr, value.strip(), text)
    return _with_cascading_defaults(fields)


def _parse_value(attr: str, value: str, text: str) -> object:
    if attr.endswith("_dtype"):
        try:
            return resolve_dtype(value, what=attr)
        except ValueError as err:
            raise ValueError(f"{err} (in policy {text!r})") from None
    if attr == "loss_scale":
        return value if value == "dynamic" else _float(value, text)
    if value.lower() not in _BOOLS:
        raise ValueError(f"{attr}={value!r} in policy {text!r}; valid: 1/0, true/false, yes/no")
    return _BOOLS[value.lower()]


def _float(value: str, text: str) -> float:
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"loss_scale={value!r} in policy {text!r}; valid: 'dynamic' or a "
                         "positive number") from None


def _with_cascading_defaults(fields: dict[str, object]) -> Policy:
    """Fill what the string left out: compute from params, output from compute (as jmp)."""
    param = fields.setdefault("param_dtype", _F32)
    compute = fields.setdefault("compute_dtype", param)
    fields.setdefault("output_dtype", compute)
    fields.setdefault("autocast", param == _F32 and compute in HALF_DTYPES)
    fields.setdefault("loss_scale", "dynamic" if _F16 in (param, compute) and param != compute
                      else 1.0)
    return Policy(**fields)  # type: ignore[arg-type]


def _format_explicit(p: Policy) -> str:
    parts = [f"p={short_name(p.param_dtype)}", f"c={short_name(p.compute_dtype)}",
             f"o={short_name(p.output_dtype)}", f"autocast={int(p.autocast)}",
             f"master={int(p.master_weights)}", f"bn={int(p.keep_batchnorm_fp32)}"]
    scale = p.loss_scale if p.loss_scale == "dynamic" else repr(float(p.loss_scale))
    return ",".join(parts + [f"scale={scale}"])
