"""The device-side unscale: gradients multiplied by 1/scale in place, inf/NaN flagged.

One fused kernel (torch's ``_amp_foreach_non_finite_check_and_unscale_``) per
(device, dtype) group, grouped in C++; fp32, fp16 and bf16 gradients alike; sparse
gradients have their values unscaled, complex ones their real view (torch's kernel takes
no complex dtype, so torch's GradScaler raises there). Used by ``GradScaler`` and ``scale_loss``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._torch_compat import (amp_foreach_non_finite_check_and_unscale_,
                            group_tensors_by_device_and_dtype, sparse_values)

__all__ = ["unscale_grads_", "unscale_per_device", "fold_into"]


def _dense_values(grad: Tensor) -> Tensor:
    """The tensor to unscale for a gradient: its values when sparse."""
    if not grad.is_sparse:
        return grad
    if grad.dtype is torch.float16 and not grad.is_coalesced():
        # Duplicate indices are summed when the grad is used; summing them while still
        # scaled can overflow fp16, so coalesce first (in place: param.grad stays this tensor).
        grad.copy_(grad.coalesce())
    return sparse_values(grad)


def _real_view(grad: Tensor) -> Tensor:
    """A complex gradient's floats as a real view of its memory. A lazily conjugated one
    (autograd gives the grad of a parameter used as ``p.conj()`` so) is viewed through its
    conjugate, the same memory: a real scale and an inf check act alike on both."""
    return torch.view_as_real(grad.conj() if grad.is_conj() else grad)


def _check_and_unscale(grads: list[Tensor], found_inf: Tensor, inv_scale: Tensor) -> None:
    try:
        amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)
    except NotImplementedError:
        # A sparse grad in the list sends the whole call to the sparse backend, which has
        # no kernel; the dispatch fails before any tensor is touched, so retry on values.
        if not any(g.is_sparse for g in grads):
            raise
        amp_foreach_non_finite_check_and_unscale_(
            [_dense_values(g) for g in grads], found_inf, inv_scale)
    except RuntimeError:
        # Sharded (DTensor) and plain gradients in one list (an FSDP2 model with an
        # unsharded extra parameter): DTensor's dispatch refuses the mix before touching
        # any tensor, so check each kind apart (each DTensor call all-reduces over its mesh).
        kinds: dict[type, list[Tensor]] = {}
        for grad in grads:
            kinds.setdefault(type(grad), []).append(grad)
        if len(kinds) < 2:
            raise
        for group in kinds.values():
            _check_and_unscale(group, found_inf, inv_scale)


def unscale_per_device(grads: list[Tensor], inv_scale: Tensor,
                        found_inf: Tensor) -> dict[torch.device, Tensor]:
    """Check and unscale ``grads`` in place; return the found-inf flag of each device."""
    found_per_device: dict[torch.device, Tensor] = {}
    inv_per_device: dict[torch.device, Tensor] = {}
    if not grads:
        return found_per_device
    # Grouped in C++ (one pass, no Python work per gradient); one kernel per (device, dtype).
    groups = group_tensors_by_device_and_dtype([grads], False)
    # Grad mode off, as under torch.no_grad() (gradients of a create_graph backward require
    # grad), switched directly: the context manager costs twice the host time per step.
    grad_mode = torch.is_grad_enabled()
    torch.set_grad_enabled(False)
    try:
        for (device, dtype), ((group, *_), _indices) in groups.items():
            if dtype.is_complex:  # torch's kernel has none: the same floats, viewed as real
                group = [_real_view(g) for g in group]
            if device not in found_per_device:
                found_per_device[device] = (found_inf if device == found_inf.device
                                            else torch.zeros((), dtype=torch.float32, device=device))
                inv_per_device[device] = (inv_scale if inv_scale.device == device
                                          else inv_scale.to(device, non_blocking=True))
            _check_and_unscale(group, found_per_device[device], inv_per_device[device])
    finally:
        torch.set_grad_enabled(grad_mode)
    return found_per_device


def fold_into(found_inf: Tensor, found_per_device: dict[torch.device, Tensor]) -> None:
    """The flags of the other devices into ``found_inf``: their max, so it stays 0 or 1
    (fused optimizers skip only on exactly 1.0; a sum over two overflowing GPUs was 2.0)."""
    for found in found_per_device.values():
        if found is not found_inf:
            # A device-to-device copy is async; a copy to the CPU must complete first.
            other = found.to(found_inf.device, non_blocking=found_inf.device.type != "cpu")
            torch.maximum(found_inf, other, out=found_inf)


def unscale_grads_(grads: list[Tensor], inv_scale: Tensor, found_inf: Tensor) -> None:
    """Multiply gradients by ``inv_scale`` in place and flag any inf/NaN in ``found_inf``.

    Shared with ``ampkit.frontend``. One fused kernel per (device, dtype) group; fp32,
    fp16 and bf16 gradients alike (half gradients are multiplied in fp32 and rounded
    back, so tiny values can flush to zero). Sparse gradients have their values unscaled.
    No host sync.

    Args:
        grads: gradients on any devices and floating dtypes.
        inv_scale: 1-element float32 tensor, e.g. ``scaler.inverse_scale()``.
        found_inf: 1-element float32 tensor (on the scale's device); it is set non-zero if
            any gradient holds an inf or NaN and is never reset, so it accumulates.

    Example::

        inv_scale = scaler.inverse_scale()
        found_inf = torch.zeros((), device=inv_scale.device)
        unscale_grads_([p.grad for p in params], inv_scale, found_inf)
        scaler.update_from(found_inf)
    """
    fold_into(found_inf, unscale_per_device(grads, inv_scale, found_inf))


