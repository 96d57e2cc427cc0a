"""The move of O2's half gradients into fp32: per device, in a few buckets.

:class:`ampkit.master.MasterWeights` plans the move once (:func:`plan`) and converts with
:func:`to_fp32`: one buffer and one foreach copy per bucket (O(buckets) host work, no
kernel per gradient), each bucket's half gradients freed once copied.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Optional

import torch
from torch import Tensor

from ._torch_compat import foreach_copy_, unflatten_dense_tensors

# The move converts a device's half gradients in up to this many buckets, freeing each
# bucket's half gradients once it is copied: the move then holds at most 1/8 of them
# twice. A bucket holds at least _MIN_BUCKET elements (256 KiB in fp32), so a small model
# moves in one bucket (each bucket costs a few host-side ops).
_BUCKETS = 8
_MIN_BUCKET = 1 << 16
# A bucket of at most this many gradients casts each one (a kernel per gradient, still at
# most _FEW per bucket): cheaper on the host than a buffer, its views (two ops per
# gradient, made each step) and one copy: 25 against 80 us for the 4 gradients of a small
# MLP on a CPU (benchmarks/bench_host.py's mlp).
_FEW = 8


# (sparse gradient indices, strided indices, [(device, [(bucket indices, bucket numel)])]):
# how a move converts the gradients of a list of params.
Plan = tuple[list[int], list[int], list[tuple[torch.device, list[tuple[list[int], int]]]]]


def plan(params: list[Tensor], masters: list[Tensor]) -> Plan:
    """Sparse gradients apart, and those of masters in another memory layout than the
    contiguous one (channels_last); the rest per device, cut into buckets (see _buckets)."""
    sparse: list[int] = []
    strided: list[int] = []
    dense: dict[torch.device, list[int]] = defaultdict(list)
    for i, (param, master) in enumerate(zip(params, masters)):
        if param.grad.is_sparse:
            sparse.append(i)
        elif not master.is_contiguous():
            strided.append(i)
        else:
            dense[param.grad.device].append(i)
    devices = []
    for device, indices in dense.items():
        numels = [params[i].numel() for i in indices]
        size_of = dict(zip(indices, numels))
        devices.append((device, [(bucket, sum(size_of[i] for i in bucket))
                                 for bucket in _buckets(indices, numels)]))
    return sparse, strided, devices


def to_fp32(params: list[Tensor], masters: list[Tensor], plan_: Optional[Plan] = None, *,
             free: bool = True) -> list[Tensor]:
    """fp32 copies of the params' half gradients, each in its master's memory layout (a
    fused optimizer pairs a param's and its gradient's elements by memory position); the
    half gradients are freed (set to None) unless ``free`` is False.

    Those of contiguous masters: one buffer, one call for its views and one foreach copy
    per bucket of a device (O(buckets) copies, no kernel per gradient), or one cast per
    gradient in a bucket of at most _FEW; the others (sparse, channels_last) one by one.
    ``plan_``: :func:`plan` of them, when the caller has it already.
    """
    sparse, strided, devices = (plan_ if plan_ is not None else plan(params, masters))
    out: list[Optional[Tensor]] = [None] * len(params)
    for i in sparse:
        out[i] = params[i].grad.float()
    for i in strided:
        out[i] = torch.empty_like(masters[i], dtype=torch.float32).copy_(params[i].grad)
    if free:
        for i in sparse + strided:
            params[i].grad = None
    for device, buckets in devices:
        for bucket, numel in buckets:
            grads = [params[i].grad for i in bucket]
            if len(grads) <= _FEW:
                views = [grad.to(torch.float32, memory_format=torch.contiguous_format)
                         for grad in grads]
            else:
                flat = torch.empty(numel, dtype=torch.float32, device=device)
                views = unflatten_dense_tensors(flat, grads)
                foreach_copy_(views, grads)
            for i, view in zip(bucket, views):
                out[i] = view
            if free:
                for param in [params[i] for i in bucket]:
                    param.grad = None
    return out  # type: ignore[return-value]


def _buckets(indices: list[int], sizes: list[int]) -> list[list[int]]:
    """``indices`` in order, cut into at most _BUCKETS runs of about equal total size."""
    target = max(_MIN_BUCKET, -(-sum(sizes) // _BUCKETS))
    buckets: list[list[int]] = [[]]
    filled = 0
    for index, size in zip(indices, sizes):
        if filled >= target:
            buckets.append([])
            filled = 0
        buckets[-1].append(index)
        filled += size
    return buckets
