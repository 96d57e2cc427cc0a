"""FP8 attention: scaled dot-product attention on e4m3 query, key and value.

:func:`scaled_dot_product_attention` is a drop-in for ``F.scaled_dot_product_attention``;
inside :class:`fp8_attention` torch's function is routed to it where a model calls it
(not from inside ``nn.MultiheadAttention``: see :class:`fp8_attention`).

The recipe, on every path:

- q, k and v are cast to e4m3 with one scale per (batch, head), a power of two: their
  dequantised values are exact in the inputs' own dtype, so backward works on the very
  operands forward multiplied.
- ``Q K^T`` multiplies fp8 operands with fp32 accumulation; softmax runs in fp32.
- The probabilities ``exp(s - rowmax)``, in [0, 1], are stored in e4m3 times 2**8 for the
  ``P V`` product, so probabilities down to 2**-17 count (e4m3 alone stops at 2**-9). The
  kernels' online softmax rounds them against the running row max, the emulation against
  the final one: where a row spans several key blocks the roundings differ (both are
  equally close to exact attention).
- Backward runs from the saved fp8 q, k, v, the output and the row log-sum-exp, as
  flash attention's backward does: the kernels multiply operands of the forward's compute
  dtype (bf16, fp16; fp32 in IEEE fp32) with fp32 accumulation, the emulation all in fp32. Gradients pass the casts unchanged (straight-through),
  as Float8Linear's do. Saved per element: 3 bytes of fp8 q, k, v (torch's bf16 attention
  saves q, k, v and the output, 8 bytes; the output is saved by the next layer anyway).
- A non-finite value in q, k or v makes its whole (batch, head) NaN (a loss scaler then
  skips the step); no double backward; under torch.func transforms torch's attention runs.

Paths: on a Hopper-class GPU with Triton installed, fused Triton kernels
(``_attention_kernels.py``: a flash-attention forward on fp8 tensor cores and a backward
that never materialises the (L, S) score matrix). Elsewhere the recipe is emulated in fp32
on the materialised score matrix: the numerics, not the speed.

What runs in fp8: 4-D ``(batch, heads, seq, head_dim)`` q, k, v of one floating dtype and
device, the same head_dim (32, 64, 128 or 256) in all three, no ``attn_mask`` (``is_causal``
is fine), ``dropout_p=0``, and grouped-query attention (``enable_gqa``). Any other call runs
torch's attention unchanged (whatever ``emulate`` says), with a warning naming why (once
per kind of reason; none while torch.compile traces):
:func:`check_fp8_attention` says it beforehand.

Example:
    >>> import torch
    >>> from ampkit.fp8 import fp8_attention
    >>> q = k = v = torch.randn(1, 2, 8, 32)
    >>> with fp8_attention(emulate=True):
    ...     out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    >>> out.shape
    torch.Size([1, 2, 8, 32])
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import math
import numbers
import threading
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode

from .._checks import check_bool
from .._dtypes import autocast_output_dtype, capability, fp8_supported, has_autocast, to_dtype
from .._warn import warn_once
from .scaling import ATTENTION_P_SCALE as P_SCALE
from .scaling import (E4M3, Fp8, amax_to_scale, compute_amax, dequantize, quantize,
                      transforms_active)

HEAD_DIMS = (32, 64, 128, 256)
_FLOATS = (torch.float16, torch.bfloat16, torch.float32)


def check_fp8_attention(query: Any, key: Any, value: Any, attn_mask: Optional[Tensor] = None,
                        dropout_p: float = 0.0, is_causal: bool = False,
                        scale: Optional[float] = None, enable_gqa: bool = False) -> Optional[str]:
    """Why this attention call cannot run in fp8 (None when it can).

    Takes the arguments of ``F.scaled_dot_product_attention`` (and of
    :func:`scaled_dot_product_attention`), in its order, so a call's arguments can be
    checked as they are; ``is_causal`` and ``scale`` do not keep a call from fp8, and a
    bad one raises the TypeError the attention function would.

    Example:
        >>> q = torch.randn(1, 2, 8, 24)
        >>> check_fp8_attention(q, q, q, is_causal=True)
        'head_dim 24 (valid: 32, 64, 128, 256)'
    """
    _check_flags(is_causal, scale, enable_gqa)
    why = _why_not(query, key, value, attn_mask, dropout_p, enable_gqa)
    return None if why is None else why[1]


def _check_flags(is_causal: Any, scale: Any, enable_gqa: Any) -> None:
    """Raise TypeError for a non-bool flag or a scale that is not None or a real number."""
    check_bool("is_causal", is_causal)
    check_bool("enable_gqa", enable_gqa)
    one_number = (isinstance(scale, torch.Tensor) and scale.numel() == 1
                  and not scale.is_complex() and scale.dtype is not torch.bool)
    if scale is not None and not one_number and (isinstance(scale, bool)
                                                 or not isinstance(scale, numbers.Real)):
        raise TypeError(f"scale must be None or a float, got {type(scale).__name__} {scale!r}; "
                        "valid: None (1/sqrt(head_dim)), a real number, or a one-element "
                        "real tensor (as torch takes it)")


def _why_not(query: Any, key: Any, value: Any, attn_mask: Optional[Tensor], dropout_p: float,
             enable_gqa: bool) -> Optional[tuple[str, str]]:
    """(kind, reason) of a call fp8 cannot run; the kind keys the once-only warning."""
    qkv = (query, key, value)
    if not all(torch.is_tensor(t) for t in qkv):
        return "type", "query, key and value are not all tensors"
    if transforms_active():
        return "transform", ("a torch.func transform (vmap, grad, ...) is running: fp8's casts "
                             "have no batching or forward-mode rules")
    if any(t.is_nested or t.layout != torch.strided for t in qkv):
        return "layout", "nested or sparse query, key or value"
    if any(t.dim() != 4 for t in qkv):
        return "dims", (f"query, key, value of {query.dim()}, {key.dim()}, {value.dim()} "
                        "dimensions (valid: 4, as (batch, heads, seq, head_dim))")
    if len({t.dtype for t in qkv}) > 1 or query.dtype not in _FLOATS:
        return "dtype", (f"dtypes {query.dtype}, {key.dtype}, {value.dtype} (valid: all "
                         "float16, all bfloat16 or all float32)")
    if len({t.device for t in qkv}) > 1:
        return "device", f"devices {query.device}, {key.device}, {value.device} differ"
    if attn_mask is not None:
        return "mask", "attn_mask given (fp8 attention takes is_causal, no mask tensor)"
    if dropout_p != 0.0:
        return "dropout", f"dropout_p={dropout_p!r} (fp8 attention has no dropout; valid: 0.0)"
    return _check_shapes(query, key, value, enable_gqa)


def _check_shapes(query: Tensor, key: Tensor, value: Tensor,
                  enable_gqa: bool) -> Optional[tuple[str, str]]:
    (batch, heads, length, dim), (k_batch, k_heads, k_length, _) = query.shape, key.shape
    if key.shape != value.shape or k_batch != batch:
        return "shapes", (f"shapes q {tuple(query.shape)}, k {tuple(key.shape)}, v "
                          f"{tuple(value.shape)} (valid: k and v alike, one batch size, no "
                          "broadcasting)")
    valid = ", ".join(map(str, HEAD_DIMS))
    if key.shape[-1] != dim:
        return "head_dim", (f"head_dim {dim} of q, {key.shape[-1]} of k and v (valid: one of "
                            f"{valid}, the same in all three)")
    if dim not in HEAD_DIMS:
        return "head_dim", f"head_dim {dim} (valid: {valid})"
    if heads != k_heads and not (enable_gqa and k_heads and heads % k_heads == 0):
        return "heads", (f"{heads} query heads and {k_heads} key/value heads (valid: equal, "
                         "or a multiple with enable_gqa=True)")
    if length == 0 or k_length == 0 or batch == 0 or heads == 0:
        return "empty", f"an empty query {tuple(query.shape)} or key {tuple(key.shape)}"
    return None


def quantize_heads(x: Tensor) -> Fp8:
    """``x`` (batch, heads, seq, dim) in e4m3, one power-of-two scale per (batch, head).

    Example:
        >>> q = quantize_heads(torch.full((1, 1, 2, 32), 3.0))
        >>> q.inv_scale.shape, dequantize(q).unique().tolist()
        (torch.Size([1, 1, 1, 1]), [3.0])
    """
    scale = amax_to_scale(compute_amax(x, dim=(-2, -1)), E4M3)
    # Rounded down to a power of two (amax lands in [224, 448]): dequantising is exact.
    return quantize(x, E4M3, scale=torch.exp2(torch.floor(torch.log2(scale))))


def _expand_heads(x: Tensor, heads: int) -> Tensor:
    """Key/value heads repeated for grouped-query attention (each serves a group)."""
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], dim=1)


def _sum_heads(grad: Tensor, heads: int) -> Tensor:
    """The gradient of :func:`_expand_heads`: each group's query heads summed."""
    if grad.shape[1] == heads:
        return grad
    batch, _, length, dim = grad.shape
    return grad.reshape(batch, heads, -1, length, dim).sum(2)


class _Emulated:
    """The recipe in fp32 on the materialised (L, S) score matrix."""

    @staticmethod
    def scores(q8: Fp8, k8: Fp8, causal: bool, scale: float) -> Tensor:
        q = dequantize(q8)
        k = _expand_heads(dequantize(k8), q.shape[1])
        s = (q @ k.transpose(-2, -1)) * scale  # fp8 products are exact in fp32
        if causal:  # top-left aligned, as torch's is_causal
            keep = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril()
            s = s.masked_fill(~keep, float("-inf"))
        return s

    @staticmethod
    def forward(q8: Fp8, k8: Fp8, v8: Fp8, causal: bool, scale: float,
                out_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        s = _Emulated.scores(q8, k8, causal, scale)
        rowmax = s.amax(-1, keepdim=True)
        p = torch.exp(s - rowmax)
        rowsum = p.sum(-1, keepdim=True)
        p8 = (p * P_SCALE).to(E4M3)  # <= 256: no saturation
        v = _expand_heads(dequantize(v8), s.shape[1])
        out = (p8.float() @ v) / (rowsum * P_SCALE)
        return to_dtype(out, out_dtype), (rowmax + rowsum.log()).squeeze(-1)

    @staticmethod
    def backward(grad_out: Tensor, q8: Fp8, k8: Fp8, v8: Fp8, out: Tensor, lse: Tensor,
                 causal: bool, scale: float) -> tuple[Tensor, Tensor, Tensor]:
        s = _Emulated.scores(q8, k8, causal, scale)
        heads = s.shape[1]
        p = torch.exp(s - lse.unsqueeze(-1))
        d_out = grad_out.float()
        delta = (d_out * out.float()).sum(-1, keepdim=True)
        d_v = p.transpose(-2, -1) @ d_out
        d_s = p * (d_out @ _expand_heads(dequantize(v8), heads).transpose(-2, -1) - delta)
        d_q = (d_s @ _expand_heads(dequantize(k8), heads)) * scale
        d_k = (d_s.transpose(-2, -1) @ dequantize(q8)) * scale
        return d_q, d_k, d_v  # dK, dV per query head, as the kernels give them


@functools.lru_cache(maxsize=None)
def _triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def _kernels() -> Any:
    from . import _attention_kernels  # imports triton: only where the kernels run

    return _attention_kernels


def _autocast_off(device_type: str) -> Any:
    """Autocast off on this device type (our fp32 math stays fp32); nothing to turn off on
    one without autocast (meta)."""
    if has_autocast(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


class _Fp8AttentionFn(torch.autograd.Function):
    """Attention with fp8 q, k, v in forward; backward from the saved fp8 operands."""

    @staticmethod
    def forward(ctx, query: Tensor, key: Tensor, value: Tensor, causal: bool,  # type: ignore[override]
                scale: float, native: bool, out_dtype: torch.dtype) -> Tensor:
        impl = _kernels() if native else _Emulated
        with _autocast_off(query.device.type):
            q8, k8, v8 = (quantize_heads(t) for t in (query, key, value))
            out, lse = impl.forward(q8, k8, v8, causal, scale, out_dtype)
        ctx.save_for_backward(*q8, *k8, *v8, out, lse)
        ctx.causal, ctx.scale, ctx.impl = causal, scale, impl
        ctx.dtypes = (query.dtype, key.dtype, value.dtype)
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor) -> tuple[Optional[Tensor], ...]:  # type: ignore[override]
        if torch.is_grad_enabled():  # create_graph=True: a gradient of this gradient is asked
            raise RuntimeError("ampkit.fp8 attention has no double backward (a backward with "
                               "create_graph=True, e.g. a gradient penalty); valid: run that "
                               "forward with torch's attention (fp8_attention(enabled=False))")
        q_data, q_inv, k_data, k_inv, v_data, v_inv, out, lse = ctx.saved_tensors
        with _autocast_off(grad_out.device.type):
            grads = ctx.impl.backward(grad_out, Fp8(q_data, q_inv), Fp8(k_data, k_inv),
                                      Fp8(v_data, v_inv), out, lse, ctx.causal, ctx.scale)
        d_q, d_k, d_v = (to_dtype(g, dtype) for g, dtype in zip(
            (grads[0], *(_sum_heads(g, k_data.shape[1]) for g in grads[1:])), ctx.dtypes))
        return d_q, d_k, d_v, None, None, None, None


def kernels_unavailable(device: torch.device) -> Optional[str]:
    """Why the Triton kernels cannot run on ``device`` (None when they can): they need
    Triton, fp8 tensor cores and, for their tiles, a Hopper-class GPU's shared memory
    (compute capability 9.0 or more; Ada's 99 KiB per block would not hold them)."""
    cap = capability(str(device))
    if not fp8_supported(str(device)):
        return f"{device} ({cap.name}) has no fp8 tensor cores"
    if cap.compute_capability < 90:
        return (f"{device} ({cap.name}, compute capability {cap.compute_capability / 10}) is not "
                "Hopper-class (9.0 or more), whose shared memory the kernels' tiles need")
    if not _triton_available():
        return "Triton is not installed"
    return None


def _native(device: torch.device, emulate: Optional[bool]) -> bool:
    """Whether the Triton kernels run this call (decided per call, on q's device)."""
    if emulate is True:
        return False
    why = kernels_unavailable(device)
    if why is None:
        return True
    if emulate is False:
        raise RuntimeError(f"fp8 attention with emulate=False needs its Triton kernels, but {why}; "
                           "valid: emulate=None or True there")
    if device.type != "meta":
        warn_once(("fp8-attention-emulation", device.type),
                  f"ampkit.fp8: no fp8 attention kernel on {device.type!r} ({why}); attention "
                  "is emulated there (same numerics, no speed-up). Pass emulate=True to "
                  "silence this.")
    return False


def _check_emulate(emulate: Any) -> Optional[bool]:
    if emulate is not None and not isinstance(emulate, bool):
        raise TypeError(f"emulate must be None, True or False, got {type(emulate).__name__} "
                        f"{emulate!r}")
    return emulate


def scaled_dot_product_attention(query: Tensor, key: Tensor, value: Tensor,
                                 attn_mask: Optional[Tensor] = None, dropout_p: float = 0.0,
                                 is_causal: bool = False, scale: Optional[float] = None,
                                 enable_gqa: bool = False, *,
                                 emulate: Optional[bool] = None) -> Tensor:
    """``F.scaled_dot_product_attention`` with fp8 q, k, v (the module docstring's recipe).

    Args:
        query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa: as for
            torch's function; a call fp8 cannot run (:func:`check_fp8_attention`) runs
            torch's attention instead, with a warning naming why.
        emulate: None: the Triton kernels where they run (:func:`kernels_unavailable`),
            else emulation with a one-time warning; True: always emulate; False:
            RuntimeError where the kernels cannot run (a call that falls back to torch's
            attention does so whatever ``emulate`` says).

    Returns:
        The attention output, in the autocast dtype inside an autocast region (as torch's),
        else in the inputs' dtype.

    Example:
        >>> q = torch.randn(2, 4, 16, 64, requires_grad=True)
        >>> out = scaled_dot_product_attention(q, q, q, emulate=True)
        >>> out.sum().backward(); q.grad.dtype
        torch.float32
    """
    emulate = _check_emulate(emulate)
    _check_flags(is_causal, scale, enable_gqa)
    why = _why_not(query, key, value, attn_mask, dropout_p, enable_gqa)
    if why is not None:
        reason = why[1]
        warn_once(("fp8-attention-fallback", why[0]),
                  f"ampkit.fp8: this attention runs in high precision, not fp8: {reason} "
                  "(said once per kind of reason)")
        extra = {"enable_gqa": True} if enable_gqa else {}  # torch < 2.5 has no enable_gqa
        return F.scaled_dot_product_attention(query, key, value, attn_mask, dropout_p, is_causal,
                                              scale=scale, **extra)
    sm_scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale)
    # Dynamo refuses one tensor in two inputs of an autograd.Function: self-attention on
    # one tensor passes views of it instead (no copy; gradients still add up).
    if key is query:
        key = key.view_as(key)
    if value is query or value is key:
        value = value.view_as(value)
    return _Fp8AttentionFn.apply(query, key, value, is_causal, sm_scale,
                                 _native(query.device, emulate), autocast_output_dtype(query))


class _Regions(threading.local):
    """This thread's open fp8_attention regions, innermost last, and the one routing mode
    the outermost enabled region pushed."""

    def __init__(self) -> None:
        self.entries: list[tuple[bool, Optional[bool]]] = []  # (enabled, emulate)
        self.mode: Optional[_RouteAttention] = None


_regions = _Regions()


class _RouteAttention(TorchFunctionMode):
    """Sends torch's scaled_dot_product_attention to ampkit's while the innermost region of
    this thread is enabled; everything else passes."""

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: tuple = (),
                           kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention and _regions.entries:  # mode off in here
            enabled, emulate = _regions.entries[-1]
            if enabled:
                return scaled_dot_product_attention(*args, **kwargs, emulate=emulate)
        elif func is F.multi_head_attention_forward and _regions.entries[-1:] \
                and _regions.entries[-1][0]:
            warn_once(("fp8-attention-fallback", "multi_head_attention"),
                      "ampkit.fp8: this attention runs in high precision, not fp8: "
                      "nn.MultiheadAttention calls torch's attention from inside "
                      "F.multi_head_attention_forward, where fp8_attention() cannot route it; "
                      "call ampkit.fp8.scaled_dot_product_attention in an attention module "
                      "of yours (said once per kind of reason)")
        return func(*args, **kwargs)


class fp8_attention:
    """Run every ``F.scaled_dot_product_attention`` call in this region (in this thread)
    in fp8, through :func:`scaled_dot_product_attention`.

    Backward may run outside the region: the fp8 recipe is recorded with the forward.
    ``enabled=False`` makes the region a no-op (one loop serves every precision); nested
    inside an enabled region it turns fp8 off for its body, as a nested
    ``autocast(enabled=False)`` does. Each torch function called in an enabled region
    passes through one Python check (a few microseconds of host time per op): enter it
    around the model's forward.

    Not routed: calls made inside another torch function that dispatches through
    ``__torch_function__`` (``F.multi_head_attention_forward``, so ``nn.MultiheadAttention``),
    and a recomputation under ``torch.utils.checkpoint``, which runs outside the region
    unless given it: ``checkpoint(f, x, use_reentrant=False,
    context_fn=lambda: (fp8_attention(), fp8_attention()))``.

    Example:
        >>> with fp8_attention(enabled=False):
        ...     pass
    """

    def __init__(self, enabled: bool = True, *, emulate: Optional[bool] = None) -> None:
        self.enabled = check_bool("enabled", enabled)
        self.emulate = _check_emulate(emulate)
        self._pushed: list[bool] = []  # per open entry of this object: pushed the mode?

    def __enter__(self) -> "fp8_attention":
        push = self.enabled and _regions.mode is None
        if push:
            mode = _RouteAttention()
            mode.__enter__()
            _regions.mode = mode
        _regions.entries.append((self.enabled, self.emulate))
        self._pushed.append(push)
        return self

    def __exit__(self, *exc: Any) -> None:
        _regions.entries.pop()
        if self._pushed.pop():
            mode, _regions.mode = _regions.mode, None
            mode.__exit__(*exc)
