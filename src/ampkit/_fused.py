"""Around a fused optimizer's step that reads an overflow flag on the device: the repair
of torch's fused SGD after a skipped first step.

torch's ``SGD(fused=True)`` with momentum creates its momentum buffers with
``torch.empty_like`` on its first step, and its kernel leaves everything untouched when
``found_inf`` is set: a skipped first step (the usual fp16 overflow at the start of a
run) leaves the buffers uninitialised, and the next step reads that memory (often NaN)
into the weights. Both of ampkit's fused paths (``GradScaler.step`` and the step after
``scale_loss``) zero such buffers on the device when the step was skipped: the next step
then starts the momentum from the gradient, as a first step does (exactly so with the
default ``dampening=0``; with ``dampening=d`` it starts from ``(1 - d)`` times it). No host
sync; nothing is done once the buffers exist.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor


def fresh_momentum(optimizer: torch.optim.Optimizer) -> list[dict]:
    """The param groups of a fused SGD whose next step creates their momentum buffers."""
    if not isinstance(optimizer, torch.optim.SGD):
        return []
    fresh = []
    for group in optimizer.param_groups:
        if not group.get("fused") or not group.get("momentum"):
            continue
        # torch makes the buffers when none of the group's params with a grad has one:
        # the first such param tells (one lookup per group and step).
        first = next((p for p in group["params"] if p.grad is not None), None)
        if first is not None and optimizer.state.get(first, {}).get("momentum_buffer") is None:
            fresh.append(group)
    return fresh


def clear_if_skipped(optimizer: torch.optim.Optimizer, groups: list[dict],
                     found_inf: Optional[Tensor]) -> None:
    """After the step: the buffers ``groups`` got are zeroed where ``found_inf`` is set."""
    if not groups or found_inf is None:
        return
    flags: dict[torch.device, Tensor] = {}
    for group in groups:
        for param in group["params"]:
            buf = optimizer.state.get(param, {}).get("momentum_buffer")
            if buf is None:
                continue
            flag = flags.get(buf.device)
            if flag is None:
                flag = flags[buf.device] = found_inf.to(buf.device).reshape(()) > 0
            buf.masked_fill_(flag, 0.0)
