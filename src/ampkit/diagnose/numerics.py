"""The numbers a report is made of: cast counts, error energies, SQNR in dB.

Everything here stays on the tensors' device and returns small float64 tensors that a
caller adds up over calls, parameters and tensors, then reads back once (one host sync
per report, not one per module). Sums are float64: a sum of squares of fp32 values
above ~1.8e19 would overflow in fp32, and half-precision errors are tiny next to signals.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor, nn

# Slots of cast_counts' result.
NONZERO, UNDERFLOW, FINITE, OVERFLOW = range(4)
# Slots of error_energy's result.
SIGNAL, NOISE = range(2)


def cast_counts(ref: Tensor, dtype: torch.dtype) -> Tensor:
    """What casting ``ref`` to ``dtype`` does: [nonzero, became 0, finite, became inf].

    ``ref`` is an fp32 reference value; a cast to fp32 (a pure-fp32 policy) changes
    nothing, so it counts no underflow and no overflow.

    Example:
        >>> cast_counts(torch.tensor([1e-9, 1e5, 0.0, 1.0]), torch.float16).tolist()
        [3.0, 1.0, 4.0, 1.0]
    """
    ref = ref.detach()
    cast = ref.to(dtype)
    nonzero = ref != 0
    finite = ref.isfinite()
    return torch.stack([nonzero.sum(), (nonzero & (cast == 0)).sum(),
                        finite.sum(), (finite & cast.isinf()).sum()]).double()


def dense_values(tensor: Tensor) -> Tensor:
    """A nested tensor's values as one flat dense tensor (nn.TransformerEncoder's output
    with a padding mask in eval mode); any other tensor as it is. Reductions and casts
    counted over a nested tensor would raise (no kernel for them)."""
    if not tensor.is_nested:
        return tensor
    return torch.cat([part.reshape(-1) for part in tensor.unbind()])


def stored_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a value of ``dtype`` is counted against: itself when narrower than fp32
    (fp16, bf16, fp8), else fp32 (fp32 and wider hold every fp32 reference value).

    Example:
        >>> stored_dtype(torch.float16), stored_dtype(torch.float64)
        (torch.float16, torch.float32)
    """
    return dtype if torch.finfo(dtype).bits < 32 else torch.float32


def error_energy(value: Tensor, ref: Tensor) -> Tensor:
    """[signal, noise]: sum(ref**2) and sum((value - ref)**2) where ``ref`` is finite.

    A non-finite ``value`` where the reference is finite makes the noise inf (or NaN,
    read as inf by :func:`sqnr_db`). Shapes must match.

    Example:
        >>> error_energy(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 1.0])).tolist()
        [2.0, 1.0]
    """
    ref = ref.detach().double()
    diff = value.detach().double() - ref
    finite = ref.isfinite()
    zero = ref.new_zeros(())
    return torch.stack([torch.where(finite, ref.square(), zero).sum(),
                        torch.where(finite, diff.square(), zero).sum()])


def sqnr_db(signal: float, noise: float) -> float:
    """10*log10(signal / noise) in dB: inf when identical, -inf when all noise.

    Example:
        >>> sqnr_db(100.0, 1.0), sqnr_db(1.0, 0.0), sqnr_db(0.0, 1.0)
        (20.0, inf, -inf)
    """
    if math.isnan(noise) or math.isinf(noise) or (signal == 0.0 and noise > 0.0):
        return -math.inf
    if noise == 0.0:
        return math.inf
    return 10.0 * math.log10(signal / noise)


def fraction(part: float, whole: float) -> float:
    """``part / whole``, 0.0 when there is nothing to count."""
    return part / whole if whole > 0 else 0.0


def first_floating(values: list[Tensor]) -> Optional[torch.dtype]:
    """The dtype of the first floating tensor of ``values`` (None when there is none)."""
    return next((t.dtype for t in values if t.is_floating_point()), None)


def own_grads(module: nn.Module) -> dict[str, Tensor]:
    """The module's own parameter gradients; a sparse one (nn.Embedding(sparse=True))
    coalesced: one value per index, as the optimizer applies it."""
    return {name: p.grad.coalesce() if p.grad.is_sparse else p.grad
            for name, p in module.named_parameters(recurse=False) if p.grad is not None}


def grad_values(grad: Tensor) -> Tensor:
    """The values a report counts: a sparse gradient's stored values (its implicit zeros
    are neither nonzero nor able to overflow), a dense gradient itself."""
    return grad.values() if grad.is_sparse else grad


def comparable(grad: Tensor, ref: Tensor) -> Optional[tuple[Tensor, Tensor]]:
    """(policy values, reference values) at the same positions, None when the shapes differ.

    Sparse gradients are compared by their values when both store the same indices (the
    same batch: the usual case; one host sync each); otherwise as dense tensors."""
    if grad.shape != ref.shape:
        return None
    if not (grad.is_sparse or ref.is_sparse):
        return grad, ref
    if grad.is_sparse and ref.is_sparse and torch.equal(grad.indices(), ref.indices()):
        return grad.values(), ref.values()
    return grad.to_dense(), ref.to_dense()
