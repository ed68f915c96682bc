"""Inverse-CDF sampling in one pass over each row's logits pair (twin: reference.sample_from_cdf).

The torch twin materialises the scaled logits, the softmax and its cumulative sum ([rows, vocab] in
float32 each, ~155 MB per pass at 256 rows of a 152k vocabulary). Here one program per row reads the
logits twice and writes one token id: pass 1 finds the row maximum and the softmax denominator
(online, per lane), pass 2 scans the cumulative mass block by block until it exceeds u times the
total, and stops there.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from arcserve.kernels.triton_ops import wait_prior_kernel
from arcserve.platform import triton_interpreting, triton_launch_options


@triton.jit
def _sample_kernel(x_ptr, inv_t_ptr, u_ptr, out_ptr, V, stride_x, BLOCK_V: tl.constexpr, PDL: tl.constexpr = False):
    wait_prior_kernel(PDL)
    row = tl.program_id(0)
    inv_t = tl.load(inv_t_ptr + row)
    u = tl.load(u_ptr + row)
    base = x_ptr + row.to(tl.int64) * stride_x
    lanes = tl.arange(0, BLOCK_V)

    # Pass 1: per-lane running maximum and sum of exp(x - max), then combined.
    m = tl.full([BLOCK_V], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK_V], tl.float32)
    for start in range(0, V, BLOCK_V):
        x = tl.load(base + start + lanes, mask=start + lanes < V, other=float("-inf")).to(tl.float32) * inv_t
        m_new = tl.maximum(m, x)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        s = s * tl.exp(m - m_safe) + tl.exp(x - m_safe)
        m = m_new
    mx = tl.max(m, 0)
    total = tl.sum(s * tl.exp(m - mx), 0)
    target = u * total

    # Pass 2: cumulative mass block by block until it exceeds the target.
    picked = tl.zeros([], tl.int32) - 1
    last_nz = tl.zeros([], tl.int32)  # fallback if rounding leaves the target at or above the total
    carry = tl.zeros([], tl.float32)
    start = tl.zeros([], tl.int32)
    while (start < V) & (picked < 0):
        idx = start + lanes
        x = tl.load(base + idx, mask=idx < V, other=float("-inf")).to(tl.float32) * inv_t
        p = tl.exp(x - mx)
        c = carry + tl.cumsum(p, 0)
        hit = (c > target) & (p > 0.0)
        first = tl.min(tl.where(hit, idx, V), 0)
        picked = tl.where(first < V, first, -1)
        last_nz = tl.maximum(last_nz, tl.max(tl.where(p > 0.0, idx, 0), 0))
        carry = carry + tl.sum(p, 0)
        start += BLOCK_V
    tl.store(out_ptr + row, tl.where(picked >= 0, picked, last_nz).to(tl.int64))


def sample_from_cdf(x: torch.Tensor, inv_temp: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Same contract as reference.sample_from_cdf; x float32 [rows, vocab] with unit stride."""
    B, V = x.shape
    assert x.stride(1) == 1
    out = torch.empty(B, dtype=torch.int64, device=x.device)
    block = 4096 if triton_interpreting() else 1024
    _sample_kernel[(B,)](x, inv_temp, u, out, V, x.stride(0), BLOCK_V=block, num_warps=4, **triton_launch_options(x.device))
    return out
