"""Paged attention in Triton for the mixed batch: prefill chunks (attending to cached prefix blocks
and to themselves, causally) and decode tokens, in one launch. Twin: reference.paged_attention.

One program handles a tile of one sequence's new tokens times the query heads that share one KV
head (GQA), so each K/V tile read from the cache serves every head of the group. The rows of a
tile are (token, head-in-group) pairs: BLOCK_Q tokens x G_PAD heads; 64 rows in mixed steps, and in
decode steps one token's heads, padded to the rows the backend's `tl.dot` needs (16 on Intel XPU,
platform.triton_min_dot_rows).

Long contexts with few tiles (a single long decode) would leave most of the GPU idle, so the KV
range of each tile can be split across NUM_SPLITS programs (flash-decoding); each writes a partial
output with its log-sum-exp and counts itself in a per-(tile, KV head) counter, and the last of them
to finish merges the partials (no second launch: at batch 1 a launch costs more than the merge).

Tiles are described by two int32 arrays built on the host per step: tile_seq (which sequence; -1
for the padding tiles of a captured graph, which do nothing) and tile_q (first new-token index of
the tile in that sequence).
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from arcserve.kernels.reference import AttentionMetadata
from arcserve.kernels.triton_ops import wait_prior_kernel, zeroed_counters
from arcserve.platform import (
    compute_units,
    to_device,
    triton_interpreting,
    triton_launch_options,
    triton_min_dot_rows,
)


@triton.jit
def _attn_trips(
    acc, m_i, l_i, q, lo, hi, k_head, v_head, table_ptr, stride_kb, stride_ks, stride_vb, stride_vs,
    d, d_ok, qk_scale, qpos, window,
    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    MASKED: tl.constexpr, USE_WINDOW: tl.constexpr, DOT_F32: tl.constexpr,
):  # fmt: skip
    """Online softmax over KV positions [lo, hi) in trips of BLOCK_N (lo on a trip boundary) of one
    KV head (k_head, v_head: the caches at its offset; table_ptr: the sequence's block table).
    MASKED=False: the caller guarantees every row sees every position of every trip, so neither the
    range, the causal order nor a row with nothing visible yet needs a test."""
    n_off = tl.arange(0, BLOCK_N)
    for start in range(lo, hi, BLOCK_N):
        kpos = start + n_off
        if MASKED:
            k_ok = kpos < hi
            blk = tl.load(table_ptr + kpos // BLOCK_SIZE, mask=k_ok, other=0).to(tl.int64)
        else:
            blk = tl.load(table_ptr + kpos // BLOCK_SIZE).to(tl.int64)
        slot = kpos % BLOCK_SIZE
        k_ptrs = k_head + blk[:, None] * stride_kb + slot[:, None] * stride_ks + d[None, :]
        v_ptrs = v_head + blk[:, None] * stride_vb + slot[:, None] * stride_vs + d[None, :]
        if MASKED:
            k = tl.load(k_ptrs, mask=k_ok[:, None] & d_ok[None, :], other=0.0)
            v = tl.load(v_ptrs, mask=k_ok[:, None] & d_ok[None, :], other=0.0)
        elif HEAD_PAD != HEAD_DIM:
            k = tl.load(k_ptrs, mask=d_ok[None, :], other=0.0)
            v = tl.load(v_ptrs, mask=d_ok[None, :], other=0.0)
        else:
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
        if DOT_F32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        elif k_head.dtype.element_ty != q.dtype:  # an 8-bit cache: to float16
            k = k.to(tl.float16)
            v = v.to(tl.float16)
        if DOT_F32:
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale
        else:
            s = tl.dot(q, tl.trans(k)) * qk_scale
        if MASKED:
            ok = k_ok[None, :] & (kpos[None, :] <= qpos[:, None])
            if USE_WINDOW:
                ok = ok & (kpos[None, :] > qpos[:, None] - window)
            s = tl.where(ok, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            # Rows with nothing visible yet keep m = -inf: shift by 0 there so exp2() gives 0, not NaN.
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = m_new
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if DOT_F32:
            acc += tl.dot(p, v, input_precision="ieee")
        else:
            acc += tl.dot(p.to(v.dtype), v)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _attn_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_ptr, lse_ptr, count_ptr,
    block_tables_ptr, seq_lens_ptr, qsl_ptr, tile_seq_ptr, tile_q_ptr,
    scale, window, tile_base, num_tiles,
    stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_ot, stride_oh,
    stride_bt,
    KVH: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    NUM_SPLITS: tl.constexpr, USE_WINDOW: tl.constexpr, DOT_F32: tl.constexpr, HEADS_FIRST: tl.constexpr,
    DIAG_ONLY: tl.constexpr = False, PDL: tl.constexpr = False,
):  # fmt: skip
    wait_prior_kernel(PDL)  # before anything, the padding tiles' return included (see triton_ops)
    # The device starts programs in the order of their one index. HEADS_FIRST: a tile's KV heads
    # (side by side in the cache) and splits one after another, tiles longest first (plan_tiles);
    # else tiles first, then heads, then splits (see tile_plan).
    pid = tl.program_id(0)
    if HEADS_FIRST:
        kvh = pid % KVH
        split = (pid // KVH) % NUM_SPLITS
        tile = pid // (KVH * NUM_SPLITS) + tile_base
    else:
        kvh = (pid // num_tiles) % KVH
        split = pid // (num_tiles * KVH)
        tile = pid % num_tiles + tile_base
    b = tl.load(tile_seq_ptr + tile)
    if b < 0:  # a padding tile of a captured graph
        return
    q0 = tl.load(tile_q_ptr + tile)
    q_start = tl.load(qsl_ptr + b)
    q_len = tl.load(qsl_ptr + b + 1) - q_start
    ctx = tl.load(seq_lens_ptr + b)
    prefix = ctx - q_len  # tokens in the cache before this step's new ones

    M: tl.constexpr = BLOCK_Q * G_PAD
    rows = tl.arange(0, M)
    tok = q0 + rows // G_PAD  # index among the sequence's new tokens
    head = kvh * G + rows % G_PAD
    row_ok = (tok < q_len) & (rows % G_PAD < G)
    qpos = prefix + tok  # absolute position of each row's token
    d = tl.arange(0, HEAD_PAD)
    d_ok = d < HEAD_DIM

    q = tl.load(
        q_ptr + (q_start + tok)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=row_ok[:, None] & d_ok[None, :], other=0.0,
    )  # fmt: skip
    if DOT_F32:
        q = q.to(tl.float32)
    elif k_cache_ptr.dtype.element_ty != q_ptr.dtype.element_ty:
        # An 8-bit cache (scale 1.0): its values convert to float16 in one instruction (to bf16 in
        # three), so the products run in float16, q clamped to its range once (see BENCHMARKS).
        q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)

    # KV positions this tile needs: up to its last token (causal), from the window's start.
    last = tl.minimum(prefix + q0 + BLOCK_Q, ctx)
    first = 0
    if USE_WINDOW:
        first = tl.maximum(prefix + q0 - window + 1, 0)
        first = (first // BLOCK_N) * BLOCK_N
    span = tl.cdiv(tl.maximum(last - first, 0), NUM_SPLITS * BLOCK_N) * BLOCK_N
    lo = first + split * span
    hi = tl.minimum(lo + span, last)

    m_i = tl.full([M], float("-inf"), tl.float32)
    l_i = tl.zeros([M], tl.float32)
    acc = tl.zeros([M, HEAD_PAD], tl.float32)
    qk_scale = scale * 1.4426950408889634  # scores in log2 units: exp2 in the loop, one multiply
    table_ptr = block_tables_ptr + b * stride_bt
    k_head, v_head = k_cache_ptr + kvh * stride_kh, v_cache_ptr + kvh * stride_vh
    # Trips every row of the tile sees whole (at or before its first token's position, before hi)
    # skip the causal and range masks (DIAG_ONLY); the rest (the diagonal, the range's end, a window)
    # take them.
    mid = lo
    if DIAG_ONLY and not USE_WINDOW:
        mid = lo + tl.maximum(tl.minimum(hi, prefix + q0 + 1) - lo, 0) // BLOCK_N * BLOCK_N
        acc, m_i, l_i = _attn_trips(
            acc, m_i, l_i, q, lo, mid, k_head, v_head, table_ptr, stride_kb, stride_ks, stride_vb, stride_vs,
            d, d_ok, qk_scale, qpos, window, BLOCK_N=BLOCK_N, BLOCK_SIZE=BLOCK_SIZE, HEAD_PAD=HEAD_PAD,
            HEAD_DIM=HEAD_DIM, MASKED=False, USE_WINDOW=USE_WINDOW, DOT_F32=DOT_F32,
        )  # fmt: skip
    acc, m_i, l_i = _attn_trips(
        acc, m_i, l_i, q, mid, hi, k_head, v_head, table_ptr, stride_kb, stride_ks, stride_vb, stride_vs,
        d, d_ok, qk_scale, qpos, window, BLOCK_N=BLOCK_N, BLOCK_SIZE=BLOCK_SIZE, HEAD_PAD=HEAD_PAD,
        HEAD_DIM=HEAD_DIM, MASKED=True, USE_WINDOW=USE_WINDOW, DOT_F32=DOT_F32,
    )  # fmt: skip

    out_rows = q_start + tok
    o_mask = row_ok[:, None] & d_ok[None, :]
    if NUM_SPLITS == 1:
        o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptr + out_rows[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=o_mask)  # fmt: skip
    else:  # partial output and log-sum-exp, [T, H, NUM_SPLITS, (HEAD_PAD)]
        H = KVH * G
        first_slot = (out_rows * H + head) * NUM_SPLITS
        o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(part_ptr + (first_slot + split)[:, None] * HEAD_PAD + d[None, :], o, mask=o_mask)
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(tl.where(l_i == 0.0, 1.0, l_i)))  # log2 units
        tl.store(lse_ptr + first_slot + split, lse, mask=row_ok)
        # Every thread's stores are issued before the counter's release; the last split to arrive
        # (its acquire sees all others' partials) merges, and leaves the counter at 0 for the next launch.
        tl.debug_barrier()
        counter = count_ptr + tile * KVH + kvh
        if tl.atomic_add(counter, 1, sem="acq_rel") == NUM_SPLITS - 1:
            m_all = tl.full([M], float("-inf"), tl.float32)
            for j in tl.static_range(NUM_SPLITS):
                m_all = tl.maximum(m_all, tl.load(lse_ptr + first_slot + j, mask=row_ok, other=float("-inf")))
            m_all = tl.where(m_all == float("-inf"), 0.0, m_all)
            den = tl.zeros([M], tl.float32)
            o = tl.zeros([M, HEAD_PAD], tl.float32)
            for j in tl.static_range(NUM_SPLITS):
                wgt = tl.exp2(tl.load(lse_ptr + first_slot + j, mask=row_ok, other=float("-inf")) - m_all)
                den += wgt
                o += wgt[:, None] * tl.load(part_ptr + (first_slot + j)[:, None] * HEAD_PAD + d[None, :], mask=o_mask, other=0.0)
            o = o / tl.maximum(den, 1e-30)[:, None]
            tl.store(out_ptr + out_rows[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                     o.to(out_ptr.dtype.element_ty), mask=o_mask)  # fmt: skip
            tl.atomic_xchg(counter, 0)


def tile_shape(num_heads: int, num_kv_heads: int, decode_only: bool, device: torch.device) -> tuple[int, int]:
    """(BLOCK_Q tokens per tile, G_PAD heads per token): 64 rows for mixed steps; a decode tile holds
    one sequence's one token, padded only to the rows the backend's `tl.dot` needs."""
    g_pad = triton.next_power_of_2(num_heads // num_kv_heads)
    rows = triton_min_dot_rows(device) if decode_only else 64
    return max(1, rows // g_pad), g_pad


def plan_tiles(qsl: np.ndarray, block_q: int, seq_lens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Host-side tile list for a step: (tile_seq, tile_q) int32 arrays. Tiles of prompt chunks
    (sequences with several new tokens) come first: a captured mixed graph splits the KV range of
    its first tiles only (see paged_attention). Within each kind longer contexts (seq_lens) come
    first, equal ones in sequence order: the device starts programs in order, so the longest start
    early and the short ones fill the last wave (a batch of mixed lengths otherwise ends on a few
    long programs)."""
    q_lens = qsl[1:] - qsl[:-1]
    order = np.lexsort((-np.asarray(seq_lens[: len(q_lens)]), q_lens <= 1)).astype(np.int32)
    n = -(-q_lens[order] // block_q)
    seq = np.repeat(order, n)
    first = np.repeat(np.cumsum(n) - n, n)
    q0 = ((np.arange(len(seq)) - first) * block_q).astype(np.int32)
    return seq, q0


def num_splits_for(num_tiles: int, num_kv_heads: int, max_ctx: int, units: int, decode_only: bool = True,
                   kv16: bool = False) -> int:  # fmt: skip
    """Split the KV range when the tiles alone would not fill the device (2 programs per compute
    unit for decode steps; 4 for mixed steps, whose few tiles are typically a short prompt chunk
    over a long cached prefix) and each split still gets enough positions. One program merges a
    tile's splits, reading them one after another: for a mixed tile of 64 rows, 32 splits took ~60
    us per layer on the H100 (16 new tokens over a 4,096-token cached prefix), so mixed steps split
    at most 8 ways; decode steps at most 16. A split gets ~256 positions at least. Decode steps over
    a 16-bit cache with heads up to 128 wide (kv16) split to ~4 programs per unit, not only in
    powers of two; from 2 programs per unit up (the wide tiles, tile_plan), in two below 4 (H200,
    `gpu_kernels.py attention-splits`, 200-2,048-token contexts, us per layer: 24 / 80 / 96
    sequences 44.8 -> 36.3, 96.7 -> 88.4, 120.2 -> 112.9 against the rule before, which split to 2
    per unit in powers of two, and in two on wide tiles below 6 per unit; 4, 8, 16, 32-64 and
    128-256 sequences as before). Other decode steps keep that rule (8-bit caches: unmeasured)."""
    if triton_interpreting():
        return 1  # programs are costly there; the merge path has its own test
    per_unit, max_splits = (2, 16) if decode_only else (4, 8)
    programs = num_tiles * num_kv_heads
    if max_ctx < 512:
        return 1
    if programs >= per_unit * units:
        return 2 if decode_only and kv16 and programs < 4 * units else 1
    cap = min(max_splits, triton.next_power_of_2(max(1, max_ctx // 256)))
    if decode_only and kv16:  # (programs < 2 per unit here: round() gives 2 or more)
        return min(round(4 * units / programs), cap)
    return int(min(triton.next_power_of_2(-(-per_unit * units // programs)), cap))


def tile_plan(num_heads: int, num_kv_heads: int, decode_only: bool, split_tiles: int, max_ctx: int,
              device: torch.device, kv_itemsize: int = 2, head_dim: int = 128) -> dict:  # fmt: skip
    """A step's launch settings (the tile arrays aside), for eager steps and captured graphs alike:
    split_tiles = the tiles that decide the split and take it, the first ones (a decode graph's:
    its bound; a mixed graph's: its prompt-chunk tiles, see paged_attention). kv_itemsize: bytes
    per cached K/V value (1 for an 8-bit cache: decode tiles then take 128 positions per loop
    trip, the bytes of 64 in bf16; H100, `gpu_kernels.py attention-sweep fp8`: 64 / 128 / 256
    sequences 81.2 -> 65.1, 126.2 -> 118.9, 190.2 -> 178.7 us, batch 1 the same)."""
    block_q, g_pad = tile_shape(num_heads, num_kv_heads, decode_only, device)
    # Decode batches of at least 2 programs per compute unit over a 16-bit cache read faster with
    # 128 positions a trip and 2 stages (H100, `gpu_kernels.py attention-layout`, 128 / 192 / 256
    # sequences of 200-2,048 tokens: 240.1 -> 230.7, 295.7 -> 286.8, 342.6 -> 335.3 us; below 4 per
    # unit with a split in two, num_splits_for). Heads up to 128 wide (at 128: 66.5 KB of shared
    # memory and 153-166 registers a thread, 3 programs per unit; ncu, H200).
    units = compute_units(device)
    kv16 = kv_itemsize == 2 and head_dim <= 128
    wide = decode_only and kv16 and split_tiles * num_kv_heads >= 2 * units
    block_n = 128 if triton_interpreting() or (decode_only and (kv_itemsize == 1 or wide)) else 64
    splits = num_splits_for(split_tiles, num_kv_heads, max_ctx, units, decode_only, kv16)
    return {
        "block_q": block_q,
        "g_pad": g_pad,
        "block_n": block_n,  # (the interpreter: fewer loop trips where each op is costly)
        "splits": splits,
        "split_tiles": split_tiles,
        "launch": {"num_stages": 2} if wide and not triton_interpreting() else {},
        # Programs in the order heads, splits, tiles (H200, `gpu_kernels.py attention-order`-style
        # runs, decode attention over sequences of 200-2,048 tokens, us per layer: 48 / 128 / 192 /
        # 256 sequences 68.7 -> 60.7, 156.4 -> 141.1, 216.1 -> 199.6, 285.1 -> 274.1; throughput
        # +2.4%), but for decode steps off the wide tiles (under 2 programs per unit: 32 sequences
        # 51.3 against 55.2 in that order; 8-bit caches, float32 ones, heads over 128: unmeasured).
        "heads_first": wide or not decode_only,
        # Masks only on the loop trips that need them (_attn_trips), for unsplit prompt chunks (H200,
        # `gpu_kernels.py prefill-sweep`, us per layer: one 4,096-token prompt 265.1 -> 241.7, 512-token
        # chunks over 0-3,072 cached 479.6 -> 456.3; a mixed step's decodes share the launch). Not
        # for decode steps (`attention-diag`: a second loop costs split programs of a few trips more
        # than the masks save, batch 1 / 8 9.9 -> 10.2, 13.1 -> 13.9) nor split chunks, whose programs
        # are as short (the cached-prefix TTFT of `gpu_bench.py prefix`, 8 splits, did not move
        # beyond its spread either way).
        "diag_only": not decode_only and splits == 1,
    }


def paged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    meta: AttentionMetadata, scale: float, sliding_window: int | None = None, layer: int = 0,
) -> torch.Tensor:  # fmt: skip
    """Same contract as reference.paged_attention (the cache already holds this step's K/V).
    meta.cache["triton"] holds the step's tiles (set once per step by `prepare`)."""
    plan = meta.cache.get("triton") or prepare(meta, q.shape[1], k_cache.shape[2], q.device, k_cache.element_size(),
                                               q.shape[2])  # fmt: skip
    T, H, D = q.shape
    kvh = k_cache.shape[2]
    out = torch.empty(T, H, D, dtype=q.dtype, device=q.device)
    splits, head_pad = plan["splits"], triton.next_power_of_2(D)
    if splits > 1:  # every (token, head, split) of a real tile is written; padding rows are never read
        part = torch.empty(T, H, splits, head_pad, dtype=torch.float32, device=q.device)
        lse = torch.empty(T, H, splits, dtype=torch.float32, device=q.device)
        counts = zeroed_counters(plan["num_tiles"] * kvh, q.device)
    else:
        part = lse = counts = out
    # A captured mixed graph's tile bound is mostly padding (room for one tile per sequence); split
    # only its first split_tiles tiles (the prompt chunks, plan_tiles) and run the rest unsplit in a
    # second launch. A 32-token prompt over a cached 4,096-token prefix (bucket 32: 1 chunk tile,
    # 33 tiles, 8 splits) had a TTFT of 4.9 ms with every tile split, 3.9 ms so (H100, gpu_bench prefix).
    n = plan["num_tiles"]
    first = min(plan["split_tiles"], n) if splits > 1 else n
    for base, tiles, n_split in ((0, first, splits), (first, n - first, 1)):
        if not tiles:
            continue
        _attn_kernel[(tiles * kvh * n_split,)](
            q, k_cache, v_cache, out, part, lse, counts,
            meta.block_tables, meta.seq_lens, meta.query_start_loc, plan["tile_seq"], plan["tile_q"],
            scale, sliding_window or 0, base, tiles,
            q.stride(0), q.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            out.stride(0), out.stride(1),
            meta.block_tables.stride(0),
            KVH=kvh, G=H // kvh, G_PAD=plan["g_pad"], BLOCK_Q=plan["block_q"], HEAD_DIM=D, HEAD_PAD=head_pad,
            BLOCK_N=plan["block_n"], BLOCK_SIZE=k_cache.shape[1], NUM_SPLITS=n_split,
            USE_WINDOW=sliding_window is not None, DOT_F32=q.dtype == torch.float32 or triton_interpreting(),
            HEADS_FIRST=plan["heads_first"], DIAG_ONLY=plan["diag_only"],
            **plan.get("launch", {}), **triton_launch_options(q.device),
        )  # fmt: skip
    return out


def prepare(meta: AttentionMetadata, num_heads: int, num_kv_heads: int, device: torch.device,
            kv_itemsize: int = 2, head_dim: int = 128) -> dict:  # fmt: skip
    """Tiles for a step from the host copy of query_start_loc; cached in meta for every layer."""
    qsl, seq_lens = meta.host["query_start_loc"], meta.host["seq_lens"]
    decode_only = bool(((qsl[1:] - qsl[:-1]) <= 1).all())
    seq, q0 = plan_tiles(qsl, tile_shape(num_heads, num_kv_heads, decode_only, device)[0], seq_lens)
    max_ctx = int(seq_lens.max()) if len(seq_lens) else 0
    plan = tile_plan(num_heads, num_kv_heads, decode_only, len(seq), max_ctx, device, kv_itemsize, head_dim)
    tiles = to_device(np.stack([seq, q0]), device)  # one asynchronous copy
    plan.update(tile_seq=tiles[0], tile_q=tiles[1], num_tiles=len(seq))
    meta.cache["triton"] = plan
    return plan
