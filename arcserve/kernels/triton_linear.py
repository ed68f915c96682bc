"""Skinny linear layers (a few rows: decode at small batch) as a Triton matrix-vector kernel.

At one to a few rows a linear layer only streams its weight matrix, so its floor is the weight bytes
over memory bandwidth. The vendor GEMM libraries pick tiles made for large matrices and reach a
quarter to a half of that bandwidth on the decoder's 4-12 MB matrices (measured on the H200:
benchmarks/gpu_kernels.py, docs/BENCHMARKS.md). This kernel gives each program a few output
features and streams their weight rows in wide contiguous tiles, so the whole device is reading.
Larger batches and wide matrices use the library GEMM.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from arcserve.kernels import reference
from arcserve.platform import compute_units, triton_launch_options

# Where the kernel beats the library GEMM on the H200 (benchmarks/gpu_kernels.py, docs/BENCHMARKS.md):
# one row, and matrices of at most 4,096 outputs and inputs (the library's tiles leave most of the
# device idle there: Qwen3-0.6B's o_proj 13.2 -> 4.1 us, down_proj 7.1 -> 5.0 us). Wider matrices
# (gate_up, the LM head, Llama-8B's down_proj) and more rows stay with the library.
MAX_ROWS = 1
MAX_DIM = 4096
_TILE = 8192  # weight elements a program reads per step of the K loop (16 KB in bf16)


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                 HAS_BIAS: tl.constexpr, M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, M_PAD)
    k = tl.arange(0, BLOCK_K)
    n_ok, m_ok = n < N, m < M
    acc = tl.zeros((M_PAD, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + k
        k_ok = kk < K
        w = tl.load(w_ptr + n[:, None].to(tl.int64) * stride_wn + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        x = tl.load(x_ptr + m[:, None] * stride_xm + kk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        acc += tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
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


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight[N, K].T (+ bias) for small M, float32 accumulation, result in x's dtype."""
    M, K = x.shape
    N = weight.shape[0]
    assert weight.stride(1) == 1 and x.stride(1) == 1
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    m_pad, block_n, block_k = _tiles(M, N, K, compute_units(x.device))
    _gemv_kernel[(triton.cdiv(N, block_n),)](
        x, weight, bias if bias is not None else weight, y, M, N, K, x.stride(0), weight.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, M_PAD=m_pad, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4,
        **triton_launch_options(),
    )  # fmt: skip
    return y


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """reference.linear, with the matrix-vector kernel where it is faster (see MAX_ROWS)."""
    N, K = weight.shape
    if x.dim() == 2 and 0 < x.shape[0] <= MAX_ROWS and N <= MAX_DIM and K <= MAX_DIM and not weight.is_mkldnn:
        return gemv(x, weight, bias)
    return reference.linear(x, weight, bias)
