"""Which flushed gradient elements are signal: the fp32 reference against a float64 pass.

A gradient that is zero in exact arithmetic comes out of an fp32 backward as rounding
noise: an attention key's bias, say, which softmax ignores (a per-query constant), gets
about 1e-12 from the cancellation of much larger terms. Such noise times the loss scale
can flush to zero in fp16 and count as underflow, though nothing is lost. Magnitude alone
cannot tell it from a real gradient that small (the weight of a layer fed tiny inputs is
exactly that small). One float64 step can: where the fp32 value is signal, it agrees with
the float64 one to about fp32's precision; where it is noise, the float64 value is
smaller by orders of magnitude. Only :func:`signal_underflow` runs it, and only for the
modules whose gradients the advice would flag for underflow.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import Tensor, nn

from .._batch import call_model
from .._dtypes import iter_tensors, map_tensors
from .._reference import copy_model
from .._torch_compat import EagerDispatchMode, seeded_random
from . import numerics as nx

# An fp32 gradient element is signal when it differs from the float64 one by at most this
# fraction of itself (fp32 rounding gives about 1e-7; rounding noise differs by ~100%).
SIGNAL_TOLERANCE = 0.5
_ATEN = torch.ops.aten
_PRINTED = 1 << 16  # elements of each output tensor a fingerprint reads, at most


class _SameRandomness(EagerDispatchMode):
    """The float64 step's random numbers drawn as the fp32 reference drew them.

    Dropout's masks (``bernoulli``, ``native_dropout``) are drawn in fp32 from the rewound
    generator and applied in float64. Any other random op (``randn``, ``rand``,
    ``normal_``...) draws other numbers in float64 than in fp32: it is noted, and the
    step is not used."""

    def __init__(self) -> None:
        super().__init__()
        self.other_random = False

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if not seeded_random(func):
            return func(*args, **kwargs)
        packet = func.overloadpacket
        first = args[0] if args else None
        if not (torch.is_tensor(first) and first.dtype == torch.float64):
            # A draw into another dtype (an fp32 buffer, integers: randint, randperm) is
            # the reference's own; a float64 factory (randn(..., dtype=float64)) is not.
            self.other_random = self.other_random or kwargs.get("dtype") == torch.float64
            return func(*args, **kwargs)
        rest = [a.float() if torch.is_tensor(a) and a.dtype == torch.float64 else a
                for a in args[1:]]
        if packet is _ATEN.bernoulli_:  # in place, as dropout draws its mask on the CPU
            mask = torch.empty_like(first, dtype=torch.float32)
            func(mask, *rest, **kwargs)
            return first.copy_(mask)
        if packet is _ATEN.bernoulli:
            return func(first.float(), *rest, **kwargs).double()
        if packet is _ATEN.native_dropout:  # CUDA's fused dropout: (output, mask)
            p = float(rest[0])
            _, mask = func(first.float(), *rest, **kwargs)
            return first * mask * (1.0 / (1.0 - p) if p < 1.0 else 0.0), mask
        self.other_random = True
        return func(*args, **kwargs)


def fingerprint(output: Any) -> Tensor:
    """[projection, norm, count] of a model's output: its floating tensors dotted with
    fixed pseudo-random weights (a generator of its own: the caller's random numbers are
    not touched), the product of the two vectors' norms, and the number of elements read.
    A projection's typical size is norm / sqrt(count); two runs of the same step agree on
    it to a small fraction of that, even where a loss (a mean after a normalisation, say)
    is rounding noise that two runs cannot agree on. On the
    output's device, float64; no host sync. At most :data:`_PRINTED` evenly strided
    elements of each tensor are read (a language model's logits are gigabytes; a step
    that is not the reference's differs everywhere)."""
    parts = []
    for tensor in iter_tensors(output):
        if tensor.is_floating_point() and tensor.numel():
            values = tensor.detach().reshape(-1)
            values = values[::-(-values.numel() // _PRINTED)].double()
            weights = torch.randn(values.numel(), dtype=torch.float64, device=values.device,
                                  generator=torch.Generator(values.device).manual_seed(0))
            parts.append(torch.stack([(values * weights).sum(),
                                      values.square().sum() * weights.square().sum(),
                                      values.new_tensor(float(values.numel()))]))
    if not parts:
        return torch.zeros(3, dtype=torch.float64)
    total = torch.stack(parts).sum(0)
    return torch.stack([total[0], total[1].sqrt(), total[2]])


def signal_underflow(model: nn.Module, inputs: Any, target: Any,
                     loss: Callable[[Any, Any], Tensor], ref_print: Tensor,
                     refs: dict[str, dict[str, Tensor]], scale: float,
                     dtypes: dict[str, torch.dtype]) -> Optional[dict[str, float]]:
    """Per module of ``refs`` (name -> its own fp32 reference gradients by parameter
    name): the fraction of its nonzero reference gradient elements that are signal and
    flush to zero when multiplied by ``scale`` and cast to ``dtypes[name]``, among its
    nonzero signal elements (0.0 when every element compared is noise); a module none of
    whose gradients could be compared (sparse ones) is left out. None when the
    float64 step cannot run (a model or an op without float64 support) or is not the
    step the reference took: it drew other random numbers, or its output's
    :func:`fingerprint` differs from the reference's ``ref_print`` by more than 1e-4 of
    a projection's typical size. The caller then keeps its own counts. One host sync.

    ``loss(output, target)`` is the step's loss; the model is copied (``model`` is only
    read) and run in float64 on float64 copies of the floating tensors of the batch.
    """
    def widen(tensor: Tensor) -> Tensor:
        return tensor.detach().double() if tensor.is_floating_point() else tensor

    same = _SameRandomness()
    try:
        work = copy_model(model, "inspect").double()
        with torch.enable_grad(), same:
            output = call_model(work, map_tensors(inputs, widen))
            out = loss(output, map_tensors(target, widen))
            if not out.requires_grad:
                return None
            out.backward()
        mine = fingerprint(output)
        del output
    except Exception:  # noqa: BLE001 - no float64 step: the counts stay as they were
        return None
    if same.other_random:
        return None
    modules = dict(work.named_modules())
    names, rows = [], []
    with torch.no_grad():
        for name, grads in refs.items():
            exact = nx.own_grads(modules[name])
            row = torch.zeros(3, dtype=torch.float64, device=ref_print.device)
            for pname, ref in grads.items():
                if ref.is_sparse or pname not in exact or exact[pname].shape != ref.shape:
                    # sparse or unmatched: every element counted, as the table counts it
                    counts = nx.cast_counts(nx.grad_values(ref) * scale, dtypes[name])
                    row += torch.stack([counts[nx.NONZERO], counts[nx.NONZERO],
                                        counts[nx.UNDERFLOW]]).to(row.device)
                    continue
                signal = (ref - exact[pname]).abs() <= SIGNAL_TOLERANCE * ref.abs()
                counts = nx.cast_counts(torch.where(signal, ref, 0.0) * scale, dtypes[name])
                row += torch.stack([(ref != 0).sum().double(), counts[nx.NONZERO],
                                    counts[nx.UNDERFLOW]]).to(row.device)
            names.append(name)
            rows.append(row)
        # [compared, nonzero signal, flushed signal] per module, and the fingerprints: one sync
        prints = torch.stack([mine[0].to(ref_print.device), *ref_print])
        table = torch.stack(rows + [prints[:3], prints[3:].expand(3)]).tolist()
    ours, theirs, norm, count = *table[-2], table[-1][0]
    if not abs(ours - theirs) <= 1e-4 * norm / max(count, 1.0) ** 0.5:
        return None  # not the reference's step
    return {name: (flushed / nonzero if nonzero > 0 else 0.0)
            for name, (compared, nonzero, flushed) in zip(names, table[:-2]) if compared}
