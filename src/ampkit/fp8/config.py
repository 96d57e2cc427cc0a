"""FP8 training configuration: the scaling recipe and its knobs.

``Float8Config`` is resolved once (``Float8Config.coerce``) at the boundary —
``Float8Linear.from_linear`` and ``convert_to_fp8`` — and never changes afterwards.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Optional, Union


class Recipe(str, Enum):
    """How the fp8 scales are chosen.

    TENSORWISE: one scale per tensor from its current amax; e4m3 input and weight,
        e5m2 output gradient.
    DELAYED: one scale per tensor from an amax history of earlier steps (Transformer
        Engine's DelayedScaling), so a cast needs no amax pass before it.
    ROWWISE: one scale per row along the contraction dimension; e4m3 everywhere.
    """

    TENSORWISE = "tensorwise"
    DELAYED = "delayed"
    ROWWISE = "rowwise"


# fp8 as a policy name (bench, train, doctor, autotune, diagnose.inspect): "fp8" or
# "fp8-<recipe>" means the eligible Linear layers in fp8 with that recipe, under the
# autocast policy below around them. Decided here, once.
FP8_BASE_POLICY = "bf16-mixed"
FP8_POLICY_NAMES = ("fp8",) + tuple(f"fp8-{recipe.value}" for recipe in Recipe)


def fp8_policy_recipe(name: object) -> Optional[str]:
    """The recipe an fp8 policy name asks for, None for a name that is not fp8.

    Raises ValueError for "fp8-<unknown recipe>" and for "fp8-" (a dash, then no recipe:
    only bare "fp8" means the default recipe), naming the valid ones.

    Example:
        >>> fp8_policy_recipe("fp8"), fp8_policy_recipe("fp8-delayed"), fp8_policy_recipe("O2")
        ('tensorwise', 'delayed', None)
    """
    if not isinstance(name, str):
        return None
    base, dash, recipe = name.strip().partition("-")
    if base != "fp8":
        return None
    if not dash:
        return Recipe.TENSORWISE.value
    if recipe not in {r.value for r in Recipe}:
        raise ValueError(f"unknown fp8 recipe {recipe!r} in policy {name.strip()!r}; valid: "
                         f"{', '.join(r.value for r in Recipe)} ({', '.join(FP8_POLICY_NAMES)})")
    return recipe


class AmaxComputeAlgo(str, Enum):
    """How the delayed recipe turns an amax history into the amax it scales by."""

    MAX = "max"
    MOST_RECENT = "most_recent"


def _choices(enum: type[Enum]) -> str:
    return ", ".join(repr(member.value) for member in enum)


def _to_enum(enum: type[Enum], value: object, what: str) -> Enum:
    if isinstance(value, enum):
        return value
    if isinstance(value, str):
        try:
            return enum(value.strip().lower())
        except ValueError:
            pass
        raise ValueError(f"unknown {what} {value!r}; valid: {_choices(enum)}")
    raise TypeError(f"{what} must be a str or {enum.__name__}, got "
                    f"{type(value).__name__} {value!r}; valid: {_choices(enum)}")


# The largest margin that still casts a tensor's amax to a normal e4m3 value: 448 / 2**14
# is above e4m3's smallest normal, 2**-6; from 19 on every value flushes to zero (448 /
# 2**19 is below half of the smallest subnormal, 2**-9), and at a few hundred the fp32
# scale itself underflows (NaN outputs).
MAX_MARGIN = 14


def _check_int(value: object, what: str, minimum: int, maximum: Optional[int] = None,
               why: str = "") -> None:
    valid = f"an int >= {minimum}" if maximum is None else f"an int from {minimum} to {maximum}"
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{what} must be {valid}, got {type(value).__name__} {value!r}")
    if value < minimum or (maximum is not None and value > maximum):
        raise ValueError(f"{what}={value!r} is invalid; valid: {valid}{why}")


@dataclass(frozen=True)
class Float8Config:
    """The fp8 recipe of a Float8Linear and its scaling knobs.

    Args:
        recipe: "tensorwise", "delayed" or "rowwise" (a :class:`Recipe` or its value).
        amax_history_len: steps of amax the delayed recipe remembers (>= 1).
        amax_compute_algo: "max" (largest amax in the history) or "most_recent".
        margin: scales are divided by ``2**margin``, so the amax maps ``margin`` binades
            below the format's largest value (headroom for growth between steps; 0 to
            ``MAX_MARGIN``, 14: beyond it the amax itself is cast below e4m3's normals).
        emulate: None picks per device (``torch._scaled_mm`` where
            ``ampkit._dtypes.fp8_supported``, emulation with a one-time warning
            elsewhere); True always emulates; False requires fp8 hardware.
        output_fast_accum: run the forward GEMM with ``use_fast_accum=True`` (Hopper's
            faster, less precise fp8 accumulation); the gradient GEMMs never use it.

    Example:
        >>> Float8Config("delayed", amax_history_len=4).recipe
        <Recipe.DELAYED: 'delayed'>
    """

    recipe: Recipe = Recipe.TENSORWISE
    amax_history_len: int = 16
    amax_compute_algo: AmaxComputeAlgo = AmaxComputeAlgo.MAX
    margin: int = 0
    emulate: Optional[bool] = None
    output_fast_accum: bool = False

    def __post_init__(self) -> None:
        # Strings become Enums here, once, while the instance is being built.
        object.__setattr__(self, "recipe", _to_enum(Recipe, self.recipe, "fp8 recipe"))
        object.__setattr__(self, "amax_compute_algo",
                           _to_enum(AmaxComputeAlgo, self.amax_compute_algo, "amax_compute_algo"))
        _check_int(self.amax_history_len, "amax_history_len", 1)
        _check_int(self.margin, "margin", 0, MAX_MARGIN,
                   f" (the amax lands {self.margin} binades below e4m3's 448; from 15 on it "
                   "is cast below e4m3's smallest normal, from 19 on every value is 0)")
        if self.emulate is not None and not isinstance(self.emulate, bool):
            raise TypeError(f"emulate must be None, True or False, got {self.emulate!r}")
        if not isinstance(self.output_fast_accum, bool):
            raise TypeError(f"output_fast_accum must be True or False, got {self.output_fast_accum!r}")

    @classmethod
    def coerce(cls, value: Union["Float8Config", Recipe, str]) -> "Float8Config":
        """A config from a recipe name, a :class:`Recipe`, or a config (returned as is).

        Example:
            >>> Float8Config.coerce("rowwise") == Float8Config(Recipe.ROWWISE)
            True
        """
        if isinstance(value, cls):
            return value
        if isinstance(value, (str, Recipe)):
            return cls(recipe=value)  # type: ignore[arg-type]
        raise TypeError(f"recipe must be a recipe name, a Recipe or a Float8Config, got "
                        f"{type(value).__name__} {value!r}; valid names: {_choices(Recipe)}")

    @property
    def short(self) -> str:
        """A few characters naming the recipe, e.g. "delayed(16,max)"."""
        if self.recipe is Recipe.DELAYED:
            return f"delayed({self.amax_history_len},{self.amax_compute_algo.value})"
        return self.recipe.value
