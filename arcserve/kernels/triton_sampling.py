"""Inverse-CDF sampling (twin: reference.sample_from_cdf), reading the logits once in parallel; and the
repetition / frequency / presence penalties applied in one pass (twin: reference.apply_penalties).

The torch twin materialises the scaled logits, the softmax and its cumulative sum ([rows, vocab] in
float32 each, ~155 MB per pass at 256 rows of a 152k vocabulary). Here each row's vocabulary is cut
into chunks of CHUNK tokens, one program per (row, chunk), reading the logits in their own dtype:
each program finds its chunk's maximum and softmax mass (online, per lane) and counts itself in a
per-row counter; the last of a row's programs to finish combines the chunks' masses, finds the chunk
where the cumulative mass first exceeds u times the total, and scans only that chunk, block by
block, for the token. One pass over the logits plus one chunk per row: at 256 rows of a 152k
vocabulary in bf16 that is ~80 MB, where one program per row scanning its row twice (the kernel
before this one) ran at ~0.5 TB/s, 320 us a step on the H100.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from arcserve.kernels.triton_ops import wait_prior_kernel, zeroed_counters
from arcserve.platform import triton_interpreting, triton_launch_options


@triton.jit
def _scan(base, lo, hi, mx, carry, target, inv_t, BLOCK_V: tl.constexpr):
    """First index in [lo, hi) where carry + the cumulative exp(x * inv_t - mx) exceeds target (and
    the token has mass); the last index with mass if rounding never lets it."""
    lanes = tl.arange(0, BLOCK_V)
    picked = tl.zeros([], tl.int32) - 1
    last_nz = lo
    start = lo
    while (start < hi) & (picked < 0):
        idx = start + lanes
        x = tl.load(base + idx, mask=idx < hi, other=float("-inf")).to(tl.float32) * inv_t
        p = tl.exp(x - mx)
        c = carry + tl.cumsum(p, 0)
        first = tl.min(tl.where((c > target) & (p > 0.0), idx, hi), 0)
        picked = tl.where(first < hi, first, -1)
        last_nz = tl.maximum(last_nz, tl.max(tl.where(p > 0.0, idx, lo), 0))
        carry = carry + tl.sum(p, 0)
        start += BLOCK_V
    return tl.where(picked >= 0, picked, last_nz)


@triton.jit
def _sample_kernel(x_ptr, inv_t_ptr, u_ptr, out_ptr, part_ptr, count_ptr, V, stride_x,
                   CHUNK: tl.constexpr, NUM_CHUNKS: tl.constexpr, C_PAD: tl.constexpr, BLOCK_V: tl.constexpr,
                   PDL: tl.constexpr = False):  # fmt: skip
    wait_prior_kernel(PDL)
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    inv_t = tl.load(inv_t_ptr + row)
    base = x_ptr + row.to(tl.int64) * stride_x
    lanes = tl.arange(0, BLOCK_V)
    lo = chunk * CHUNK
    hi = tl.minimum(lo + CHUNK, V)

    # This chunk's maximum and sum of exp(x - max): per lane, online, then combined.
    m = tl.full([BLOCK_V], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK_V], tl.float32)
    for start in range(lo, hi, BLOCK_V):
        x = tl.load(base + start + lanes, mask=start + lanes < hi, other=float("-inf")).to(tl.float32) * inv_t
        m_new = tl.maximum(m, x)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        s = s * tl.exp(m - m_safe) + tl.exp(x - m_safe)
        m = m_new
    mx = tl.max(m, 0)
    mass = tl.sum(s * tl.exp(m - tl.where(mx == float("-inf"), 0.0, mx)), 0)

    if NUM_CHUNKS == 1:
        target = tl.load(u_ptr + row) * mass
        tl.store(out_ptr + row, _scan(base, lo, hi, mx, tl.zeros([], tl.float32), target, inv_t, BLOCK_V).to(tl.int64))
    else:
        tl.store(part_ptr + (row * NUM_CHUNKS + chunk) * 2, mx)
        tl.store(part_ptr + (row * NUM_CHUNKS + chunk) * 2 + 1, mass)
        # As in the attention kernel's split merge: every store is issued before the counter's
        # release; the row's last program (its acquire sees the others' chunks) finishes the row and
        # leaves the counter at 0 for the next launch.
        tl.debug_barrier()
        counter = count_ptr + row
        if tl.atomic_add(counter, 1, sem="acq_rel") == NUM_CHUNKS - 1:
            cs = tl.arange(0, C_PAD)
            ok = cs < NUM_CHUNKS
            mc = tl.load(part_ptr + (row * NUM_CHUNKS + cs) * 2, mask=ok, other=float("-inf"))
            sc = tl.load(part_ptr + (row * NUM_CHUNKS + cs) * 2 + 1, mask=ok, other=0.0)
            top = tl.max(mc, 0)
            top = tl.where(top == float("-inf"), 0.0, top)
            mass_c = tl.where(mc == float("-inf"), 0.0, sc * tl.exp(mc - top))
            target = tl.load(u_ptr + row) * tl.sum(mass_c, 0)
            hit = (tl.cumsum(mass_c, 0) > target) & (mass_c > 0.0)
            pick = tl.min(tl.where(hit, cs, C_PAD), 0)
            pick = tl.where(pick < C_PAD, pick, tl.max(tl.where(mass_c > 0.0, cs, 0), 0))
            carry = tl.sum(tl.where(cs < pick, mass_c, 0.0), 0)
            c_lo = pick * CHUNK
            token = _scan(base, c_lo, tl.minimum(c_lo + CHUNK, V), top, carry, target, inv_t, BLOCK_V)
            tl.store(out_ptr + row, token.to(tl.int64))
            tl.atomic_xchg(counter, 0)


def sample_from_cdf(x: torch.Tensor, inv_temp: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """reference.sample_from_cdf's contract, x [rows, vocab] in any float dtype, unit stride, except
    that tokens under ~e^-79 of the row's top probability keep their (tiny) mass here: the two
    differ only for a u within that mass of 0 or of a flushed token's interval."""
    B, V = x.shape
    assert x.stride(1) == 1
    out = torch.empty(B, dtype=torch.int64, device=x.device)
    if B == 0:
        return out
    block = 4096 if triton_interpreting() else 1024
    chunk = 4096 if triton_interpreting() else 8192  # in CI a vocabulary over 4,096 takes the merge
    n = triton.cdiv(V, chunk)
    part = torch.empty(B * n * 2 if n > 1 else 1, dtype=torch.float32, device=x.device)
    counts = zeroed_counters(B, x.device) if n > 1 else out
    _sample_kernel[(B, n)](
        x, inv_temp, u, out, part, counts, V, x.stride(0),
        CHUNK=chunk, NUM_CHUNKS=n, C_PAD=triton.next_power_of_2(n), BLOCK_V=block, num_warps=4,
        **triton_launch_options(x.device),
    )  # fmt: skip
    return out


@triton.jit
def _penalties_kernel(x_ptr, rows_ptr, counts_ptr, prompt_ptr, slots_ptr, params_ptr, V, stride_x,
                      BLOCK: tl.constexpr, PDL: tl.constexpr = False):  # fmt: skip
    wait_prior_kernel(PDL)
    j = tl.program_id(0)
    row = tl.load(rows_ptr + j)
    slot = tl.load(slots_ptr + j)
    rep = tl.load(params_ptr + slot * 3)
    freq = tl.load(params_ptr + slot * 3 + 1)
    pres = tl.load(params_ptr + slot * 3 + 2)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < V
    xp = x_ptr + row * stride_x + offs
    x = tl.load(xp, mask=ok)
    c = tl.load(counts_ptr + slot * V + offs, mask=ok, other=0.0)
    seen = (tl.load(prompt_ptr + slot * V + offs, mask=ok, other=0) != 0) | (c > 0)
    x = tl.where(seen, tl.where(x > 0, x / rep, x * rep), x)
    x = x - freq * c
    tl.store(xp, x - tl.where(c > 0, pres, 0.0), mask=ok)


def apply_penalties(logits: torch.Tensor, rows: torch.Tensor, counts: torch.Tensor, prompt: torch.Tensor,
                    slots: torch.Tensor, params: torch.Tensor) -> None:  # fmt: skip
    """reference.apply_penalties' contract: one program per (row, block of the vocabulary) reads the
    row's logits, its slot's counts and prompt flags once and writes the logits back (the twin's
    gathers and elementwise passes moved the rows' [R, V] float32 data ~15 times: ~1.7 ms a step at
    ~195 rows of a 152k vocabulary on an H200)."""
    R, V = len(rows), logits.shape[1]
    assert logits.dtype == counts.dtype == params.dtype == torch.float32 and logits.stride(1) == 1
    assert counts.is_contiguous() and prompt.is_contiguous() and params.is_contiguous()
    if R == 0:
        return
    block = 4096
    _penalties_kernel[(R, triton.cdiv(V, block))](
        logits, rows, counts, prompt.view(torch.uint8), slots, params, V, logits.stride(0), BLOCK=block,
        num_warps=8, **triton_launch_options(logits.device),
    )  # fmt: skip
