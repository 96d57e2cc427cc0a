"""The advice of a report: each sentence names a module or a setting and an action.

The rules, most urgent first (at most :data:`PER_RULE` modules each):

1. the fp32 reference itself is non-finite: precision is not the cause;
2. the first non-finite module: keep it in fp32 / switch fp16 -> bf16 / lower the
   initial loss scale (backward) / exclude it from fp8;
3. outputs in a half dtype that overflow it: keep it in fp32, or switch fp16 -> bf16;
4. gradients that overflow at the initial loss scale: lower ``init_scale`` (one power of
   two for every sentence, computed from the largest reference gradients), or, for a
   gradient beyond the half dtype's range even unscaled, keep it in fp32 / switch to bf16;
5. outputs in a half dtype that underflow (at least :data:`UNDERFLOW` of them): switch
   fp16 -> bf16 or keep it in fp32;
6. gradients that underflow at the initial loss scale: raise ``init_scale`` / use
   dynamic loss scaling / switch fp16 -> bf16 (counting only elements that one float64
   step shows to be signal, not fp32 rounding noise of a zero gradient, where it runs:
   ``diagnose/exact.py``);
7. the first module whose output SQNR is below :data:`LOW_SQNR_DB` (where accuracy is
   lost; the modules after it inherit the error): keep it in fp32 / exclude it from fp8;
8. an fp8 policy under which no layer ran in fp8: say so (it ran as bf16-mixed); one
   under which less than :data:`FP8_SHARE_NOTED` of the FLOPs did: say which modules
   convert_to_fp8 does not take;
9. nothing found: keep the policy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import torch

from ..fp8.config import FP8_BASE_POLICY
from .report import ModuleStats, dtype_name

FP8_SHARE_NOTED = 0.5  # below this share of the FLOPs in fp8, an fp8 report says so
UNDERFLOW = 0.01  # a module is flagged when 1% of its nonzero values flush to zero
LOW_SQNR_DB = 20.0  # error energy above 1% of the signal's (RMS error above 10%)
PER_RULE = 3


@dataclass(frozen=True)
class Context:
    """What the rules need beyond the module table."""

    policy: str
    half_dtype: Optional[torch.dtype]
    loss_scale: float
    scaling: str  # "none", "static" or "dynamic"
    bf16_policy: Optional[str]  # the same policy in bf16 (None when it is not fp16)
    first_nonfinite: Optional[tuple[str, str]]
    ref_finite: bool
    kept: frozenset[str] = frozenset()  # the modules keep_fp32 selected and those inside
    selection: tuple[str, ...] = ()  # the names passed to keep_fp32 (its current selection)
    fp8_layers: frozenset[str] = frozenset()
    fp8: bool = False  # an fp8 policy: Linear layers in fp8 under bf16 autocast
    grad_amax: dict[str, float] = field(default_factory=dict)
    # per module whose gradient underflow was checked against a float64 step (rule 6
    # reads it): the underflow of its elements that are signal, not fp32 rounding noise
    grad_signal_underflow: dict[str, float] = field(default_factory=dict)
    fp8_share: float = 0.0  # of the matmul and convolution FLOPs, those in an fp8 dtype


def advise(modules: list[ModuleStats], ctx: Context) -> list[str]:
    """The advice sentences for ``modules`` under ``ctx``, most urgent first."""
    if not ctx.ref_finite:
        return ["The fp32 reference loss is not finite either: the model overflows in fp32, "
                "so no precision setting is the cause; fix the model or its inputs first."]
    sentences = _nonfinite(ctx)
    named = {ctx.first_nonfinite[1]} if ctx.first_nonfinite else set()
    for rule in (_overflow, _grad_overflow, _underflow, _grad_underflow, _low_sqnr):
        for module, sentence in rule(modules, ctx, named):
            named.add(module)
            sentences.append(sentence)
    if ctx.fp8 and not ctx.fp8_layers:
        sentences.append(f"No layer ran in fp8 under {ctx.policy}: no Linear qualifies (exactly "
                         "nn.Linear, in and out features multiples of 16), so every matmul ran "
                         f"in bf16, as under {FP8_BASE_POLICY!r}: use that policy, or make the "
                         "layers' features multiples of 16 for fp8.")
    if ctx.fp8 and ctx.fp8_layers and ctx.fp8_share < FP8_SHARE_NOTED:
        sentences.append(f"Only {ctx.fp8_share:.0%} of the matmul and convolution FLOPs ran "
                         f"in fp8 under {ctx.policy}; the rest ran in bf16 or fp32, in modules "
                         "convert_to_fp8 does not take (it takes exactly nn.Linear with in and "
                         "out features multiples of 16; not, e.g., transformers' Conv1D), in "
                         "modules kept in fp32, or in attention and convolutions.")
    return sentences or [f"No module overflows, underflows or falls below {LOW_SQNR_DB:g} dB "
                         f"SQNR under {ctx.policy}: keep the policy {ctx.policy!r}."]


def _fix(name: str, ctx: Context, problem: str) -> str:
    """The action for a module whose own values do not fit the policy."""
    shown = name or "<model>"
    if name in ctx.fp8_layers:
        return (f"Exclude {shown!r} from fp8 ({problem}): convert_to_fp8(model, module_filter="
                f"lambda m, name: name != {name!r}).")
    actions = []
    if name not in ctx.kept and name:
        # keep_fp32 replaces the selection: the call keeps the modules kept so far too.
        actions.append(f"keep it in fp32 with ampkit.keep_fp32(model, {[*ctx.selection, name]!r})")
    if ctx.bf16_policy is not None:
        actions.append(f"switch fp16 -> bf16 (policy {ctx.bf16_policy!r}: fp32's exponent range)")
    if not actions:
        actions.append("run the model in fp32 (policy '32-true') or rescale what it computes")
    return f"{shown!r} {problem}: " + ", or ".join(actions) + "."


def _nonfinite(ctx: Context) -> list[str]:
    if ctx.first_nonfinite is None:
        return []
    phase, name = ctx.first_nonfinite
    if phase == "forward":
        return [_fix(name, ctx, "is the first module with a non-finite output under "
                                f"{ctx.policy}")]
    problem = f"is the first module with a non-finite gradient under {ctx.policy}"
    if _beyond_half(name, ctx):
        return [_fix(name, ctx, problem + _beyond_half(name, ctx))]
    if ctx.scaling != "none" and ctx.loss_scale > 1:
        return [f"{name or '<model>'!r} is the first module with a non-finite gradient at the "
                f"initial loss scale {ctx.loss_scale:g}: lower init_scale "
                f"({_lower_scale(ctx)}); dynamic scaling would skip steps until it "
                "backs off far enough."]
    return [_fix(name, ctx, problem)]


def _fitting_scale(name: str, ctx: Context) -> Optional[float]:
    """The largest power-of-two loss scale at which module ``name``'s largest reference
    parameter gradient is finite in the half dtype (None: nothing to compute it from)."""
    amax = ctx.grad_amax.get(name, 0.0)
    if ctx.half_dtype is None or name in ctx.kept or not (amax > 0 and math.isfinite(amax)):
        return None
    return 2.0 ** math.floor(math.log2(torch.finfo(ctx.half_dtype).max / amax))


def _beyond_half(name: str, ctx: Context) -> str:
    """Why no loss scale helps (its gradient exceeds the half dtype's max even unscaled),
    or "" when one does."""
    scale = _fitting_scale(name, ctx)
    if scale is None or scale >= 1.0:
        return ""
    return (f" (its largest gradient, {ctx.grad_amax[name]:.3g}, is above "
            f"{dtype_name(ctx.half_dtype)}'s max {torch.finfo(ctx.half_dtype).max:g} even "
            "unscaled: no init_scale keeps it finite)")


def _lower_scale(ctx: Context) -> str:
    """A lower init_scale, the same in every sentence: the largest power of two at which
    every module's largest reference parameter gradient that the half dtype can hold
    is finite (a non-finite input gradient may need lower still)."""
    scales = [s for s in (_fitting_scale(n, ctx) for n in ctx.grad_amax)
              if s is not None and s >= 1.0]
    scale = min(scales, default=ctx.loss_scale)
    if scale >= ctx.loss_scale:
        return f"below {ctx.loss_scale:g}, e.g. GradScaler(init_scale={ctx.loss_scale / 2**8:g})"
    return f"GradScaler(init_scale={scale:g}) keeps the largest parameter gradients finite"


def _half_output(m: ModuleStats) -> bool:
    """Its output is in a half dtype under the policy: only such an output can overflow or
    underflow (keeping in fp32 a module that already computes in fp32 changes nothing)."""
    return m.out_dtype is not None and m.out_dtype.is_floating_point \
        and torch.finfo(m.out_dtype).bits < 32


def _overflow(modules: list[ModuleStats], ctx: Context, named: set[str]) -> list[tuple[str, str]]:
    hits = [m for m in modules
            if (m.overflow or 0) > 0 and _half_output(m) and m.name not in named]
    return [(m.name, _fix(m.name, ctx, f"has {m.overflow:.2%} of its outputs overflow "
                                       f"{dtype_name(m.out_dtype)}")) for m in hits[:PER_RULE]]


def _grad_overflow(modules: list[ModuleStats], ctx: Context,
                   named: set[str]) -> list[tuple[str, str]]:
    hits = [m for m in modules if (m.grad_overflow or 0) > 0 and m.name not in named]
    out = []
    for m in hits[:PER_RULE]:
        problem = (f"has {m.grad_overflow:.2%} of its gradients overflow "
                   f"{dtype_name(ctx.half_dtype)} at the initial loss scale {ctx.loss_scale:g}")
        if _beyond_half(m.name, ctx) or ctx.loss_scale <= 1:
            sentence = _fix(m.name, ctx, problem + _beyond_half(m.name, ctx))
        else:
            sentence = f"{m.name or '<model>'!r} {problem}: lower init_scale ({_lower_scale(ctx)})."
        out.append((m.name, sentence))
    return out


def _underflow(modules: list[ModuleStats], ctx: Context, named: set[str]) -> list[tuple[str, str]]:
    hits = [m for m in modules
            if (m.underflow or 0) >= UNDERFLOW and _half_output(m) and m.name not in named]
    return [(m.name, _fix(m.name, ctx, f"has {m.underflow:.2%} of its nonzero outputs flush "
                                       f"to zero in {dtype_name(m.out_dtype)}"))
            for m in hits[:PER_RULE]]


def _grad_underflow(modules: list[ModuleStats], ctx: Context,
                    named: set[str]) -> list[tuple[str, str]]:
    hits = [m for m in modules if m.name not in named and
            ctx.grad_signal_underflow.get(m.name, m.grad_underflow or 0) >= UNDERFLOW]
    if ctx.scaling == "none":
        action = ("use dynamic loss scaling (ampkit.GradScaler(), or a policy with "
                  "loss_scale=dynamic)")
    else:
        action = f"raise init_scale above {ctx.loss_scale:g} (GradScaler(init_scale=...))"
    if ctx.bf16_policy is not None:
        action += f", or switch fp16 -> bf16 (policy {ctx.bf16_policy!r})"
    return [(m.name, f"{m.name or '<model>'!r} has {_flushed(m, ctx)} flush to "
                     f"zero in {dtype_name(ctx.half_dtype)} at the initial loss scale "
                     f"{ctx.loss_scale:g}: {action}.") for m in hits[:PER_RULE]]


def _flushed(m: ModuleStats, ctx: Context) -> str:
    """The share the rule decided on: of the signal (rounding noise left out), once a
    float64 step has told them apart, else of all nonzero gradient elements."""
    signal = ctx.grad_signal_underflow.get(m.name)
    if signal is None:
        return f"{m.grad_underflow:.2%} of its nonzero gradients"
    return f"{signal:.2%} of its nonzero gradients (fp32 rounding noise not counted)"


def _low_sqnr(modules: list[ModuleStats], ctx: Context, named: set[str]) -> list[tuple[str, str]]:
    for m in modules:
        if m.out_sqnr_db is not None and m.out_sqnr_db < LOW_SQNR_DB:
            if m.name in named:
                return []  # already advised on: the modules after it inherit its error
            problem = (f"is the first module whose output is below {LOW_SQNR_DB:g} dB SQNR "
                       f"({m.out_sqnr_db:.1f} dB) under {ctx.policy}")
            return [(m.name, _fix(m.name, ctx, problem))]
    return []
