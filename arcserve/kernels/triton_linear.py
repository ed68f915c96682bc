"""Skinny linear layers (one row: decode at batch 1) as a Triton matrix-vector kernel.

At one row a linear layer only streams its weight matrix, so its floor is the weight bytes over
memory bandwidth. The vendor GEMM libraries pick tiles made for large matrices and reach a quarter
to a half of that bandwidth on Qwen3-0.6B's 2-12 MB matrices. This kernel gives each program four
output features and streams their weight rows in wide contiguous tiles (the whole row at once up to
4,096 inputs), so many small programs keep the whole device reading; on longer rows it requests the
next tile before it computes with the current one. On the H100 it matches or beats the library on
every one-row matrix of Qwen3-0.6B and Llama-3.1-8B, LM heads included (benchmarks/gpu_kernels.py
gemv-candidates, docs/BENCHMARKS.md); more rows stay with the library.

At one row a decoder layer is a chain of short launches, so the kernel also takes the elementwise
op before the product as a prologue (every program recomputes it on the fly from the small input
row), and with programmatic dependent launch (platform.triton_launch_options) it reads its first
weight tile while the kernel before it still runs:
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
from arcserve.kernels.triton_ops import wait_prior_kernel
from arcserve.platform import triton_launch_options

# One row, and up to this many outputs: every matrix of the models served here, LM heads included
# (H100, one row: Qwen3-0.6B's 102.6 against the library's 112.8 us, Llama-8B's 331 against 370).
MAX_ROWS = 1
MAX_N = 1 << 20
# The fused norm reads its whole input row at once (registers: K / threads floats each).
NORM_MAX_K = 8192
# Program shape, from a sweep on the H100 (benchmarks/gpu_kernels.py gemv-grid, gemv-candidates):
# four outputs per program and four warps; rows up to ONE_TILE_MAX_K inputs in one load, longer
# ones in steps of LOOP_BLOCK_K (the loop's float32 accumulator is BLOCK_N x BLOCK_K per program).
_BLOCK_N = 4
# Triton's interpreter (the CPU) runs programs one after another: fewer, wider ones are faster there
# (the CI suite took >2x as long with four outputs per program).
_INTERPRETER_BLOCK_N = 16
ONE_TILE_MAX_K = 4096
LOOP_BLOCK_K = 1024
_WARPS = 4

_PLAIN, _ADD_RMS_NORM, _SILU_MUL = 0, 1, 2


@triton.jit
def _x_tile(x_ptr, r_ptr, nw_ptr, m, m_ok, kk, K, stride_xm, stride_rm, rstd, PROLOGUE: tl.constexpr,
            HAS_RES: tl.constexpr):  # fmt: skip
    """Columns kk of the product's input row(s), in float32, rounded to the model dtype as the
    unfused ops round them: x itself, RMSNorm of x (+ residual), or SiLU(gate) * up."""
    dt = x_ptr.dtype.element_ty
    k_ok = kk < K
    mk = m_ok[:, None] & k_ok[None, :]
    if PROLOGUE == 0:
        x = tl.load(x_ptr + m[:, None] * stride_xm + kk[None, :], mask=mk, other=0.0).to(tl.float32)
    elif PROLOGUE == 1:  # as triton_ops.fused_add_rms_norm
        s = tl.load(x_ptr + m[:, None] * stride_xm + kk[None, :], mask=mk, other=0.0)
        if HAS_RES:
            s = (s.to(tl.float32) + tl.load(r_ptr + m[:, None] * stride_rm + kk[None, :], mask=mk, other=0.0).to(tl.float32)).to(dt)
        g = tl.load(nw_ptr + kk, mask=k_ok, other=0.0).to(tl.float32)
        x = ((s.to(tl.float32) * rstd[:, None]) * g[None, :]).to(dt).to(tl.float32)
    else:  # as triton_ops.silu_and_mul, over the input's two halves
        g = tl.load(x_ptr + m[:, None] * stride_xm + kk[None, :], mask=mk, other=0.0).to(tl.float32)
        u = tl.load(x_ptr + m[:, None] * stride_xm + K + kk[None, :], mask=mk, other=0.0).to(tl.float32)
        x = (tl.fdiv(g, 1.0 + tl.exp(-g), ieee_rounding=False).to(dt).to(tl.float32) * u).to(dt).to(tl.float32)
    return x


@triton.jit
def _gemv_kernel(x_ptr, r_ptr, nw_ptr, res_out_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_rm,
                 stride_wn, stride_ym, eps, PROLOGUE: tl.constexpr, HAS_RES: tl.constexpr, HAS_BIAS: tl.constexpr,
                 M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_PAD: tl.constexpr, ONE_TILE: tl.constexpr,
                 PDL: tl.constexpr = False):  # fmt: skip
    pid = tl.program_id(0)
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, M_PAD)
    k = tl.arange(0, BLOCK_K)
    n_ok, m_ok = n < N, m < M
    # The weights are the bulk of the bytes and no kernel writes them: the first tile is read before
    # waiting for the kernel before (programmatic dependent launch, wait_prior_kernel), so it streams
    # in while that one finishes.
    w_rows = w_ptr + n[:, None].to(tl.int64) * stride_wn
    w = tl.load(w_rows + k[None, :], mask=n_ok[:, None] & (k < K)[None, :], other=0.0)
    wait_prior_kernel(PDL)
    rstd = tl.zeros((M_PAD,), dtype=tl.float32)
    if PROLOGUE == 1:  # the rows' mean square of x (+ residual): the whole row in one load
        kf = tl.arange(0, K_PAD)
        mf = m_ok[:, None] & (kf < K)[None, :]
        s = tl.load(x_ptr + m[:, None] * stride_xm + kf[None, :], mask=mf, other=0.0)
        if HAS_RES:
            s = (s.to(tl.float32) + tl.load(r_ptr + m[:, None] * stride_rm + kf[None, :], mask=mf, other=0.0).to(tl.float32)).to(x_ptr.dtype.element_ty)
            if pid == 0:  # one program writes the new residual stream
                tl.store(res_out_ptr + m[:, None] * K + kf[None, :], s, mask=mf)
        s = s.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(s * s, 1) / K + eps)
    x = _x_tile(x_ptr, r_ptr, nw_ptr, m, m_ok, k, K, stride_xm, stride_rm, rstd, PROLOGUE, HAS_RES)
    if ONE_TILE:
        y = tl.sum(x[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
    else:
        # Each step requests the next weight and input tiles before it computes with the current
        # ones, and products accumulate elementwise, summed over K once at the end (a reduction
        # across threads in every step would stall the stream).
        acc = tl.zeros((M_PAD, BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            w_cur, x_cur = w, x
            nk = k0 + BLOCK_K + k
            w = tl.load(w_rows + nk[None, :], mask=n_ok[:, None] & (nk < K)[None, :], other=0.0)
            x = _x_tile(x_ptr, r_ptr, nw_ptr, m, m_ok, nk, K, stride_xm, stride_rm, rstd, PROLOGUE, HAS_RES)
            acc += x_cur[:, None, :] * w_cur.to(tl.float32)[None, :, :]
        y = tl.sum(acc, axis=2)
    if HAS_BIAS:
        y += tl.load(b_ptr + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + m[:, None] * stride_ym + n[None, :], y.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@functools.cache
def _tiles(M: int, K: int, interpreted: bool = False) -> tuple[int, int, int]:
    """(M_PAD, BLOCK_N, BLOCK_K) of the launch."""
    k_pad = max(16, triton.next_power_of_2(K))
    block_n = _INTERPRETER_BLOCK_N if interpreted else _BLOCK_N
    return triton.next_power_of_2(M), block_n, k_pad if k_pad <= ONE_TILE_MAX_K else LOOP_BLOCK_K


def _launch(x, weight, bias, prologue: int, K: int, residual=None, norm_weight=None, res_out=None, eps=0.0):
    M, N = x.shape[0], weight.shape[0]
    assert weight.stride(1) == 1 and x.stride(1) == 1 and weight.shape[1] == K
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    m_pad, block_n, block_k = _tiles(M, K, interpreted=x.device.type == "cpu")
    _gemv_kernel[(triton.cdiv(N, block_n),)](
        x, residual if residual is not None else x, norm_weight if norm_weight is not None else weight,
        res_out if res_out is not None else y, weight, bias if bias is not None else weight, y, M, N, K,
        x.stride(0), residual.stride(0) if residual is not None else 0, weight.stride(0), y.stride(0), eps,
        PROLOGUE=prologue, HAS_RES=residual is not None, HAS_BIAS=bias is not None,
        M_PAD=m_pad, BLOCK_N=block_n, BLOCK_K=block_k, K_PAD=triton.next_power_of_2(K) if prologue == _ADD_RMS_NORM else 1, ONE_TILE=K <= block_k,
        num_warps=_WARPS, **triton_launch_options(x.device),
    )  # fmt: skip
    return y


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight[N, K].T (+ bias) for small M, float32 accumulation, result in x's dtype."""
    return _launch(x, weight, bias, _PLAIN, x.shape[1])


def _skinny(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return x.dim() == 2 and 0 < x.shape[0] <= MAX_ROWS and weight.shape[0] <= MAX_N and not weight.is_mkldnn


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """reference.linear, with the matrix-vector kernel where it is faster (see MAX_ROWS)."""
    if _skinny(x, weight):
        return gemv(x, weight, bias)
    return reference.linear(x, weight, bias)


def add_rms_norm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                        weight: torch.Tensor, bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """reference.add_rms_norm_linear: (linear(rms_norm(x + residual)), x + residual), in one launch
    where linear() takes the matrix-vector kernel (rows up to NORM_MAX_K); the two kernels otherwise."""
    if _skinny(x, weight) and x.shape[1] <= NORM_MAX_K and (residual is None or residual.stride(1) == 1):
        res_out = x if residual is None else torch.empty_like(x, memory_format=torch.contiguous_format)
        y = _launch(x, weight, bias, _ADD_RMS_NORM, x.shape[1], residual, norm_weight, res_out, eps)
        return y, res_out
    h, residual = triton_ops.fused_add_rms_norm(x, residual, norm_weight, eps)
    return linear(h, weight, bias), residual


def silu_mul_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """reference.silu_mul_linear: linear(silu(gate) * up) for x = [gate | up], in one launch for one
    row where linear() takes the matrix-vector kernel; the two kernels otherwise."""
    if _skinny(x, weight):
        return _launch(x, weight, bias, _SILU_MUL, x.shape[1] // 2)
    return linear(triton_ops.silu_and_mul(x), weight, bias)
