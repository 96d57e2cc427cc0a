"""FLOPs of the matmuls and convolutions that actually ran, by the dtype they ran in.

A ``TorchDispatchMode`` sees every aten op below autocast, so an op autocast cast to
bf16 is seen with bf16 operands and one it kept in fp32 with fp32 ones. The FLOPs of
each op come from torch's own formulas (``torch.utils.flop_counter.flop_registry``:
mm, addmm, bmm, baddbmm, convolution and its backward, ``_scaled_mm``, attention;
2*M*N*K per matmul), and ampkit's for those torch has none for (matrix-vector and vector
products, nn.Bilinear's ``_trilinear``, flash attention on the CPU, oneDNN's RNN layer), so
forward and backward are both counted.

Emulated fp8: where there are no fp8 tensor cores, ``Float8Linear`` widens its fp8
operands to fp32 and multiplies those; such a matmul is counted under the fp8 dtype its
operands came from (what the GEMM is on fp8 hardware), not as fp32 work.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Optional

import torch
from torch import Tensor
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count
from torch.utils.weak import WeakIdKeyDictionary

from .._torch_compat import (EagerDispatchMode, aten_to_copy, cpu_attention,
                             cpu_attention_backward, rnn_layer, rnn_layer_backward, trilinear)

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def _rnn_layer_flops(inputs: Tensor, w_ih: Tensor, w_hh: Tensor) -> int:
    """One RNN layer over a sequence: per time step and sample, the input and hidden
    matmuls of every gate (the weights' shapes hold the gate count: 4 LSTM, 3 GRU)."""
    steps_by_batch = inputs.numel() // w_ih.shape[1]
    return 2 * steps_by_batch * (w_ih.numel() + w_hh.numel())


def _trilinear_flops(i1: Tensor, i2: Tensor, i3: Tensor, expand1: Any, expand2: Any,
                     expand3: Any, *_: Any, **__: Any) -> int:
    """``_trilinear``: each operand unsqueezed at its ``expand`` dims, the three multiplied
    over their broadcast shape and summed (nn.Bilinear: 2 * batch * out * in1 * in2)."""
    shapes = []
    for tensor, expand in ((i1, expand1), (i2, expand2), (i3, expand3)):
        shape = list(tensor.shape)
        for dim in sorted(expand):
            shape.insert(dim, 1)
        shapes.append(shape)
    return 2 * torch.Size(torch.broadcast_shapes(*shapes)).numel()


# Formulas for what torch's flop_registry has none for (its formulas otherwise): matrix-vector
# and vector products (a matmul with a 1-D operand), nn.Bilinear's kernel, flash attention on
# the CPU (transformers' attention there) and oneDNN's RNN layer (nn.LSTM, nn.GRU on the CPU),
# backward twice the forward's matmuls.
_EXTRA_FORMULAS = {
    torch.ops.aten.mv: lambda mat, vec, *_, **__: 2 * mat.numel(),
    torch.ops.aten.addmv: lambda _, mat, vec, *__, **___: 2 * mat.numel(),
    torch.ops.aten.dot: lambda a, b, *_, **__: 2 * a.numel(),
    torch.ops.aten.vdot: lambda a, b, *_, **__: 2 * a.numel(),
    trilinear: _trilinear_flops,
    cpu_attention: lambda q, k, v, *_, **__: sdpa_flop_count(q.shape, k.shape, v.shape),
    cpu_attention_backward: lambda grad, q, k, v, *_, **__: sdpa_backward_flop_count(
        grad.shape, q.shape, k.shape, v.shape),
    rnn_layer: lambda x, w_ih, w_hh, *_, **__: _rnn_layer_flops(x, w_ih, w_hh),
    rnn_layer_backward: lambda x, w_ih, w_hh, *_, **__: 2 * _rnn_layer_flops(x, w_ih, w_hh),
}


class FlopCounter(EagerDispatchMode):
    """Counts matmul and convolution FLOPs by operand dtype while it is entered.

    Example:
        >>> with FlopCounter() as counter:
        ...     _ = torch.ones(2, 3) @ torch.ones(3, 4)
        >>> counter.flops
        {'float32': 48}
    """

    def __init__(self) -> None:
        super().__init__()
        self._counts: dict[str, int] = defaultdict(int)
        # fp32 tensors widened from fp8 (emulated fp8 GEMM operands) -> that fp8 dtype.
        self._widened: WeakIdKeyDictionary = WeakIdKeyDictionary()

    @property
    def flops(self) -> dict[str, int]:
        """{dtype name: FLOPs} counted so far."""
        return dict(self._counts)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = flop_registry.get(func.overloadpacket)
        if formula is not None:
            self._counts[self._dtype_name(args)] += int(formula(*args, **kwargs, out_val=out))
        elif func.overloadpacket in _EXTRA_FORMULAS:
            flops = _EXTRA_FORMULAS[func.overloadpacket](*args, **kwargs)
            self._counts[self._dtype_name(args)] += int(flops)
        elif func is aten_to_copy and isinstance(args[0], Tensor) and args[0].dtype in FP8_DTYPES:
            self._widened[out] = args[0].dtype
        return out

    def _dtype_name(self, args: tuple) -> str:
        """The dtype an op ran in: its first tensor operand's, or the fp8 dtype that all
        its matrix operands were widened from."""
        tensors = [a for a in args if isinstance(a, Tensor)]
        matrices = [t for t in tensors if t.dim() >= 2]
        sources = [self._widened.get(t) for t in matrices]
        if sources and all(s is not None for s in sources):
            return str(sources[0]).replace("torch.", "")
        return str(tensors[0].dtype).replace("torch.", "") if tensors else "unknown"


def low_precision_share(flops: dict[str, int]) -> float:
    """The fraction of ``flops`` that ran in a dtype narrower than fp32 (0.0 when none)."""
    total = sum(flops.values())
    low = sum(n for name, n in flops.items() if _bits(name) < 32)
    return low / total if total else 0.0


def fp8_share(flops: dict[str, int]) -> float:
    """The fraction of ``flops`` that ran in an fp8 dtype (0.0 when none)."""
    total = sum(flops.values())
    return sum(n for name, n in flops.items() if name.startswith("float8")) / total if total else 0.0


def _bits(name: str) -> int:
    dtype = getattr(torch, name, None)
    return dtype.itemsize * 8 if isinstance(dtype, torch.dtype) else 32
