"""The warning for an optimizer that steps fp16 parameters itself with an ``eps`` that fp16
rounds to 0 (O3 in fp16, ``16-true``): checked when ampkit prepares the optimizer and for
each parameter group added later (``optim.py``)."""

from __future__ import annotations

import torch

from ._warn import warn_once


def warn_if_eps_vanishes(optimizer: torch.optim.Optimizer, groups: list[dict]) -> None:
    """Warn where the optimizer steps fp16 params of ``groups`` itself with an ``eps``
    fp16 rounds to 0 (checked at initialize and for each group added later).

    Adam's (and RMSprop's, Adagrad's) state is then fp16 too, and its for-loop and
    foreach steps compute in fp16: the square of a gradient below about 5e-3 underflows
    to a zero second moment, and the update divides by ``sqrt(0) + 0``: inf or NaN
    reaches the weight at the first step, which no loss scale can catch (apex's O3 did
    the same; torch's default eps, 1e-8, is below fp16's smallest subnormal). A fused Adam
    or AdamW step computes in fp32 and is spared; fused Adagrad (a CPU kernel) is not.
    """
    spared = not isinstance(optimizer, torch.optim.Adagrad)  # (its fused groups)
    for group in groups:
        eps = group.get("eps")
        if (not (group.get("fused") and spared) and isinstance(eps, (int, float))
                and not isinstance(eps, bool) and eps > 0
                and float(torch.tensor(eps, dtype=torch.float16)) == 0
                and any(p.dtype == torch.float16 for p in group["params"])):
            name = type(optimizer).__name__
            warn_once(("fp16 eps", name, eps),
                      f"{name} steps fp16 parameters itself (no fp32 master weights) with "
                      f"eps={eps:g}, which rounds to 0 in fp16: wherever a gradient's square "
                      "underflows (gradients below about 5e-3) its update divides by zero, and "
                      "inf or NaN reaches the weights at the first step. Use eps=1e-4 (ampkit "
                      "bench's choice for fp16 AdamW), a fused Adam or AdamW (fused=True: it "
                      "computes in fp32; fused Adagrad does not), or opt_level='O2' for fp32 "
                      "masters")
            return
