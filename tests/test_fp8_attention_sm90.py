"""The fp8 attention kernels compile for Hopper (sm90) and fit its shared memory, on a CPU.

Triton compiles for a target it is told (``GPUTarget("cuda", 90, 32)``) without a GPU,
down to PTX and, with the ptxas it bundles, to cubin. A kernel whose tiles need more shared
memory than an H100/H200 block has would compile here and fail at its first launch there:
this checks the launch options ``_attention_kernels`` uses against that limit. Slow (up to
a minute and a half per kernel on two cores), so only the largest configurations.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util

import pytest
import torch

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("triton") is None
                                 or not importlib.metadata.version("triton").startswith("3.6."),
                                 reason="needs Triton 3.6.x (its compiler API; CI installs it)")]

SM90_SHARED_BYTES = 232448  # 227 KiB: the most one block may take on sm90
_POINTERS = {"Q": "*fp8e4nv", "K": "*fp8e4nv", "V": "*fp8e4nv", "QI": "*fp32", "KI": "*fp32",
             "VI": "*fp32", "Lse": "*fp32", "Delta": "*fp32", "DK": "*fp32", "DV": "*fp32",
             "DQ": "*fp32"}
_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def compile_sm90(kind: str, dim: int, dtype: torch.dtype) -> object:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from ampkit.fp8 import _attention_kernels as kernels

    pointers = dict(_POINTERS, Out=f"*{_NAMES[dtype]}", DO=f"*{_NAMES[dtype]}")
    if kind == "forward":
        fn, launch = kernels._forward_kernel, kernels.forward_launch(dim)
        constants = dict(P_MUL=kernels.P_SCALE)
    else:
        fn = kernels._dkdv_kernel if kind == "dkdv" else kernels._dq_kernel
        launch = kernels.backward_launch(dim, dtype)
        constants = dict(DT=kernels._TL_DTYPES[dtype], PREC=kernels.precision(dtype))
    constants.update(DIM=dim, BLOCK_M=launch.block_m, BLOCK_N=launch.block_n, CAUSAL=True)
    signature, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constants:
            signature[name] = "constexpr"
        elif name in pointers:
            signature[name] = pointers[name]
            attrs[(i,)] = [["tt.divisibility", 16]]  # torch's allocations are aligned
        else:
            signature[name] = "fp32" if name == "sm_scale" else "i32"
    source = ASTSource(fn, signature, constants, attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=launch.num_warps, num_stages=launch.num_stages))


@pytest.mark.parametrize("kind, dim, dtype", [
    ("forward", 256, torch.bfloat16),  # the forward's largest tiles
    ("dkdv", 256, torch.float32),  # the most shared memory (fp32 operands, widest heads)
    ("dq", 256, torch.float32),
])
def test_kernel_compiles_for_sm90_within_its_shared_memory(kind, dim, dtype):
    compiled = compile_sm90(kind, dim, dtype)
    assert 0 < compiled.metadata.shared <= SM90_SHARED_BYTES
    if kind == "forward":  # fp8 operands on Hopper's wgmma tensor-core path
        assert "wgmma" in compiled.asm["ptx"] and "e4m3" in compiled.asm["ptx"]
