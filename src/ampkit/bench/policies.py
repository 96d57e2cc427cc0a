"""Policy names as ``ampkit bench``/``train`` take them, resolved for one device.

The names are ``get_policy``'s, plus what only the commands take: O-levels with a half
dtype suffix ("O2-bf16"; bare "O2" is the device's autocast dtype), ``fp8[-recipe]``
(Linear layers in fp8 under bf16 autocast), and ``auto`` in a list (the policies the
device runs natively, as autotune's candidates).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .._dtypes import HALF_DTYPES, autocast_default_dtype, device_policies, resolve_dtype
from ..fp8 import Recipe
from ..fp8.config import FP8_BASE_POLICY, FP8_POLICY_NAMES, fp8_policy_recipe
from ..policy import OPT_LEVELS, Policy, get_policy, preset_names
from .errors import UsageError

FP8_RECIPES = tuple(recipe.value for recipe in Recipe)
AUTO = "auto"
_F32 = torch.float32


def valid_policies(with_auto: bool = True) -> str:
    """The policy names ``--policies`` accepts (``with_auto``), or one ``--policy`` does,
    for error messages and help."""
    names = (", ".join(preset_names()) + "; O-levels take a half-dtype suffix (O2-bf16, "
             f"O1-fp16); {', '.join(FP8_POLICY_NAMES)}; ")
    if not with_auto:
        return names + "or 'p=f32,c=bf16,o=f32'"
    return names + f"'p=f32,c=bf16,o=f32'; or {AUTO} (the policies this device runs natively)"


@dataclass(frozen=True)
class PolicySpec:
    """A policy as named on the command line, resolved for one device.

    Args:
        label: the name as the user wrote it ("O2", "bf16-mixed", "fp8").
        policy: the resolved Policy (O-levels get the device's half dtype unless suffixed).
        fp8_recipe: the convert_to_fp8 recipe, or None when the policy is not fp8.

    Example:
        >>> parse_policy("O2", "cpu").policy.param_dtype
        torch.bfloat16
    """

    label: str
    policy: Policy
    fp8_recipe: Optional[str] = None

    @property
    def resolved(self) -> str:
        """What runs, in words: the policy, and the fp8 recipe of its Linear layers.

        Example:
            >>> parse_policy("fp8-delayed", "cpu").resolved
            'fp8-delayed Linear layers under bf16-mixed'
        """
        if self.fp8_recipe is None:
            return str(self.policy)
        return f"fp8-{self.fp8_recipe} Linear layers under {self.policy}"

    @property
    def is_fp32(self) -> bool:
        """True for a pure-fp32 policy (32-true, O0, p=f32): the reference of the rule."""
        p = self.policy
        return (self.fp8_recipe is None and p.param_dtype == _F32 and p.compute_dtype == _F32
                and not p.autocast)


def parse_policy(name: str, device_type: str, *, in_list: bool = False) -> PolicySpec:
    """Resolve one policy name for a device type; UsageError names the valid ones (with
    ``auto`` when ``in_list``: a name of a ``--policies`` list)."""
    label = name.strip()
    base, _, suffix = label.partition("-")
    try:
        recipe = fp8_policy_recipe(label)
    except ValueError as err:
        raise UsageError(str(err)) from None
    if recipe is not None:
        return PolicySpec(label, get_policy(FP8_BASE_POLICY), recipe)
    if base in OPT_LEVELS:
        return PolicySpec(label, _opt_level(base, suffix, label, device_type))
    try:
        policy = get_policy(label)
    except (ValueError, TypeError) as err:
        if "=" in label:  # an explicit policy: the parser's message names the bad part
            raise UsageError(f"bad policy {label!r}: {err}") from None
        raise UsageError(f"unknown policy {label!r}; valid: {valid_policies(in_list)}") from None
    _check_runnable(label, policy)
    return PolicySpec(label, policy)


def _opt_level(level: str, suffix: str, label: str, device_type: str) -> Policy:
    policy = get_policy(level)
    if policy.half_dtype is None:
        if suffix:
            raise UsageError(f"policy {label!r}: {level} is pure fp32 and takes no half dtype; "
                             f"valid: {level}")
        return policy
    try:
        half = (resolve_dtype(suffix, allowed=HALF_DTYPES, what=f"half dtype in {label!r}")
                if suffix else autocast_default_dtype(device_type))
    except ValueError as err:
        raise UsageError(str(err)) from None
    return policy.with_half_dtype(half)


def _check_runnable(label: str, p: Policy) -> None:
    # The loop runs half parameters through initialize (which computes in the parameters'
    # dtype) and fp32 parameters through autocast; other combinations have no meaning there.
    if p.param_dtype in HALF_DTYPES and p.compute_dtype != p.param_dtype:
        raise UsageError(f"policy {label!r} keeps {p.param_dtype} parameters but computes in "
                         f"{p.compute_dtype}; valid: compute dtype equal to a half param dtype")
    if p.param_dtype == _F32 and p.compute_dtype != _F32 and not p.autocast:
        raise UsageError(f"policy {label!r} computes in {p.compute_dtype} on fp32 parameters "
                         "without autocast; valid: autocast=1 for fp32 parameters")


def parse_policy_list(text: str, device_type: str) -> list[PolicySpec]:
    """Parse a --policies value: names separated by commas (or by ';').

    Explicit "p=..,c=..,o=.." policies contain commas themselves: an item with "=" joins
    the explicit policy before it unless it repeats one of its keys. ``auto`` stands for
    the policies the device runs natively (``_dtypes.device_policies``' candidates).

    Example:
        >>> [s.label for s in parse_policy_list("32-true,p=f32,c=bf16,fp8", "cpu")]
        ['32-true', 'p=f32,c=bf16', 'fp8']
        >>> [s.label for s in parse_policy_list("32-true,bf16-mixed,fp32,bf16-mixed", "cpu")]
        ['32-true', 'bf16-mixed']
    """
    names = [name for item in split_policy_list(text) for name in _expand(item, device_type)]
    specs = [parse_policy(name, device_type, in_list=True) for name in names]
    if not specs:
        raise UsageError(f"no policy given in {text!r}; valid: {valid_policies()}")
    # A policy named twice ("bf16-mixed" again, "fp32" after "32-true") runs once, under
    # its first name: two rows of one policy made the recommendation quote the wrong one.
    distinct = {(spec.policy, spec.fp8_recipe): spec for spec in reversed(specs)}
    return [spec for spec in specs if distinct[(spec.policy, spec.fp8_recipe)] is spec]


def split_policy_list(text: str) -> list[str]:
    """The names in a list of policies (``--policies``, ``--candidates``): separated by
    commas, or by ';'; an explicit policy's own commas ("p=f32,c=bf16,o=f32") keep it one.

    Example:
        >>> split_policy_list("32-true, p=f32,c=bf16,o=f32 ,O2")
        ['32-true', 'p=f32,c=bf16,o=f32', 'O2']
    """
    items = text.split(";") if ";" in text else _join_explicit(text.split(","))
    return [item.strip() for item in items if item.strip()]


def _expand(item: str, device_type: str) -> tuple[str, ...]:
    return device_policies(device_type).candidates if item == AUTO else (item,)


def _join_explicit(items: list[str]) -> list[str]:
    out: list[str] = []
    keys: set[str] = set()
    for item in (i.strip() for i in items):
        key = item.partition("=")[0].strip().lower()
        if "=" in item and out and "=" in out[-1] and key not in keys:
            out[-1] += "," + item
            keys.add(key)
        else:
            out.append(item)
            keys = {key} if "=" in item else set()
    return out


def loss_scaling_label(policy: Policy) -> str:
    """How the policy scales the loss, for reports: "off", "dynamic" or "static <scale>"."""
    scaling = policy.loss_scaling
    return "off" if scaling.kind == "none" else str(scaling)
