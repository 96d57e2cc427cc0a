"""FP8 scaling: amax, scales, saturating casts, and the delayed-scaling amax history.

Conventions. A *scale* multiplies a high-precision tensor into the fp8 range
(``fp8 = saturate(x * scale)``); the quantised tensor keeps its *inverse* scale, which
is what ``torch._scaled_mm`` multiplies its fp32 accumulator by. Scales are fp32 device
tensors: nothing here reads a value back to the host, so no function syncs.

Scales are per tensor (0-dim) or per row/column (a ``keepdim`` amax over the
contraction dimension: ``(M, 1)`` for a left operand, ``(1, N)`` for a right one).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional, Union

import torch
from torch import Tensor

from .._torch_compat import functorch_active, is_compiling
from .config import AmaxComputeAlgo

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
FP8_DTYPES = (E4M3, E5M2)
# Attention stores its probabilities p in [0, 1] in e4m3 as p * 2**8, so those down to
# 2**-17 count (e4m3's own smallest is 2**-9); fp8/attention.py and its kernels use it.
ATTENTION_P_SCALE = 256.0


class Fp8(NamedTuple):
    """An fp8 tensor and the fp32 inverse scale that dequantises it."""

    data: Tensor
    inv_scale: Tensor

    def t(self) -> "Fp8":
        """The transpose (a per-row scale becomes a per-column one)."""
        inv = self.inv_scale
        if inv.dim() == 2:
            # (M, 1) <-> (1, M) hold their elements in the same order: a reshape gives the
            # unit strides torch._scaled_mm checks for, where .t() would give (1, M).
            inv = inv.reshape(inv.shape[1], inv.shape[0])
        return Fp8(self.data.t(), inv)


def transforms_active() -> bool:
    """Whether a torch.func transform (vmap, grad, ...) runs this call: the fp8 casts are
    autograd.Functions without vmap or forward-mode rules. Dynamo reads the flag as a
    constant of the trace (no graph break), so ``torch.compile(vmap(layer))`` is refused
    by name too."""
    return functorch_active()


def refuse_transforms(what: str, way_out: str) -> None:
    """Raise a RuntimeError naming ``what`` and the way out under a torch.func transform,
    where torch's (or dynamo's) own message names neither."""
    if transforms_active():
        raise RuntimeError(f"{what} does not run under torch.func transforms (vmap, grad, "
                           f"jacrev, jvp, ...): its fp8 casts have no batching or forward-mode "
                           f"rules; valid: {way_out}, or call it outside the transform")


def fp8_max(dtype: torch.dtype) -> float:
    """The largest finite value of an fp8 dtype (448 for e4m3fn, 57344 for e5m2)."""
    if dtype not in FP8_DTYPES:
        raise ValueError(f"fp8 dtype {dtype} is not supported; valid: {E4M3}, {E5M2}")
    return float(torch.finfo(dtype).max)


def compute_amax(x: Tensor, dim: Optional[Union[int, tuple[int, ...]]] = None) -> Tensor:
    """The fp32 absolute maximum of ``x``: 0-dim, or ``keepdim`` over ``dim`` (one or more).

    Example:
        >>> compute_amax(torch.tensor([[1., -3.], [2., 0.]]), dim=1).flatten().tolist()
        [3.0, 2.0]
    """
    # The inf-norm reads x once; x.abs().amax() would first write |x| out in full (eager).
    # It is exact: the max of 16-bit values is a 16-bit value, widened afterwards.
    return torch.linalg.vector_norm(x, float("inf"), dim=dim, keepdim=dim is not None).float()


def amax_to_scale(amax: Tensor, dtype: torch.dtype, margin: int = 0) -> Tensor:
    """The scale that maps ``amax`` to the fp8 format's largest value, ``2**margin`` lower.

    An amax of exactly zero (an all-zero tensor, or a delayed history that has seen
    nothing yet) gives scale 1: any scale represents zeros exactly, and 1 is the
    neutral start Transformer Engine uses too. A non-finite amax (an inf or NaN among
    the values it was taken over) never gives a finite scale that would cast the other
    values silently wrong (scale 1 for a NaN flushed small values to zero): a NaN amax
    gives a NaN scale, an inf one scale 0, whose inverse (inf) makes every product it
    dequantizes NaN. Either way every output that met the scale is NaN. Elementwise on
    the scales only (no more ops than ``amax > 0`` took): no pass over the tensor, no
    host sync.

    Example:
        >>> amax_to_scale(torch.tensor([2.0, 0.0, float("nan"), float("inf")]), E4M3).tolist()
        [224.0, 1.0, nan, 0.0]
    """
    amax = amax.float()
    # amax is clamped to at least 1e-12 before dividing, so a tiny (but non-zero) amax gives
    # a large finite scale (448 / 1e-12 ~ 4.5e14, far below fp32's 3.4e38) instead of inf.
    # A literal: a module-level float read inside an autograd.Function stops dynamo under
    # torch.compile(dynamic=True) ("lift_tracked_freevar_to_input", torch 2.11 and 2.13).
    scale = fp8_max(dtype) / amax.clamp(min=1e-12)  # (NaN stays NaN, inf gives 0)
    if margin:
        scale = scale / (2.0 ** margin)
    return torch.where(amax == 0, 1.0, scale)


def saturated_cast(x: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    """``x * scale`` cast to fp8 with out-of-range values clamped to +-max (not inf/NaN).

    The product is formed in fp32 whatever ``x``'s dtype, so an fp16 input with a large
    scale does not overflow before the clamp. NaN stays NaN (clamp keeps it), so a
    GradScaler still sees non-finite gradients.
    """
    limit = fp8_max(dtype)
    scaled = x.float() * scale
    # Saturate finite overflow only: a non-finite value becomes NaN (torch's own cast would
    # saturate +-inf to +-448 in e4m3fn), so an inf input or gradient still reaches
    # GradScaler's check whatever the scale (a delayed scale has not seen this step's inf).
    return torch.where(scaled.isfinite(), scaled.clamp(-limit, limit), torch.nan).to(dtype)


def quantize(x: Tensor, dtype: torch.dtype, *, dim: Optional[int] = None, margin: int = 0,
             scale: Optional[Tensor] = None) -> Fp8:
    """Quantise ``x`` to fp8 with a dynamic scale (from its amax) or a given one.

    Args:
        x: the high-precision tensor.
        dtype: E4M3 or E5M2.
        dim: None for one scale per tensor; else the dimension the amax reduces over
            (per-row scales of a left operand: ``dim=-1``; per-column of a right: 0).
        margin: see :func:`amax_to_scale`.
        scale: use this scale and skip the amax pass (delayed scaling).

    Returns:
        The fp8 data and its inverse scale.

    Example:
        >>> q = quantize(torch.tensor([1.0, -4.0]), E4M3)
        >>> q.data.float().mul(q.inv_scale).tolist()
        [1.0, -4.0]
    """
    if scale is None:
        scale = amax_to_scale(compute_amax(x, dim), dtype, margin)
    return Fp8(saturated_cast(x, scale, dtype), scale.reciprocal())


def dequantize(q: Fp8, dtype: torch.dtype = torch.float32) -> Tensor:
    """The high-precision value an fp8 tensor stands for."""
    return (q.data.float() * q.inv_scale).to(dtype)


def update_history(history: Tensor, amax: Tensor) -> None:
    """Roll the amax history one step in place: ``history[0]`` becomes ``amax``.

    In place so the history can be a module buffer updated inside torch.compile'd
    forward and backward graphs (no Python-side state, no host sync).
    """
    with torch.no_grad():
        # A non-finite amax (an overflowing step that GradScaler will skip) would poison
        # the history for its whole length: the newest finite entry is repeated instead.
        entry = amax.reshape(1).to(history.dtype)
        entry = torch.where(entry.isfinite(), entry, history[:1])
        history.copy_(torch.cat([entry, history[:-1]]))


def history_amax(history: Tensor, algo: AmaxComputeAlgo) -> Tensor:
    """The amax a delayed cast scales by: the history's max or its most recent entry."""
    if algo is AmaxComputeAlgo.MOST_RECENT:
        return history[0]
    return history.amax()


def _define_history_amax() -> Any:
    """``ampkit::history_amax``: :func:`history_amax` as a custom op (defined at import,
    never inside a trace).

    Under torch.compile the forward pushes each amax into its history in place, and
    AOTAutograd's partitioner may recompute a cheap read of that history in the backward
    instead of saving its result: the backward then reads the history after the push, and
    the scale it dequantises a saved fp8 tensor by is not the one that tensor was cast
    with (silently wrong gradients: pytorch/pytorch#197039). The partitioner never
    recomputes a custom op, so the read is saved. torch 2.11 and 2.13 recomputed
    ``history[0]`` (``most_recent``) and the max of a history of at most 4 entries.
    """
    if hasattr(torch.ops.ampkit, "history_amax"):  # defined by an earlier import
        return torch.ops.ampkit.history_amax.default

    @torch.library.custom_op("ampkit::history_amax", mutates_args=())
    def op(history: Tensor, most_recent: bool) -> Tensor:
        return history[0].clone() if most_recent else history.amax()

    @op.register_fake
    def _(history: Tensor, most_recent: bool) -> Tensor:
        return history.new_empty(())

    return op


_HISTORY_AMAX = _define_history_amax()


def read_history(history: Tensor, algo: AmaxComputeAlgo) -> Tensor:
    """:func:`history_amax` of a history the same step then updates in place: under
    torch.compile through a custom op, so the backward uses this read, not a recomputed one."""
    if is_compiling():
        return _HISTORY_AMAX(history, algo is AmaxComputeAlgo.MOST_RECENT)
    return history_amax(history, algo)


def quantize_delayed(x: Tensor, dtype: torch.dtype, history: Tensor, *,
                     algo: AmaxComputeAlgo, margin: int = 0, warmup: bool = False,
                     record: bool = True, used: Optional[list[Tensor]] = None) -> Fp8:
    """Quantise with the scale from ``history``, then push ``x``'s amax into it.

    The cast does not wait for ``x``'s amax: under torch.compile the amax reduction is a
    by-product of the same pass that casts, instead of a separate pass before it.

    Args:
        x: the high-precision tensor (one scale for the whole tensor).
        dtype: E4M3 or E5M2.
        history: fp32 amax history (newest first), updated in place.
        algo: how the history becomes an amax.
        margin: see :func:`amax_to_scale`.
        warmup: scale by ``x``'s own amax (the first step, when the history is empty).
            Eager, a history whose amax is 0 (nothing finite recorded yet) does the same.
        record: push ``x``'s amax into the history (False for no-grad forwards, e.g.
            evaluation, which should not move the training scales).
        used: when given, the amax the scale came from is appended to it (a copy: the
            history changes in place), so a recomputation can cast alike.

    Returns:
        The fp8 data and its inverse scale.
    """
    if not (warmup or record):
        return quantize(x, dtype, scale=amax_to_scale(history_amax(history, algo), dtype, margin))
    amax = compute_amax(x)
    source = amax if warmup else read_history(history, algo)
    if not warmup and not is_compiling():
        # A history that has seen nothing finite yet (the first backward after a forward
        # without one, or after a step whose amax was inf) would scale by 1, flushing
        # small gradients to zero: this tensor's own amax instead, a warm-up (two scalar
        # kernels). Eager only, where ``amax`` is already known; compiled, the cast stays
        # one pass over ``x``.
        source = torch.where(source > 0, source, amax)
    if used is not None:
        used.append(source.clone())
    q = quantize(x, dtype, scale=amax_to_scale(source, dtype, margin))
    if record:
        update_history(history, amax)
    return q
