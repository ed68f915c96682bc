"""Triton kernels for everything but attention: KV store, RMSNorm (plain and fused with the residual
add), rotary embedding, SiLU-and-mul. Each has its twin in reference.py with the same contract;
math is in float32, results in the input dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from arcserve.kernels import reference
from arcserve.platform import triton_grid_dependency, triton_interpreting, triton_launch_options

_wait_prior, _start_next = triton_grid_dependency()


@triton.jit
def wait_prior_kernel(PDL: tl.constexpr):
    """The first act of every kernel launched with programmatic dependent launch (PDL=True from
    platform.triton_launch_options): wait until the kernel before has finished (its writes are then
    visible), then let the kernel after be launched, so its start overlaps this one. Loads of data no
    kernel writes (weights) may come before it; every other load and every store after it.
    Without PDL: nothing."""
    if PDL:
        _wait_prior()
        _start_next()


@triton.jit
def to_cache(x, cache_ptr):
    """x in the KV cache's element type; an 8-bit float cache (kv_cache_dtype fp8*, scale 1.0)
    saturates at its largest finite value, as reference.to_kv_cache does."""
    if cache_ptr.dtype.element_ty == tl.float8e4nv:
        x = tl.clamp(x.to(tl.float32), -448.0, 448.0)
    elif cache_ptr.dtype.element_ty == tl.float8e5:
        x = tl.clamp(x.to(tl.float32), -57344.0, 57344.0)
    return x.to(cache_ptr.dtype.element_ty)


_counters: dict[str, torch.Tensor] = {}
_retired: list[torch.Tensor] = []  # captured graphs may still point at an outgrown counter buffer


def zeroed_counters(n: int, device: torch.device) -> torch.Tensor:
    """A zeroed int32 buffer of at least n counters for kernels whose last program to finish merges
    the others' work (attention's KV splits, sampling's vocabulary chunks); every such kernel leaves
    its counters at 0, so launches one after another on a stream share the buffer. One per device,
    grown (never freed) outside graph capture: a graph's warm-up run, with the same shapes,
    allocates what its capture needs."""
    key = str(device)
    buf = _counters.get(key)
    if buf is None or buf.numel() < n:
        if buf is not None:
            _retired.append(buf)
        buf = _counters[key] = torch.zeros(max(n, 4096, 2 * (buf.numel() if buf is not None else 0)),
                                           dtype=torch.int32, device=device)  # fmt: skip
    return buf


# ---- KV store --------------------------------------------------------------------------------
@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, n_tok, stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_cb, stride_cs, stride_ch, stride_vcb, stride_vcs, stride_vch,
                     BLOCK_SIZE: tl.constexpr, KVH: tl.constexpr, KVH_PAD: tl.constexpr, D: tl.constexpr,
                     D_PAD: tl.constexpr, ROWS: tl.constexpr, PDL: tl.constexpr = False):  # fmt: skip
    wait_prior_kernel(PDL)
    t = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    slot = tl.load(slot_ptr + t, mask=t < n_tok, other=-1).to(tl.int64)
    t = t[:, None, None]
    blk = (slot // BLOCK_SIZE)[:, None, None]
    off = (slot % BLOCK_SIZE)[:, None, None]
    h = tl.arange(0, KVH_PAD)[None, :, None]
    d = tl.arange(0, D_PAD)[None, None, :]
    # slot < 0: a padding token (captured graphs), nothing to store
    m = (slot >= 0)[:, None, None] & (h < KVH) & (d < D)
    k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=m)
    v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=m)
    tl.store(kc_ptr + blk * stride_cb + off * stride_cs + h * stride_ch + d, to_cache(k, kc_ptr), mask=m)
    tl.store(vc_ptr + blk * stride_vcb + off * stride_vcs + h * stride_vch + d, to_cache(v, vc_ptr), mask=m)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slots: torch.Tensor) -> None:  # fmt: skip
    """Write each token's K/V ([T, kv_heads, head_dim], any row stride) to its slot of the paged
    cache; slots < 0 are skipped."""
    T, kvh, d = k.shape
    if T == 0:
        return
    assert k.stride(2) == 1 and v.stride(2) == 1
    rows = _rows_per_program(T)
    _store_kv_kernel[(triton.cdiv(T, rows),)](
        k, v, k_cache, v_cache, slots, T, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
        v_cache.stride(2), BLOCK_SIZE=k_cache.shape[1], KVH=kvh, KVH_PAD=triton.next_power_of_2(kvh), D=d, D_PAD=triton.next_power_of_2(d), ROWS=rows,
        **triton_launch_options(k.device),
    )  # fmt: skip


# ---- RMSNorm ---------------------------------------------------------------------------------
@triton.jit
def _rms_norm_kernel(x_ptr, r_ptr, out_ptr, res_out_ptr, w_ptr, n_rows, stride_x, stride_r, stride_o, stride_ro,
                     eps, N: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr, HAS_RES: tl.constexpr, PDL: tl.constexpr = False):  # fmt: skip
    wait_prior_kernel(PDL)
    row = (tl.program_id(0) * ROWS + tl.arange(0, ROWS))[:, None]
    c = tl.arange(0, BLOCK)[None, :]
    m = (c < N) & (row < n_rows)
    x = tl.load(x_ptr + row * stride_x + c, mask=m, other=0.0).to(tl.float32)
    if HAS_RES:
        s = x + tl.load(r_ptr + row * stride_r + c, mask=m, other=0.0).to(tl.float32)
        s_q = s.to(res_out_ptr.dtype.element_ty)  # the residual stream lives in the model dtype
        tl.store(res_out_ptr + row * stride_ro + c, s_q, mask=m)
        x = s_q.to(tl.float32)
    var = tl.sum(x * x, 1) / N
    y = x * tl.rsqrt(var + eps)[:, None]
    w = tl.load(w_ptr + c, mask=c < N, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + c, (y * w).to(out_ptr.dtype.element_ty), mask=m)


def _rows_per_program(n: int) -> int:
    """One row per program on a GPU; blocks of rows in the interpreter, where programs are costly."""
    return min(64, triton.next_power_of_2(n)) if triton_interpreting() else 1


def _rows(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x2 = _rows(x)
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        n = x2.shape[1]
        rows = _rows_per_program(x2.shape[0])
        _rms_norm_kernel[(triton.cdiv(x2.shape[0], rows),)](
            x2, x2, out, out, weight, x2.shape[0], x2.stride(0), 0, out.stride(0), 0, eps,
            N=n, BLOCK=triton.next_power_of_2(n), ROWS=rows, HAS_RES=False, **triton_launch_options(x.device),
        )  # fmt: skip
    return out.view(x.shape)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """residual += x; return (rms_norm(residual), residual), in one pass over the rows."""
    if residual is None:
        return rms_norm(x, weight, eps), x
    x2, r2 = _rows(x), _rows(residual)
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    res = torch.empty_like(out)
    if x2.shape[0]:
        n = x2.shape[1]
        rows = _rows_per_program(x2.shape[0])
        _rms_norm_kernel[(triton.cdiv(x2.shape[0], rows),)](
            x2, r2, out, res, weight, x2.shape[0], x2.stride(0), r2.stride(0), out.stride(0), res.stride(0), eps,
            N=n, BLOCK=triton.next_power_of_2(n), ROWS=rows, HAS_RES=True, **triton_launch_options(x.device),
        )  # fmt: skip
    return out.view(x.shape), res.view(x.shape)


# ---- rotary embedding ------------------------------------------------------------------------
@triton.jit
def _rope_kernel(qk_ptr, pos_ptr, cs_ptr, n_tok, stride_t, stride_h, stride_cs, NH: tl.constexpr,
                 NH_PAD: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr, NEOX: tl.constexpr,
                 ROWS: tl.constexpr, PDL: tl.constexpr = False):  # fmt: skip
    wait_prior_kernel(PDL)
    t = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    pos = tl.load(pos_ptr + t, mask=t < n_tok, other=0).to(tl.int64)[:, None, None]
    t = t[:, None, None]
    i = tl.arange(0, HALF_PAD)[None, None, :]
    h = tl.arange(0, NH_PAD)[None, :, None]
    im = i < HALF
    cos = tl.load(cs_ptr + pos * stride_cs + i, mask=im, other=0.0)
    sin = tl.load(cs_ptr + pos * stride_cs + HALF + i, mask=im, other=0.0)
    m = (t < n_tok) & (h < NH) & im
    base = qk_ptr + t * stride_t + h * stride_h
    if NEOX:
        p1, p2 = base + i, base + HALF + i
    else:
        p1, p2 = base + 2 * i, base + 2 * i + 1
    x1 = tl.load(p1, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(p2, mask=m, other=0.0).to(tl.float32)
    tl.store(p1, (x1 * cos - x2 * sin).to(qk_ptr.dtype.element_ty), mask=m)
    tl.store(p2, (x2 * cos + x1 * sin).to(qk_ptr.dtype.element_ty), mask=m)


def rope_cos_sin(cos_sin: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype) -> tuple:
    """The kernel reads the float32 table at each token's position itself."""
    return cos_sin, positions


def rotary_embedding(qk: torch.Tensor, rope: tuple, neox: bool = True) -> torch.Tensor:
    """In place on qk [T, heads, head_dim] (rows may be strided; features contiguous); returns qk."""
    cos_sin, positions = rope
    T, nh, _ = qk.shape
    assert qk.stride(2) == 1 and cos_sin.dtype == torch.float32
    half = cos_sin.shape[1] // 2
    if T:
        rows = _rows_per_program(T)
        _rope_kernel[(triton.cdiv(T, rows),)](
            qk, positions, cos_sin, T, qk.stride(0), qk.stride(1), cos_sin.stride(0), NH=nh, NH_PAD=triton.next_power_of_2(nh),
            HALF=half, HALF_PAD=triton.next_power_of_2(half), NEOX=neox, ROWS=rows, **triton_launch_options(qk.device),
        )  # fmt: skip
    return qk


# ---- SiLU and mul ----------------------------------------------------------------------------
@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, n_rows, stride_x, stride_o, N: tl.constexpr, BLOCK: tl.constexpr,
                     ROWS: tl.constexpr, PDL: tl.constexpr = False):  # fmt: skip
    wait_prior_kernel(PDL)
    row = (tl.program_id(0) * ROWS + tl.arange(0, ROWS))[:, None]
    c = (tl.program_id(1) * BLOCK + tl.arange(0, BLOCK))[None, :]
    m = (c < N) & (row < n_rows)
    g = tl.load(x_ptr + row * stride_x + c, mask=m, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * stride_x + N + c, mask=m, other=0.0).to(tl.float32)
    y = g / (1.0 + tl.exp(-g))
    # Like the twin (F.silu then multiply in the input dtype): round the activation first.
    y = y.to(out_ptr.dtype.element_ty).to(tl.float32) * u
    tl.store(out_ptr + row * stride_o + c, y.to(out_ptr.dtype.element_ty), mask=m)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    x2 = _rows(x)
    n = x2.shape[1] // 2
    out = torch.empty(x2.shape[0], n, dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        block = min(1024, triton.next_power_of_2(n))
        rows = _rows_per_program(x2.shape[0])
        _silu_mul_kernel[(triton.cdiv(x2.shape[0], rows), triton.cdiv(n, block))](
            x2, out, x2.shape[0], x2.stride(0), out.stride(0), N=n, BLOCK=block, ROWS=rows, **triton_launch_options(x.device)
        )  # fmt: skip
    return out.view(*x.shape[:-1], n)


# ---- fused q/k norm + RoPE + KV store --------------------------------------------------------
@triton.jit
def _qkv_prepare_kernel(qkv_ptr, pos_ptr, cs_ptr, qn_ptr, kn_ptr, kc_ptr, vc_ptr, slot_ptr, n_tok, eps,
                        stride_t, stride_h, stride_cs, stride_cb, stride_cs_, stride_ch, stride_vb, stride_vs,
                        stride_vh, NQ: tl.constexpr, NKV: tl.constexpr, NH_PAD: tl.constexpr,
                        HALF: tl.constexpr, HALF_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                        NEOX: tl.constexpr, HAS_NORM: tl.constexpr, ROWS: tl.constexpr, PDL: tl.constexpr = False):  # fmt: skip
    """ROWS tokens x every head (q, k, v) of each: one pass, in place on qkv for q and k."""
    wait_prior_kernel(PDL)
    t1 = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    pos = tl.load(pos_ptr + t1, mask=t1 < n_tok, other=0).to(tl.int64)[:, None, None]
    slot = tl.load(slot_ptr + t1, mask=t1 < n_tok, other=-1).to(tl.int64)[:, None, None]
    t = t1[:, None, None]
    h = tl.arange(0, NH_PAD)[None, :, None]
    i = tl.arange(0, HALF_PAD)[None, None, :]
    ok = (t < n_tok) & (i < HALF)
    is_q = h < NQ
    is_k = (h >= NQ) & (h < NQ + NKV)
    is_v = (h >= NQ + NKV) & (h < NQ + 2 * NKV)
    base = qkv_ptr + t * stride_t + h * stride_h
    if NEOX:
        o1, o2 = i, HALF + i
    else:
        o1, o2 = 2 * i, 2 * i + 1
    m = ok & (h < NQ + 2 * NKV)
    x1 = tl.load(base + o1, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(base + o2, mask=m, other=0.0).to(tl.float32)
    # V heads: straight to the cache
    cache_off = (slot // BLOCK_SIZE) * stride_vb + (slot % BLOCK_SIZE) * stride_vs
    vm = m & is_v & (slot >= 0)
    tl.store(vc_ptr + cache_off + (h - NQ - NKV) * stride_vh + o1, to_cache(x1, vc_ptr), mask=vm)
    tl.store(vc_ptr + cache_off + (h - NQ - NKV) * stride_vh + o2, to_cache(x2, vc_ptr), mask=vm)
    if HAS_NORM:  # per-head RMSNorm of q and k heads, rounded to the model dtype as the twin does
        var = (tl.sum(x1 * x1, 2) + tl.sum(x2 * x2, 2)) / (2 * HALF)
        r = tl.rsqrt(var + eps)[:, :, None]
        wq = i < HALF
        w1 = tl.where(is_q, tl.load(qn_ptr + o1, mask=wq, other=0.0), tl.load(kn_ptr + o1, mask=wq, other=0.0))
        w2 = tl.where(is_q, tl.load(qn_ptr + o2, mask=wq, other=0.0), tl.load(kn_ptr + o2, mask=wq, other=0.0))
        x1 = (x1 * r * w1.to(tl.float32)).to(qkv_ptr.dtype.element_ty).to(tl.float32)
        x2 = (x2 * r * w2.to(tl.float32)).to(qkv_ptr.dtype.element_ty).to(tl.float32)
    cos = tl.load(cs_ptr + pos * stride_cs + i, mask=i < HALF, other=0.0)
    sin = tl.load(cs_ptr + pos * stride_cs + HALF + i, mask=i < HALF, other=0.0)
    y1 = (x1 * cos - x2 * sin).to(qkv_ptr.dtype.element_ty)
    y2 = (x2 * cos + x1 * sin).to(qkv_ptr.dtype.element_ty)
    qk = m & (is_q | is_k)
    tl.store(base + o1, y1, mask=qk)
    tl.store(base + o2, y2, mask=qk)
    km = m & is_k & (slot >= 0)
    k_off = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs_ + (h - NQ) * stride_ch
    tl.store(kc_ptr + k_off + o1, to_cache(y1, kc_ptr), mask=km)
    tl.store(kc_ptr + k_off + o2, to_cache(y2, kc_ptr), mask=km)


def qkv_prepare(qkv: torch.Tensor, num_q: int, q_norm: torch.Tensor | None, k_norm: torch.Tensor | None,
                eps: float, rope: tuple, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                neox: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """Same contract as reference.qkv_prepare, in one launch (q and k rotated in place in qkv)."""
    cos_sin, positions = rope
    T, nh, d = qkv.shape
    nkv = (nh - num_q) // 2
    if cos_sin.shape[1] != d or qkv.stride(2) != 1:  # partial rotary: the twin's composition of our kernels
        return reference.qkv_prepare(qkv, num_q, q_norm, k_norm, eps, rope, k_cache, v_cache, slots, neox,
                                     parts=(rms_norm, rotary_embedding, store_kv))  # fmt: skip
    if T:
        rows = _rows_per_program(T)
        norm = q_norm is not None
        _qkv_prepare_kernel[(triton.cdiv(T, rows),)](
            qkv, positions, cos_sin, q_norm if norm else qkv, k_norm if norm else qkv, k_cache, v_cache, slots, T,
            eps, qkv.stride(0), qkv.stride(1), cos_sin.stride(0), k_cache.stride(0), k_cache.stride(1),
            k_cache.stride(2), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), NQ=num_q, NKV=nkv,
            NH_PAD=triton.next_power_of_2(nh), HALF=d // 2, HALF_PAD=triton.next_power_of_2(d // 2), BLOCK_SIZE=k_cache.shape[1], NEOX=neox,
            HAS_NORM=norm, ROWS=rows, **triton_launch_options(qkv.device),
        )  # fmt: skip
    return qkv[:, :num_q], qkv[:, num_q : num_q + nkv], qkv[:, num_q + nkv :]
