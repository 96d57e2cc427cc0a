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

import os

import torch
import triton
import triton.language as tl
from torch import Tensor

from .scaling import Fp8

P_SCALE = 256.0
_TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


@triton.jit
def _forward_kernel(Q, K, V, QI, KI, VI, Out, Lse, sm_scale,
                    s_qb, s_qh, s_qm, s_kb, s_kh, s_kn, s_vb, s_vh, s_vn, s_vd, s_ob, s_oh, s_om,
                    heads, kv_heads, length, k_length,
                    DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    CAUSAL: tl.constexpr, P_MUL: tl.constexpr):
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1)
    b, h = bh // heads, bh % heads
    hk = h // (heads // kv_heads)
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
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k = tl.load(k_base + offs_n[None, :] * s_kn + offs_d[:, None],
                    mask=offs_n[None, :] < k_length, other=0.0)
        s = tl.dot(q, k) * qk_scale
        valid = offs_n[None, :] < k_length
        if CAUSAL:
            valid = valid & (offs_n[None, :] <= offs_m[:, None])
        s = tl.where(valid, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + offs_n[:, None] * s_vn + offs_d[None, :] * s_vd,
                    mask=offs_n[:, None] < k_length, other=0.0)
        acc = acc * alpha[:, None] + tl.dot((p * P_MUL).to(tl.float8e4nv), v)
        m_i = m_new
    v_inv = tl.load(VI + b * kv_heads + hk)
    out = acc * (v_inv / P_MUL) / l_i[:, None]
    row = offs_m < length
    tl.store(Out + b * s_ob + h * s_oh + offs_m[:, None] * s_om + offs_d[None, :],
             out.to(Out.dtype.element_ty), mask=row[:, None])
    # Natural-log lse (m_i is in log2 units).
    tl.store(Lse + bh * length + offs_m, (m_i + tl.log2(l_i)) * 0.6931471805599453, mask=row)


@triton.jit
def _scores_t(q, k, lse, sm_scale, offs_m, offs_n, length, k_length, CAUSAL: tl.constexpr):
    """``p^T`` (BLOCK_N, BLOCK_M) of one key block against one query block, from lse."""
    s = tl.dot(k, tl.trans(q)) * sm_scale
    valid = (offs_n[:, None] < k_length) & (offs_m[None, :] < length)
    if CAUSAL:
        valid = valid & (offs_n[:, None] <= offs_m[None, :])
    return tl.where(valid, tl.exp(s - lse[None, :]), 0.0)


@triton.jit
def _dkdv_kernel(Q, K, V, QI, KI, VI, DO, Lse, Delta, DK, DV, sm_scale,
                 s_qb, s_qh, s_qm, s_kb, s_kh, s_kn, s_vb, s_vh, s_vn, s_ob, s_oh, s_om,
                 heads, kv_heads, length, k_length,
                 DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 CAUSAL: tl.constexpr, DT: tl.constexpr):
    start_n = tl.program_id(0) * BLOCK_N
    bh = tl.program_id(1)
    b, h = bh // heads, bh % heads
    hk = h // (heads // kv_heads)
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, DIM)
    kv_rows = offs_n[:, None] < k_length
    k = (tl.load(K + b * s_kb + hk * s_kh + offs_n[:, None] * s_kn + offs_d[None, :],
                 mask=kv_rows, other=0.0).to(tl.float32) * tl.load(KI + b * kv_heads + hk)).to(DT)
    v = (tl.load(V + b * s_vb + hk * s_vh + offs_n[:, None] * s_vn + offs_d[None, :],
                 mask=kv_rows, other=0.0).to(tl.float32) * tl.load(VI + b * kv_heads + hk)).to(DT)
    q_inv = tl.load(QI + b * heads + h)
    d_k = tl.zeros([BLOCK_N, DIM], tl.float32)
    d_v = tl.zeros([BLOCK_N, DIM], tl.float32)
    lo = (start_n // BLOCK_M) * BLOCK_M if CAUSAL else 0
    for start_m in range(lo, length, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        rows = offs_m[:, None] < length
        q = (tl.load(Q + b * s_qb + h * s_qh + offs_m[:, None] * s_qm + offs_d[None, :],
                     mask=rows, other=0.0).to(tl.float32) * q_inv).to(DT)
        d_o = tl.load(DO + b * s_ob + h * s_oh + offs_m[:, None] * s_om + offs_d[None, :],
                      mask=rows, other=0.0).to(DT)
        lse = tl.load(Lse + bh * length + offs_m, mask=offs_m < length, other=0.0)
        delta = tl.load(Delta + bh * length + offs_m, mask=offs_m < length, other=0.0)
        p_t = _scores_t(q, k, lse, sm_scale, offs_m, offs_n, length, k_length, CAUSAL)
        d_v += tl.dot(p_t.to(DT), d_o)
        d_p_t = tl.dot(v, tl.trans(d_o))
        d_s_t = p_t * (d_p_t - delta[None, :])
        d_k += tl.dot(d_s_t.to(DT), q)
    out_off = bh * k_length * DIM + offs_n[:, None] * DIM + offs_d[None, :]
    tl.store(DK + out_off, d_k * sm_scale, mask=kv_rows)
    tl.store(DV + out_off, d_v, mask=kv_rows)


@triton.jit
def _dq_kernel(Q, K, V, QI, KI, VI, DO, Lse, Delta, DQ, sm_scale,
               s_qb, s_qh, s_qm, s_kb, s_kh, s_kn, s_vb, s_vh, s_vn, s_ob, s_oh, s_om,
               heads, kv_heads, length, k_length,
               DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               CAUSAL: tl.constexpr, DT: tl.constexpr):
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1)
    b, h = bh // heads, bh % heads
    hk = h // (heads // kv_heads)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, DIM)
    rows = offs_m[:, None] < length
    q = (tl.load(Q + b * s_qb + h * s_qh + offs_m[:, None] * s_qm + offs_d[None, :],
                 mask=rows, other=0.0).to(tl.float32) * tl.load(QI + b * heads + h)).to(DT)
    d_o = tl.load(DO + b * s_ob + h * s_oh + offs_m[:, None] * s_om + offs_d[None, :],
                  mask=rows, other=0.0).to(DT)
    lse = tl.load(Lse + bh * length + offs_m, mask=offs_m < length, other=0.0)
    delta = tl.load(Delta + bh * length + offs_m, mask=offs_m < length, other=0.0)
    k_inv = tl.load(KI + b * kv_heads + hk)
    v_inv = tl.load(VI + b * kv_heads + hk)
    d_q = tl.zeros([BLOCK_M, DIM], tl.float32)
    end = tl.minimum(k_length, start_m + BLOCK_M) if CAUSAL else k_length
    for start_n in range(0, end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        kv_rows = offs_n[:, None] < k_length
        k = (tl.load(K + b * s_kb + hk * s_kh + offs_n[:, None] * s_kn + offs_d[None, :],
                     mask=kv_rows, other=0.0).to(tl.float32) * k_inv).to(DT)
        v = (tl.load(V + b * s_vb + hk * s_vh + offs_n[:, None] * s_vn + offs_d[None, :],
                     mask=kv_rows, other=0.0).to(tl.float32) * v_inv).to(DT)
        p_t = _scores_t(q, k, lse, sm_scale, offs_m, offs_n, length, k_length, CAUSAL)
        d_p_t = tl.dot(v, tl.trans(d_o))
        d_s_t = p_t * (d_p_t - delta[None, :])
        d_q += tl.dot(tl.trans(d_s_t).to(DT), k)
    tl.store(DQ + bh * length * DIM + offs_m[:, None] * DIM + offs_d[None, :], d_q * sm_scale,
             mask=rows)


def _blocks(dim: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) for a head dim: smaller tiles for wide heads."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return 16, 32, 1  # the interpreter (tests): small tiles exercise the block loops
    return (128, 64, 8) if dim <= 64 else (64, 64, 4) if dim <= 128 else (64, 32, 4)


def _strides(t: Tensor) -> tuple[int, int, int]:
    """(batch, head, seq) strides of a (B, H, S, D) tensor whose last dim is contiguous."""
    return t.stride(0), t.stride(1), t.stride(2)


def _last_dim_contiguous(t: Tensor) -> Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _inverse_scales(*qs: Fp8) -> list[Tensor]:
    return [q.inv_scale.reshape(-1).contiguous() for q in qs]


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
    block_m, block_n, warps = _blocks(dim)
    grid = (triton.cdiv(length, block_m), batch * heads)
    _forward_kernel[grid](q, k, v, *_inverse_scales(q8, k8, v8), out, lse, scale,
                          *_strides(q), *_strides(k), *_strides(v), v.stride(3), *_strides(out),
                          heads, kv_heads, length, k_length,
                          DIM=dim, BLOCK_M=block_m, BLOCK_N=block_n, CAUSAL=causal,
                          P_MUL=P_SCALE, num_warps=warps)
    return out, lse


def backward(grad_out: Tensor, q8: Fp8, k8: Fp8, v8: Fp8, out: Tensor, lse: Tensor,
             causal: bool, scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """fp32 (dQ, dK, dV); dK and dV summed over each key/value head's query heads."""
    q, k, v = (_last_dim_contiguous(t.data) for t in (q8, k8, v8))
    d_o = _last_dim_contiguous(grad_out)
    batch, heads, length, dim = q.shape
    kv_heads, k_length = k.shape[1], k.shape[2]
    delta = (d_o.float() * out.float()).sum(-1).contiguous()
    d_q = torch.empty((batch, heads, length, dim), dtype=torch.float32, device=q.device)
    d_k = torch.empty((batch, heads, k_length, dim), dtype=torch.float32, device=q.device)
    d_v = torch.empty_like(d_k)
    block_m, block_n, warps = _blocks(dim)
    common = (*_inverse_scales(q8, k8, v8), d_o, lse.contiguous(), delta)
    strides = (*_strides(q), *_strides(k), *_strides(v), *_strides(d_o))
    meta = dict(DIM=dim, BLOCK_M=block_m, BLOCK_N=block_n, CAUSAL=causal,
                DT=_TL_DTYPES[grad_out.dtype], num_warps=warps)
    sizes = (heads, kv_heads, length, k_length)
    _dkdv_kernel[(triton.cdiv(k_length, block_n), batch * heads)](
        q, k, v, *common, d_k, d_v, scale, *strides, *sizes, **meta)
    _dq_kernel[(triton.cdiv(length, block_m), batch * heads)](
        q, k, v, *common, d_q, scale, *strides, *sizes, **meta)
    if heads != kv_heads:
        group = heads // kv_heads
        d_k = d_k.reshape(batch, kv_heads, group, k_length, dim).sum(2)
        d_v = d_v.reshape(batch, kv_heads, group, k_length, dim).sum(2)
    return d_q, d_k, d_v
