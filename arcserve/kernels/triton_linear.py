"""Skinny linear layers (a few rows: decode at small batch) as a Triton matrix-vector kernel.

At one to a few rows a linear layer only streams its weight matrix, so its floor is the weight bytes
over memory bandwidth. The vendor GEMM libraries pick tiles made for large matrices and reach a
quarter to a half of that bandwidth on the decoder's 4-12 MB matrices (measured on the H200:
benchmarks/gpu_kernels.py, docs/BENCHMARKS.md). This kernel gives each program a few output
features and streams their weight rows in wide contiguous tiles, so the whole device is reading.
Larger batches and wide matrices use the library GEMM.

At one row a decoder layer is a chain of tiny launches, each a few microseconds however little it
does, so the kernel also takes the elementwise op before the product as a prologue (every program
recomputes it on the fly from the small input row):
- `add_rms_norm_linear`: residual add + RMSNorm, then the product (twin:
  reference.add_rms_norm_linear);
- `silu_mul_linear`: SiLU(gate) * up, then the product (twin: reference.silu_mul_linear).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from arcserve.kernels import reference, triton_ops
from arcserve.platform import compute_units, triton_launch_options

# Where the kernel beats the library GEMM on the H200 (benchmarks/gpu_kernels.py, docs/BENCHMARKS.md):
# one row, and matrices of at most 4,096 outputs and inputs (the library's tiles leave most of the
# device idle there: Qwen3-0.6B's o_proj 13.2 -> 4.1 us, down_proj 7.1 -> 5.0 us). Wider matrices
# (gate_up, the LM head, Llama-8B's down_proj) and more rows stay with the library.
MAX_ROWS = 1
MAX_DIM = 4096
# With a prologue fused in, the kernel also takes wider matrices up to this many elements (16 MB
# in bf16: Qwen3-0.6B's gate_up): the launch it saves is worth more than the library's edge there.
# Beyond it (Llama-8B's layers) the matrices take 10-60 us and the library's bandwidth wins.
FUSED_MAX_ELEMENTS = 8 * 1024 * 1024
_TILE = 8192  # weight elements a program reads per step of the K loop (16 KB in bf16)

_PLAIN, _ADD_RMS_NORM, _SILU_MUL = 0, 1, 2


@triton.jit
def _gemv_kernel(x_ptr, r_ptr, nw_ptr, res_out_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_rm,
                 stride_wn, stride_ym, eps, PROLOGUE: tl.constexpr, HAS_RES: tl.constexpr, HAS_BIAS: tl.constexpr,
                 M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    pid = tl.program_id(0)
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, M_PAD)
    k = tl.arange(0, BLOCK_K)
    n_ok, m_ok = n < N, m < M
    dt = w_ptr.dtype.element_ty
    if PROLOGUE == 1:  # the rows' mean square of x (+ residual), as triton_ops.fused_add_rms_norm rounds it
        ss = tl.zeros((M_PAD,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + k
            mk = m_ok[:, None] & (kk < K)[None, :]
            s = tl.load(x_ptr + m[:, None] * stride_xm + kk[None, :], mask=mk, other=0.0)
            if HAS_RES:
                s = (s.to(tl.float32) + tl.load(r_ptr + m[:, None] * stride_rm + kk[None, :], mask=mk, other=0.0).to(tl.float32)).to(dt)
                if pid == 0:  # one program writes the new residual stream
                    tl.store(res_out_ptr + m[:, None] * K + kk[None, :], s, mask=mk)
            s = s.to(tl.float32)
            ss += tl.sum(s * s, 1)
        rstd = tl.rsqrt(ss / K + eps)
    acc = tl.zeros((M_PAD, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + k
        k_ok = kk < K
        mk = m_ok[:, None] & k_ok[None, :]
        w = tl.load(w_ptr + n[:, None].to(tl.int64) * stride_wn + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        if PROLOGUE == 0:
            x = tl.load(x_ptr + m[:, None] * stride_xm + kk[None, :], mask=mk, other=0.0).to(tl.float32)
        elif PROLOGUE == 1:  # RMSNorm of x (+ residual), rounded to the model dtype like the unfused op
            s = tl.load(x_ptr + m[:, None] * stride_xm + kk[None, :], mask=mk, other=0.0)
            if HAS_RES:
                s = (s.to(tl.float32) + tl.load(r_ptr + m[:, None] * stride_rm + kk[None, :], mask=mk, other=0.0).to(tl.float32)).to(dt)
            g = tl.load(nw_ptr + kk, mask=k_ok, other=0.0).to(tl.float32)
            x = ((s.to(tl.float32) * rstd[:, None]) * g[None, :]).to(dt).to(tl.float32)
        else:  # SiLU(gate) * up over the input's two halves, rounded like triton_ops.silu_and_mul
            g = tl.load(x_ptr + m[:, None] * stride_xm + kk[None, :], mask=mk, other=0.0).to(tl.float32)
            u = tl.load(x_ptr + m[:, None] * stride_xm + K + kk[None, :], mask=mk, other=0.0).to(tl.float32)
            x = ((g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32) * u).to(dt).to(tl.float32)
        acc += tl.sum(x[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + m[:, None] * stride_ym + n[None, :], acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@functools.cache
def _tiles(M: int, N: int, K: int, units: int) -> tuple[int, int, int]:
    """(M_PAD, BLOCK_N, BLOCK_K): enough programs for two per compute unit, then the widest K tile."""
    m_pad = triton.next_power_of_2(M)
    block_n = 16
    while block_n > 1 and triton.cdiv(N, block_n) < 2 * units:
        block_n //= 2
    block_k = max(16, min(triton.next_power_of_2(K), _TILE // (block_n * m_pad)))
    return m_pad, block_n, block_k


def _launch(x, weight, bias, prologue: int, K: int, residual=None, norm_weight=None, res_out=None, eps=0.0):
    M, N = x.shape[0], weight.shape[0]
    assert weight.stride(1) == 1 and x.stride(1) == 1 and weight.shape[1] == K
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    m_pad, block_n, block_k = _tiles(M, N, K, compute_units(x.device))
    _gemv_kernel[(triton.cdiv(N, block_n),)](
        x, residual if residual is not None else x, norm_weight if norm_weight is not None else weight,
        res_out if res_out is not None else y, weight, bias if bias is not None else weight, y, M, N, K,
        x.stride(0), residual.stride(0) if residual is not None else 0, weight.stride(0), y.stride(0), eps,
        PROLOGUE=prologue, HAS_RES=residual is not None, HAS_BIAS=bias is not None,
        M_PAD=m_pad, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4, **triton_launch_options(),
    )  # fmt: skip
    return y


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight[N, K].T (+ bias) for small M, float32 accumulation, result in x's dtype."""
    return _launch(x, weight, bias, _PLAIN, x.shape[1])


def _skinny(x: torch.Tensor, weight: torch.Tensor, fused: bool) -> bool:
    N, K = weight.shape
    fits = N * K <= FUSED_MAX_ELEMENTS if fused else (N <= MAX_DIM and K <= MAX_DIM)
    return x.dim() == 2 and 0 < x.shape[0] <= MAX_ROWS and fits and not weight.is_mkldnn


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """reference.linear, with the matrix-vector kernel where it is faster (see MAX_ROWS)."""
    if _skinny(x, weight, fused=False):
        return gemv(x, weight, bias)
    return reference.linear(x, weight, bias)


def add_rms_norm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                        weight: torch.Tensor, bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """reference.add_rms_norm_linear: (linear(rms_norm(x + residual)), x + residual), in one launch
    for one row and matrices up to FUSED_MAX_ELEMENTS; the two kernels otherwise."""
    if _skinny(x, weight, fused=True) and (residual is None or residual.stride(1) == 1):
        res_out = x if residual is None else torch.empty_like(x, memory_format=torch.contiguous_format)
        y = _launch(x, weight, bias, _ADD_RMS_NORM, x.shape[1], residual, norm_weight, res_out, eps)
        return y, res_out
    h, residual = triton_ops.fused_add_rms_norm(x, residual, norm_weight, eps)
    return linear(h, weight, bias), residual


def silu_mul_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """reference.silu_mul_linear: linear(silu(gate) * up) for x = [gate | up], in one launch for one
    row and matrices up to FUSED_MAX_ELEMENTS; the two kernels otherwise."""
    if _skinny(x, weight, fused=True):
        return _launch(x, weight, bias, _SILU_MUL, x.shape[1] // 2)
    return linear(triton_ops.silu_and_mul(x), weight, bias)
