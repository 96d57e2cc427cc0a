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
from .._dtypes import map_tensors
from .._reference import copy_model
from .._torch_compat import EagerDispatchMode, seeded_random
from . import numerics as nx

# An fp32 gradient element is signal when it differs from the float64 one by at most this
# fraction of itself (fp32 rounding gives about 1e-7; rounding noise differs by ~100%).
SIGNAL_TOLERANCE = 0.5
_ATEN = torch.ops.aten


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


def signal_underflow(model: nn.Module, inputs: Any, target: Any,
                     loss: Callable[[Any, Any], Tensor], ref_loss: float,
                     refs: dict[str, dict[str, Tensor]], scale: float,
                     dtypes: dict[str, torch.dtype]) -> Optional[dict[str, float]]:
    """Per module of ``refs`` (name -> its own fp32 reference gradients by parameter
    name): the fraction of its nonzero reference gradient elements that are signal and
    flush to zero when multiplied by ``scale`` and cast to ``dtypes[name]``, among its
    nonzero signal elements (0.0 when every element compared is noise); a module none of
    whose gradients could be compared (sparse ones) is left out. None when the
    float64 step cannot run (a model or an op without float64 support) or is not the
    step the reference took (its loss differs from ``ref_loss`` by more than 0.1%: random
    numbers drawn otherwise in float64, say): the caller keeps its own counts.

    ``loss(output, target)`` is the step's loss; the model is copied (``model`` is only
    read) and run in float64 on float64 copies of the floating tensors of the batch.
    """
    def widen(tensor: Tensor) -> Tensor:
        return tensor.detach().double() if tensor.is_floating_point() else tensor

    same = _SameRandomness()
    try:
        work = copy_model(model, "inspect").double()
        with torch.enable_grad(), same:
            out = loss(call_model(work, map_tensors(inputs, widen)), map_tensors(target, widen))
            if not out.requires_grad:
                return None
            out.backward()
    except Exception:  # noqa: BLE001 - no float64 step: the counts stay as they were
        return None
    if same.other_random or not abs(out.item() - ref_loss) <= 1e-3 * abs(ref_loss):
        return None
    modules = dict(work.named_modules())
    result = {}
    with torch.no_grad():
        for name, grads in refs.items():
            exact = nx.own_grads(modules[name])
            compared = nonzero = flushed = 0
            for pname, ref in grads.items():
                if ref.is_sparse or pname not in exact or exact[pname].shape != ref.shape:
                    continue  # sparse or unmatched: counted as the table counts them
                signal = (ref - exact[pname]).abs() <= SIGNAL_TOLERANCE * ref.abs()
                counts = nx.cast_counts(torch.where(signal, ref, 0.0) * scale, dtypes[name])
                compared += int((ref != 0).sum())
                nonzero, flushed = nonzero + counts[nx.NONZERO], flushed + counts[nx.UNDERFLOW]
            if compared:  # every compared element noise: nothing of it is signal to lose
                result[name] = float(flushed / nonzero) if nonzero > 0 else 0.0
    return result
