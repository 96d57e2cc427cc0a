"""Triton kernels of fp8 attention (attention.py's recipe), flash-attention style.

Forward: one program per (block of queries, batch x head). Each block of keys gives fp8
``q k^T`` with fp32 accumulation, an online softmax in fp32 (a running row max and sum),
and ``p v`` on fp8 tensor cores with p stored as e4m3 times ``P_SCALE``. It writes the
output and the row log-sum-exp; the (L, S) matrix never reaches memory.

Backward, in the compute dtype (fp8 operands dequantised in registers, exactly, since
their scales are powers of two): one program per block of keys accumulates dK and dV
over the queries, one per block of queries accumulates dQ over the keys, both
recomputing ``p = exp(s - lse)`` as flash attention does. Grouped-query attention gives
each query head its own dK, dV rows, summed per group afterwards.

Importing this module imports Triton; attention.py imports it only where the kernels
run. With ``TRITON_INTERPRET=1`` set before the import, the kernels run on CPU tensors
(the tests check them that way against the emulation).
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from .scaling import ATTENTION_P_SCALE as P_SCALE
from .scaling import Fp8

_TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


@triton.jit
def _program(heads, kv_heads, span, BLOCK: tl.constexpr):
    """This program's first row of ``span`` (in blocks of BLOCK) and its (batch x query
    head, batch, query head, key/value head), the latter in 64 bits: offsets of batch *
    heads * seq * dim elements may pass 2**31. One flat grid, a head's blocks side by side
    (see :func:`_grid`)."""
    pid = tl.program_id(0)
    blocks = tl.cdiv(span, BLOCK)
    bh = (pid // blocks).to(tl.int64)
    b, h = bh // heads, bh % heads
    return (pid % blocks) * BLOCK, bh, b, h, h // (heads // kv_heads)


@triton.jit
def _load_grad_rows(do_base, lse_base, delta_base, offs_m, length, offs_d, s_om,
                    DT: tl.constexpr):
    """dO (rows, DIM) in DT, and the rows' lse and rowsum(dO * O), for one query block."""
    rows = offs_m < length
    d_o = tl.load(do_base + offs_m[:, None] * s_om + offs_d[None, :], mask=rows[:, None],
                  other=0.0).to(DT)
    lse = tl.load(lse_base + offs_m, mask=rows, other=0.0)
    return d_o, lse, tl.load(delta_base + offs_m, mask=rows, other=0.0)


@triton.jit
def _forward_block(q, k_base, v_base, s_kn, s_vn, s_vd, qk_scale, offs_m, offs_n, offs_d,
                   k_length, m_i, l_i, acc, DIM: tl.constexpr, BLOCK_N: tl.constexpr,
                   CAUSAL: tl.constexpr, P_MUL: tl.constexpr):
    """One block of keys into the online softmax: the new row max, row sum, accumulator."""
    k = tl.load(k_base + offs_n[None, :] * s_kn + offs_d[:, None],
                mask=offs_n[None, :] < k_length, other=0.0)
    # Hopper's fp8 tensor cores add in reduced precision: each dot's sum is promoted to
    # fp32 (max_num_imprecise_acc = its K), never carried imprecisely across blocks.
    s = tl.dot(q, k, max_num_imprecise_acc=DIM) * qk_scale
    valid = offs_n[None, :] < k_length
    if CAUSAL:
        valid = valid & (offs_n[None, :] <= offs_m[:, None])
    s = tl.where(valid, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    v = tl.load(v_base + offs_n[:, None] * s_vn + offs_d[None, :] * s_vd,
                mask=offs_n[:, None] < k_length, other=0.0)
    p_v = tl.dot((p * P_MUL).to(tl.float8e4nv), v, max_num_imprecise_acc=BLOCK_N)
    return m_new, l_i * alpha + tl.sum(p, 1), acc * alpha[:, None] + p_v


@triton.jit
def _forward_kernel(Q, K, V, QI, KI, VI, Out, Lse, sm_scale,
                    s_qb, s_qh, s_qm, s_kb, s_kh, s_kn, s_vb, s_vh, s_vn, s_vd, s_ob, s_oh, s_om,
                    heads, kv_heads, length, k_length,
                    DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    CAUSAL: tl.constexpr, P_MUL: tl.constexpr):
    start_m, bh, b, h, hk = _program(heads, kv_heads, length, BLOCK_M)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, DIM)
    q = tl.load(Q + b * s_qb + h * s_qh + offs_m[:, None] * s_qm + offs_d[None, :],
                mask=offs_m[:, None] < length, other=0.0)
    # Scores in the exp2 domain: exp(x) == exp2(x * log2(e)).
    qk_scale = sm_scale * tl.load(QI + b * heads + h) * tl.load(KI + b * kv_heads + hk) * 1.4426950408889634
    k_base = K + b * s_kb + hk * s_kh
    v_base = V + b * s_vb + hk * s_vh
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DIM], tl.float32)
    end = tl.minimum(k_length, start_m + BLOCK_M) if CAUSAL else k_length
    for start_n in range(0, end, BLOCK_N):
        m_i, l_i, acc = _forward_block(q, k_base, v_base, s_kn, s_vn, s_vd, qk_scale, offs_m,
                                       start_n + tl.arange(0, BLOCK_N), offs_d, k_length,
                                       m_i, l_i, acc, DIM, BLOCK_N, CAUSAL, P_MUL)
    v_inv = tl.load(VI + b * kv_heads + hk)
    out = acc * (v_inv / P_MUL) / l_i[:, None]
    row = offs_m < length
    tl.store(Out + b * s_ob + h * s_oh + offs_m[:, None] * s_om + offs_d[None, :],
             out.to(Out.dtype.element_ty), mask=row[:, None])
    # Natural-log lse (m_i is in log2 units).
    tl.store(Lse + bh * length + offs_m, (m_i + tl.log2(l_i)) * 0.6931471805599453, mask=row)


@triton.jit
def _load_dequantised(ptr, offs_rows, rows, offs_d, s_row, inv_scale, DT: tl.constexpr):
    """A (rows, DIM) block of fp8 rows in DT: exact, the scales being powers of two."""
    x = tl.load(ptr + offs_rows[:, None] * s_row + offs_d[None, :],
                mask=offs_rows[:, None] < rows, other=0.0)
    return (x.to(tl.float32) * inv_scale).to(DT)


@triton.jit
def _dkdv_kernel(Q, K, V, QI, KI, VI, DO, Lse, Delta, DK, DV, sm_scale,
                 s_qb, s_qh, s_qm, s_kb, s_kh, s_kn, s_vb, s_vh, s_vn, s_ob, s_oh, s_om,
                 heads, kv_heads, length, k_length,
                 DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 CAUSAL: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr):
    start_n, bh, b, h, hk = _program(heads, kv_heads, k_length, BLOCK_N)
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, DIM)
    k = _load_dequantised(K + b * s_kb + hk * s_kh, offs_n, k_length, offs_d, s_kn,
                          tl.load(KI + b * kv_heads + hk), DT)
    v = _load_dequantised(V + b * s_vb + hk * s_vh, offs_n, k_length, offs_d, s_vn,
                          tl.load(VI + b * kv_heads + hk), DT)
    q_base, q_inv = Q + b * s_qb + h * s_qh, tl.load(QI + b * heads + h)
    d_k = tl.zeros([BLOCK_N, DIM], tl.float32)
    d_v = tl.zeros([BLOCK_N, DIM], tl.float32)
    lo = (start_n // BLOCK_M) * BLOCK_M if CAUSAL else 0
    for start_m in range(lo, length, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        q = _load_dequantised(q_base, offs_m, length, offs_d, s_qm, q_inv, DT)
        d_o, lse, delta = _load_grad_rows(DO + b * s_ob + h * s_oh, Lse + bh * length,
                                          Delta + bh * length, offs_m, length, offs_d, s_om, DT)
        # Transposed (keys x queries): dV and dK accumulate over the rows of this program.
        s_t = tl.dot(k, tl.trans(q), input_precision=PREC) * sm_scale
        valid = (offs_n[:, None] < k_length) & (offs_m[None, :] < length)
        if CAUSAL:
            valid = valid & (offs_n[:, None] <= offs_m[None, :])
        p_t = tl.where(valid, tl.exp(s_t - lse[None, :]), 0.0)
        d_v += tl.dot(p_t.to(DT), d_o, input_precision=PREC)
        d_p_t = tl.dot(v, tl.trans(d_o), input_precision=PREC)
        d_k += tl.dot((p_t * (d_p_t - delta[None, :])).to(DT), q, input_precision=PREC)
    out_off = bh * k_length * DIM + offs_n[:, None] * DIM + offs_d[None, :]
    tl.store(DK + out_off, d_k * sm_scale, mask=offs_n[:, None] < k_length)
    tl.store(DV + out_off, d_v, mask=offs_n[:, None] < k_length)


@triton.jit
def _dq_kernel(Q, K, V, QI, KI, VI, DO, Lse, Delta, DQ, sm_scale,
               s_qb, s_qh, s_qm, s_kb, s_kh, s_kn, s_vb, s_vh, s_vn, s_ob, s_oh, s_om,
               heads, kv_heads, length, k_length,
               DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               CAUSAL: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr):
    start_m, bh, b, h, hk = _program(heads, kv_heads, length, BLOCK_M)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, DIM)
    rows = offs_m[:, None] < length
    q = _load_dequantised(Q + b * s_qb + h * s_qh, offs_m, length, offs_d, s_qm,
                          tl.load(QI + b * heads + h), DT)
    d_o, lse, delta = _load_grad_rows(DO + b * s_ob + h * s_oh, Lse + bh * length,
                                      Delta + bh * length, offs_m, length, offs_d, s_om, DT)
    k_base, k_inv = K + b * s_kb + hk * s_kh, tl.load(KI + b * kv_heads + hk)
    v_base, v_inv = V + b * s_vb + hk * s_vh, tl.load(VI + b * kv_heads + hk)
    d_q = tl.zeros([BLOCK_M, DIM], tl.float32)
    end = tl.minimum(k_length, start_m + BLOCK_M) if CAUSAL else k_length
    for start_n in range(0, end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k = _load_dequantised(k_base, offs_n, k_length, offs_d, s_kn, k_inv, DT)
        v = _load_dequantised(v_base, offs_n, k_length, offs_d, s_vn, v_inv, DT)
        s = tl.dot(q, tl.trans(k), input_precision=PREC) * sm_scale
        valid = (offs_m[:, None] < length) & (offs_n[None, :] < k_length)
        if CAUSAL:
            valid = valid & (offs_n[None, :] <= offs_m[:, None])
        p = tl.where(valid, tl.exp(s - lse[:, None]), 0.0)
        d_p = tl.dot(d_o, tl.trans(v), input_precision=PREC)
        d_q += tl.dot((p * (d_p - delta[:, None])).to(DT), k, input_precision=PREC)
    tl.store(DQ + bh * length * DIM + offs_m[:, None] * DIM + offs_d[None, :], d_q * sm_scale,
             mask=rows)


class Launch(NamedTuple):
    """Tile sizes and launch options of one kernel."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


_INTERPRETED = Launch(16, 32, 1, 1)  # Triton's interpreter (tests): small tiles, many blocks


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def forward_launch(dim: int) -> Launch:
    """The forward's tiles for a head dim (smaller for wide heads)."""
    if _interpreting():
        return _INTERPRETED
    return Launch(128, 64, 8, 3) if dim <= 64 else Launch(64, 64, 4, 3)


def backward_launch(dim: int, dtype: torch.dtype) -> Launch:
    """The backward kernels' tiles: within a Hopper block's 227 KiB of shared memory
    (fp32 operands take twice the room of 16-bit ones: fewer pipeline stages there).
    Ada's 99 KiB would not hold them: attention.py runs the kernels on Hopper and later."""
    if _interpreting():
        return _INTERPRETED
    stages = 1 if dtype == torch.float32 and dim >= 128 else 2
    return Launch(64, 64, 4, stages) if dim <= 128 else Launch(32, 64, 4, 1)


def precision(dtype: torch.dtype) -> str:
    """``tl.dot``'s input precision for backward operands of ``dtype``: fp32 multiplies in
    IEEE fp32, not tf32 (Triton's default for fp32 operands)."""
    return "ieee" if dtype == torch.float32 else "tf32"


def _strides(t: Tensor) -> tuple[int, int, int]:
    """(batch, head, seq) strides of a (B, H, S, D) tensor whose last dim is contiguous."""
    return t.stride(0), t.stride(1), t.stride(2)


def _last_dim_contiguous(t: Tensor) -> Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _inverse_scales(*qs: Fp8) -> list[Tensor]:
    return [q.inv_scale.reshape(-1).contiguous() for q in qs]


def _on_device(t: Tensor) -> Any:
    """The tensor's CUDA device made current for a launch (Triton launches on the current
    one); nothing to do on a CPU (the interpreter)."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def _grid(span: int, block: int, heads: int) -> tuple[int]:
    """One flat grid of ``cdiv(span, block) * heads`` programs: CUDA's first grid dimension
    takes 2**31 - 1, its second only 65535, which batch * heads passes (2048 sequences of 32
    heads); :func:`_program` reads a program's block and head back from its index."""
    return (triton.cdiv(span, block) * heads,)


def forward(q8: Fp8, k8: Fp8, v8: Fp8, causal: bool, scale: float,
            out_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Attention output (batch, heads, length, dim) in ``out_dtype`` and fp32 lse."""
    q, k = (_last_dim_contiguous(t.data) for t in (q8, k8))
    # Hopper's fp8 tensor-core GEMM (wgmma) takes its B operand only K-major: for p @ v
    # that is v with the sequence contiguous, one fp8 copy here instead of a transpose
    # through shared memory in every program.
    v = v8.data.transpose(-2, -1).contiguous().transpose(-2, -1)
    batch, heads, length, dim = q.shape
    kv_heads, k_length = k.shape[1], k.shape[2]
    out = torch.empty(q.shape, dtype=out_dtype, device=q.device)
    lse = torch.empty((batch, heads, length), dtype=torch.float32, device=q.device)
    launch = forward_launch(dim)
    grid = _grid(length, launch.block_m, batch * heads)
    with _on_device(q):
        _forward_kernel[grid](q, k, v, *_inverse_scales(q8, k8, v8), out, lse, scale,
                              *_strides(q), *_strides(k), *_strides(v), v.stride(3),
                              *_strides(out), heads, kv_heads, length, k_length,
                              DIM=dim, BLOCK_M=launch.block_m, BLOCK_N=launch.block_n,
                              CAUSAL=causal, P_MUL=P_SCALE, num_warps=launch.num_warps,
                              num_stages=launch.num_stages)
    return out, lse


def backward(grad_out: Tensor, q8: Fp8, k8: Fp8, v8: Fp8, out: Tensor, lse: Tensor,
             causal: bool, scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """fp32 (dQ, dK, dV), dK and dV per query head (a grouped-query caller sums them)."""
    q, k, v = (_last_dim_contiguous(t.data) for t in (q8, k8, v8))
    d_o = _last_dim_contiguous(grad_out)
    batch, heads, length, dim = q.shape
    kv_heads, k_length = k.shape[1], k.shape[2]
    delta = (d_o.float() * out.float()).sum(-1).contiguous()
    d_q = torch.empty((batch, heads, length, dim), dtype=torch.float32, device=q.device)
    # Grouped-query: a dK, dV per query head (each program owns its rows).
    d_k = torch.empty((batch, heads, k_length, dim), dtype=torch.float32, device=q.device)
    d_v = torch.empty_like(d_k)
    launch = backward_launch(dim, grad_out.dtype)
    common = (*_inverse_scales(q8, k8, v8), d_o, lse.contiguous(), delta)
    strides = (*_strides(q), *_strides(k), *_strides(v), *_strides(d_o))
    meta = dict(DIM=dim, BLOCK_M=launch.block_m, BLOCK_N=launch.block_n, CAUSAL=causal,
                DT=_TL_DTYPES[grad_out.dtype], PREC=precision(grad_out.dtype),
                num_warps=launch.num_warps, num_stages=launch.num_stages)
    sizes = (heads, kv_heads, length, k_length)
    with _on_device(q):
        _dkdv_kernel[_grid(k_length, launch.block_n, batch * heads)](
            q, k, v, *common, d_k, d_v, scale, *strides, *sizes, **meta)
        _dq_kernel[_grid(length, launch.block_m, batch * heads)](
            q, k, v, *common, d_q, scale, *strides, *sizes, **meta)
    return d_q, d_k, d_v
