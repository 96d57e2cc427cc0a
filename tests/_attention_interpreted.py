"""ampkit's fp8 attention Triton kernels run on the CPU by Triton's interpreter.

Run as a script with ``TRITON_INTERPRET=1`` set from the start (Triton decides at import
whether its own library functions are interpreted, so this cannot happen inside a test
process that may have imported Triton already). It prints one JSON object: for each case
and dtype, the kernels' SQNRs against the emulated recipe; and the end-to-end path.

Triton 3.6's interpreter has three faults these kernels trip over, mended here:
- it calls ``int()`` on one-element numpy arrays (every runtime loop bound), which numpy
  2.4 refuses;
- its float narrowing does not carry a rounding overflow into the exponent (125.8 cast to
  e4m3 gives 64, not 128) and truncates where no rounding mode is given;
- its dot multiplies bf16 operands as their raw 16-bit patterns.
The mended conversion is torch's own cast (round to nearest even, what the GPU's ``cvt.rn``
does for values in range); the mended dot widens every operand to fp32 with it (exactly)
and accumulates in fp32.
"""

from __future__ import annotations

import builtins
import json
import math

import torch

CASES = [  # (batch, heads, kv_heads, length, k_length, dim, causal); 32-key blocks
    (1, 2, 2, 40, 40, 32, True),
    (2, 4, 2, 33, 50, 64, False),  # grouped-query, L != S, partial blocks
    (1, 2, 1, 50, 33, 32, True),  # causal with L > S: key 32 is in a block of its own
]
DTYPES = ("float32", "float16", "bfloat16")
_TORCH = {"fp64": torch.float64, "fp32": torch.float32, "fp16": torch.float16,
          "bf16": torch.bfloat16, "fp8e4nv": torch.float8_e4m3fn, "fp8e5": torch.float8_e5m2}
_INT = {8: torch.uint8, 16: torch.int16, 32: torch.int32, 64: torch.int64}


def sqnr(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Signal-to-quantisation-noise ratio in dB of ``actual`` against ``expected``."""
    expected = expected.double()
    noise = (actual.double() - expected).norm()
    return math.inf if noise == 0 else float(20 * torch.log10(expected.norm() / noise))


MENDED_TRITON = "3.6."  # the interpreter whose faults _mend_interpreter knows


def _mend_interpreter() -> None:
    import numpy as np
    import triton
    from triton.runtime import interpreter

    assert triton.__version__.startswith(MENDED_TRITON), triton.__version__
    assert all(hasattr(interpreter, name) for name in ("_convert_float", "TensorHandle"))
    assert hasattr(interpreter.InterpreterBuilder, "create_dot")

    class IntMeta(type):
        def __instancecheck__(cls, obj: object) -> bool:
            return isinstance(obj, builtins.int)

        def __call__(cls, x: object = 0, *args: object) -> int:  # type: ignore[override]
            return builtins.int(x.item() if isinstance(x, np.ndarray) else x, *args)

    class Int(metaclass=IntMeta):
        pass

    def convert_float(data, src, dst, rounding_mode):  # type: ignore[no-untyped-def]
        bits_in, bits_out = src.primitive_bitwidth, dst.primitive_bitwidth
        raw = torch.from_numpy(np.ascontiguousarray(data).view(f"int{bits_in}"))
        value = raw.view(_TORCH[src.name]).to(_TORCH[dst.name])
        return value.view(_INT[bits_out]).numpy().view(f"uint{bits_out}").reshape(data.shape)

    def widen(x):  # type: ignore[no-untyped-def]
        if x.dtype.name in ("fp32", "fp64"):
            return x.data
        raw = torch.from_numpy(np.ascontiguousarray(x.data).view(f"int{x.dtype.primitive_bitwidth}"))
        return raw.view(_TORCH[x.dtype.name]).float().numpy()

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):  # type: ignore[no-untyped-def]
        product = np.matmul(widen(a), widen(b), dtype=np.float32)
        return interpreter.TensorHandle(product.astype(d.data.dtype) + d.data, d.dtype.scalar)

    interpreter.int = Int
    interpreter._convert_float = convert_float
    interpreter.InterpreterBuilder.create_dot = create_dot


def _qkv(batch, heads, kv_heads, length, k_length, dim, dtype, seed=0):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(seed)
    shapes = ((batch, heads, length, dim), (batch, kv_heads, k_length, dim),
              (batch, kv_heads, k_length, dim))
    return [torch.randn(s, generator=g).to(dtype) for s in shapes]


def _case(kernels, case, dtype):  # type: ignore[no-untyped-def]
    from ampkit.fp8 import attention

    *shape, dim, causal = case
    q8, k8, v8 = (attention.quantize_heads(t) for t in _qkv(*shape, dim, dtype))
    scale = dim ** -0.5
    out, lse = kernels.forward(q8, k8, v8, causal, scale, dtype)
    ref_out, ref_lse = attention._Emulated.forward(q8, k8, v8, causal, scale, dtype)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to(dtype)
    grads = kernels.backward(grad, q8, k8, v8, ref_out, ref_lse, causal, scale)
    ref_grads = attention._Emulated.backward(grad, q8, k8, v8, ref_out, ref_lse, causal, scale)
    return {"out_dtype": str(out.dtype), "lse_dtype": str(lse.dtype),
            "out": sqnr(out, ref_out), "lse_max_diff": float((lse - ref_lse).abs().max()),
            "shapes_match": all(a.shape == b.shape for a, b in zip(grads, ref_grads)),
            "grads": [sqnr(a, b) for a, b in zip(grads, ref_grads)]}


def _end_to_end(kernels):  # type: ignore[no-untyped-def]
    """The public function on the kernel path (forced: the CPU has no fp8 tensor cores),
    against the emulated path."""
    from ampkit.fp8 import attention

    attention._kernels = lambda: kernels
    attention.kernels_unavailable = lambda device: None
    results = []
    for emulate in (False, True):
        # Made as (batch, seq, heads, dim), used transposed: q, k, v are not contiguous.
        q, k, v = (t.transpose(1, 2).requires_grad_()
                   for t in _qkv(2, 20, 20, 2, 2, 32, torch.float16))
        out = attention.scaled_dot_product_attention(q, k, v, is_causal=True, emulate=emulate)
        out.float().sum().backward()
        results.append((out, [t.grad for t in (q, k, v)]))
    (out, grads), (ref, ref_grads) = results
    return {"out_dtype": str(out.dtype), "grad_dtypes": [str(g.dtype) for g in grads],
            "out": sqnr(out, ref), "grads": [sqnr(a, b) for a, b in zip(grads, ref_grads)]}


def run() -> dict:
    from ampkit.fp8 import _attention_kernels as kernels

    cases = {f"{i}-{d}": _case(kernels, case, getattr(torch, d))
             for i, case in enumerate(CASES) for d in DTYPES}
    return {"cases": cases, "end_to_end": _end_to_end(kernels)}


if __name__ == "__main__":
    _mend_interpreter()
    print(json.dumps(run()))
