"""Each GPU kernel against its floor: bytes it must move over the measured copy bandwidth, or FLOPs
over the measured bf16 matmul rate (whichever is larger). Shapes of the Qwen3-0.6B and Llama-3.1-8B
decoders in bf16. Every kernel is captured 20 times into a graph and timed by replays (so launch
gaps do not count), over enough copies of its inputs to miss the L2 cache.

    python benchmarks/gpu_kernels.py            # prints one table: us, floor us, % of floor
    python benchmarks/gpu_kernels.py attention-sweep   # decode attention over launch settings
    python benchmarks/gpu_kernels.py linear-sweep      # one-row linears: library, matrix-vector
                                                       # kernel, fused prologues
    python benchmarks/gpu_kernels.py gemv-grid         # matrix-vector program shapes, Llama-8B
    python benchmarks/gpu_kernels.py gemv-candidates   # a few shapes on every one-row matrix
    python benchmarks/gpu_kernels.py attention-varied  # decode attention over mixed context lengths, by split
    python benchmarks/gpu_kernels.py attention-varied fp8  # the same over an 8-bit cache (attention-sweep too)
    python benchmarks/gpu_kernels.py attention-layout  # decode attention by cache layout and block size,
                                                       # beside a plain read kernel's bandwidth
    python benchmarks/gpu_kernels.py attention-mid     # decode attention at 32-256 sequences, wider launch grid
    python benchmarks/gpu_kernels.py attention-order   # decode attention in both orders of its programs
    python benchmarks/gpu_kernels.py attention-splits  # decode attention at 4-256 sequences, by KV split
    python benchmarks/gpu_kernels.py attention-dealt   # the same, against items dealt to programs
                                                       # (an experiment, not in arcserve)
    python benchmarks/gpu_kernels.py prefill-sweep     # prompt-chunk attention tiles, a mixed step's launches
    python benchmarks/gpu_kernels.py attention-diag    # decode attention, masks on every trip or the last
    python benchmarks/gpu_kernels.py batch-gemm        # decode-batch products (8-256 rows): cuBLAS against
                                                       # a plain Triton GEMM (an experiment, not in arcserve)
    python benchmarks/gpu_kernels.py batch-gemm-wide   # the same at 64-256 rows with row tiles up to 256
    python benchmarks/gpu_kernels.py batch-gemm-splitk # the same with K split over programs (64-256 rows)
    python benchmarks/gpu_kernels.py blas-libs         # the same products (8-8,192 rows) under each library
                                                       # torch can prefer, weights [out, in] and [in, out]
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import sys
import time
from pathlib import Path

import numpy as np
import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).parent))

from arcserve.kernels import reference, triton_attention, triton_linear, triton_ops
from arcserve.kernels.reference import AttentionMetadata
from arcserve.kernels.triton_ops import wait_prior_kernel
from arcserve.platform import (
    capture,
    compute_units,
    graph_pool,
    new_graph,
    resolve_device,
    synchronize,
    triton_interpreting,
    triton_launch_options,
)

DEV = resolve_device("auto")
BF16 = torch.bfloat16
L2_MISS_BYTES = 512 << 20  # inputs rotated over at least this many bytes


def graph_time(fns: list, reps: int = 20) -> float:
    """Median microseconds per call of fns (cycled), captured `reps` times into one graph."""
    for f in fns:
        f()
    synchronize(DEV)
    g = new_graph(DEV)
    with capture(g, DEV, graph_pool(DEV)):
        for i in range(reps):
            fns[i % len(fns)]()
    g.replay()
    synchronize(DEV)
    times = []
    for _ in range(15):
        t = time.perf_counter()
        g.replay()
        synchronize(DEV)
        times.append((time.perf_counter() - t) / reps)
    return float(np.median(times)) * 1e6


def copies(make, nbytes: int) -> list:
    return [make() for _ in range(max(1, min(32, -(-L2_MISS_BYTES // max(nbytes, 1)))))]


def measure_ceilings() -> tuple[float, float]:
    """Copy bandwidth as gpu_bench.py measures it (a copy inside a graph runs slower), matmul rate."""
    from gpu_bench import copy_bandwidth

    bw = copy_bandwidth()
    a = torch.randn(8192, 8192, device=DEV, dtype=BF16)
    b = torch.randn(8192, 8192, device=DEV, dtype=BF16)
    flops = 2 * 8192**3 / (graph_time([lambda: a @ b], 5) * 1e-6)
    return bw, flops


def paged_meta(new: np.ndarray, ctx: np.ndarray, bs: int = 16, shuffled: bool = True):
    """(metadata, blocks used) of a step whose sequences bring new[i] tokens with context ctx[i]
    (cached + new), each over distinct random blocks of bs tokens (in order if not shuffled)."""
    nb = -(-ctx // bs)
    perm = torch.randperm(int(nb.sum())).int() if shuffled else torch.arange(int(nb.sum()), dtype=torch.int32)
    bt = torch.zeros(len(ctx), int(nb.max()), dtype=torch.int32)
    for i, off in enumerate(np.cumsum(nb) - nb):
        bt[i, : nb[i]] = perm[off : off + nb[i]]
    qsl = np.concatenate([[0], np.cumsum(new)]).astype(np.int64)
    meta = AttentionMetadata(
        query_start_loc=torch.from_numpy(qsl).int().to(DEV), seq_lens=torch.from_numpy(ctx).int().to(DEV),
        block_tables=bt.to(DEV), slot_mapping=torch.zeros(int(qsl[-1]), dtype=torch.int64, device=DEV),
        host={"query_start_loc": qsl, "seq_lens": ctx},
    )  # fmt: skip
    return meta, int(nb.sum())


def attention_step(new: np.ndarray, ctx: np.ndarray, h: int = 16, kvh: int = 8, d: int = 128, cache_dtype=BF16):
    """(q, k_cache, v_cache, meta) of a step whose sequences bring new[i] tokens over contexts ctx[i]:
    random K/V (bf16, or an 8-bit cache) in shuffled 16-position blocks; meta holds the step's tile
    plan (meta.cache["triton"], changed in place to try others)."""
    meta, blocks = paged_meta(np.asarray(new, dtype=np.int64), ctx, 16)
    kc = torch.randn(blocks, 16, kvh, d, device=DEV, dtype=BF16).to(cache_dtype)
    vc = torch.randn(blocks, 16, kvh, d, device=DEV, dtype=BF16).to(cache_dtype)
    q = torch.randn(int(np.sum(new)), h, d, device=DEV, dtype=BF16)
    triton_attention.prepare(meta, h, kvh, DEV, kc.element_size())
    return q, kc, vc, meta


def decode_inputs(lens: np.ndarray, h: int, kvh: int, d: int, cache_dtype=BF16):
    """attention_step of a decode step over sequences of lens[i] tokens."""
    return attention_step(np.ones(len(lens), dtype=np.int64), lens, h, kvh, d, cache_dtype)


def varied_decode_attention(lens: np.ndarray, h: int, kvh: int, d: int, cache_dtype=BF16):
    """(plan, fn): decode_inputs' step through the shipped kernel; plan is its launch settings,
    changed in place to try others."""
    q, kc, vc, meta = decode_inputs(lens, h, kvh, d, cache_dtype)
    return meta.cache["triton"], shipped_attention(q, kc, vc, meta)


def shipped_attention(q, kc, vc, meta):
    """fn: the step of attention_step through arcserve's paged attention (its plan in meta)."""
    return functools.partial(triton_attention.paged_attention, q, None, None, kc, vc, meta, q.shape[-1] ** -0.5, None, 0)


def read_pct(lens: np.ndarray, kvh: int, d: int, us: float, read_rate: float) -> float:
    """% of the plain read rate at which a decode step over 16-bit K and V of lens[i] tokens ran."""
    return 100 * 4 * int(lens.sum()) * kvh * d / (us * 1e-6) / read_rate


def plan_variants(lens: np.ndarray, key: str, values, cache_dtype=BF16) -> list[tuple]:
    """Decode attention (Qwen3-0.6B heads) over sequences of lens[i] tokens with the tile plan's
    `key` set to each of `values`, the shipped plan otherwise: [(value, us best of three, shipped?)],
    each variant's output checked against the shipped plan's."""
    plan, fn = varied_decode_attention(lens, 16, 8, 128, cache_dtype)
    shipped = plan[key]
    ref = fn().float()
    rows = []
    for value in values:
        plan[key] = value
        assert float((fn().float() - ref).norm() / ref.norm()) < 1e-2, (len(lens), key, value)
        rows.append((value, min(graph_time([fn]) for _ in range(3)), value == shipped))
    plan[key] = shipped
    return rows


def decode_attention(batch: int, ctx: int, h: int, kvh: int, d: int, cache_dtype=BF16):
    """varied_decode_attention over `batch` sequences of `ctx` tokens each."""
    return varied_decode_attention(np.full(batch, ctx), h, kvh, d, cache_dtype)


def prefill_meta(T: int):
    meta = AttentionMetadata(
        query_start_loc=torch.tensor([0, T], dtype=torch.int32, device=DEV),
        seq_lens=torch.tensor([T], dtype=torch.int32, device=DEV),
        block_tables=torch.arange(-(-T // 16), dtype=torch.int32, device=DEV)[None],
        slot_mapping=torch.arange(T, device=DEV),
        host={"query_start_loc": np.array([0, T]), "seq_lens": np.array([T])},
    )  # fmt: skip
    return meta, -(-T // 16)


@torch.inference_mode()
def attention_sweep(cache_dtype=BF16) -> None:
    """Decode attention over launch settings: splits x BLOCK_N x warps x stages, at batch 1 and at
    the batches of a throughput run (64-256 sequences of ~700-1,024 tokens); % of the KV-read floor
    (cache_dtype: bf16, or an 8-bit cache, `attention-sweep fp8`)."""
    from gpu_bench import copy_bandwidth

    bw = copy_bandwidth()
    h, kvh, d = 16, 8, 128
    print(f"{'batch':>5s} {'ctx':>6s} {'splits':>6s} {'block_n':>7s} {'warps':>5s} {'stages':>6s} {'us':>8s} {'floor':>6s}")
    for batch, ctx in ((1, 2048), (64, 1024), (128, 1024), (256, 768)):
        plan, fn = decode_attention(batch, ctx, h, kvh, d, cache_dtype)
        floor = 2 * cache_dtype.itemsize * batch * ctx * kvh * d / bw * 1e6
        for splits in ((1, 4, 16) if batch == 1 else (1,)):
            for block_n in (32, 64, 128):
                for warps in (2, 4, 8):
                    for stages in (2, 3, 4):
                        plan.update(splits=splits, block_n=block_n, launch={"num_warps": warps, "num_stages": stages})
                        try:
                            us = graph_time([fn])
                        except Exception as e:  # noqa: BLE001 (a setting the compiler refuses)
                            print(f"{batch:5d} {ctx:6d} {splits:6d} {block_n:7d} {warps:5d} {stages:6d} failed: {type(e).__name__}")
                            continue
                        print(f"{batch:5d} {ctx:6d} {splits:6d} {block_n:7d} {warps:5d} {stages:6d} {us:8.2f} {100 * floor / us:5.0f}%")


@torch.inference_mode()
def attention_varied(cache_dtype=BF16) -> None:
    """Decode attention (Qwen3-0.6B heads) over sequences of mixed context lengths, as in a
    throughput run, at each KV split: the chosen one (*) against the others, % of the KV-read floor
    (cache_dtype: bf16, or an 8-bit cache, `attention-varied fp8`)."""
    from gpu_bench import copy_bandwidth

    bw = copy_bandwidth()
    rng = np.random.default_rng(0)
    for batch, lo, hi in ((32, 1000, 2048), (64, 200, 2048), (64, 1000, 2048), (128, 200, 2048),
                          (128, 800, 2048), (192, 200, 1800), (256, 200, 1600)):  # fmt: skip
        lens = rng.integers(lo, hi + 1, batch)
        floor = 2 * cache_dtype.itemsize * int(lens.sum()) * 8 * 128 / bw * 1e6
        for splits, us, chosen in plan_variants(lens, "splits", (1, 2, 4, 8), cache_dtype):
            mark = "*" if chosen else " "
            print(f"batch {batch:4d} ctx {lo}-{hi} splits {splits}{mark} {us:8.1f} us  floor {floor:7.1f}  {100 * floor / us:5.1f}%")


@triton.jit
def _read_sum(x_ptr, out_ptr, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    base = tl.program_id(0).to(tl.int64) * BLOCK * ITERS
    acc = tl.zeros([BLOCK], tl.float32)
    for i in range(ITERS):
        acc += tl.load(x_ptr + base + i * BLOCK + tl.arange(0, BLOCK)).to(tl.float32)
    tl.store(out_ptr + tl.program_id(0), tl.sum(acc))


def read_ceiling() -> float:
    """Bytes read per second by the best of a few plain read-and-sum kernels over 2 GiB of bf16."""
    x = torch.randn(1 << 30, device=DEV, dtype=BF16)
    best = 0.0
    for block, iters, warps in itertools.product((1024, 4096), (4, 16), (4, 8)):
        out = torch.empty(x.numel() // (block * iters), device=DEV, dtype=torch.float32)
        us = graph_time([lambda: _read_sum[(out.numel(),)](x, out, BLOCK=block, ITERS=iters, num_warps=warps)], 3)
        ok = torch.allclose(out.sum(), x.float().sum(), rtol=1e-3, atol=1.0)
        tbs = 2 * x.numel() / us / 1e6
        print(f"read-sum block {block:5d} iters {iters:3d} warps {warps}: {tbs:.3f} TB/s{'' if ok else '  WRONG SUM'}")
        best = max(best, tbs)
    del x
    return best * 1e12


@torch.inference_mode()
def attention_layout() -> None:
    """Decode attention (Qwen3-0.6B heads) over mixed context lengths as in a throughput run, by
    cache layout: positions-major blocks ([blocks, block_size, kv_heads, d], as the engine stores
    them) against heads-major blocks ([blocks, kv_heads, block_size, d], passed to the kernel as a
    permuted view), block sizes 16-64, blocks shuffled or in order; launch settings swept; TB/s of
    K and V read, beside a plain read kernel's TB/s and the copy bandwidth."""
    from gpu_bench import copy_bandwidth

    bw = copy_bandwidth()
    rd = read_ceiling()
    print(f"copy {bw / 1e12:.3f} TB/s (read + write), plain read {rd / 1e12:.3f} TB/s")
    h, kvh, d = 16, 8, 128
    rng = np.random.default_rng(0)
    combos = list(itertools.product((4, 8), (2, 3, 4), (64, 128)))
    summary = []
    for batch, lo, hi in ((32, 200, 2048), (64, 200, 2048), (96, 200, 2048), (128, 200, 2048), (192, 200, 1800),
                          (256, 200, 1600)):  # fmt: skip
        lens = rng.integers(lo, hi + 1, batch)
        q = torch.randn(batch, h, d, device=DEV, dtype=BF16)
        nbytes = 2 * 2 * int(lens.sum()) * kvh * d
        ref = None
        for bs, heads_major, shuffled, longest_first in (
                (16, False, True, True), (16, False, True, False), (16, True, True, True), (32, False, True, True),
                (32, True, True, True), (64, False, True, True), (64, True, True, True), (16, False, False, True)):  # fmt: skip
            torch.manual_seed(1)
            meta, blocks = paged_meta(np.ones(batch, dtype=np.int64), lens, bs, shuffled)
            kt = torch.randn(blocks, bs, kvh, d, device=DEV, dtype=BF16)
            vt = torch.randn(blocks, bs, kvh, d, device=DEV, dtype=BF16)
            if heads_major:
                kc = kt.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)
                vc = vt.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)
                del kt, vt
            else:
                kc, vc = kt, vt
            plan = triton_attention.prepare(meta, h, kvh, DEV, 2)
            if not longest_first:  # tiles in sequence order (equal lengths), as before plan_tiles took seq_lens
                seq, q0 = triton_attention.plan_tiles(meta.host["query_start_loc"], plan["block_q"], np.zeros(batch))
                plan.update(tile_seq=torch.from_numpy(seq).to(DEV), tile_q=torch.from_numpy(q0).to(DEV))
            fn = lambda: triton_attention.paged_attention(q, None, None, kc, vc, meta, d**-0.5, None, 0)  # noqa: E731
            label = f"bs {bs:2d} {'heads' if heads_major else 'positions'}-major{'' if shuffled else ' in order'}"
            label += "" if longest_first else " seq order"
            block_n0, launch0 = plan["block_n"], plan["launch"]
            default = graph_time([fn])
            if bs == 16 and not heads_major and shuffled and longest_first:  # same random K/V for each layout (seeded)
                ref = fn().float()
            out = fn().float()
            err = float((out - ref).norm() / ref.norm()) if bs == 16 and shuffled else float("nan")
            best = (default, "default")
            for warps, stages, block_n in combos:
                plan.update(block_n=block_n, launch={"num_warps": warps, "num_stages": stages})
                with contextlib.suppress(Exception):
                    us = graph_time([fn])
                    best = min(best, (us, f"{warps}w {stages}s n{block_n}"))
            plan.update(block_n=block_n0, launch=launch0)
            line = (f"batch {batch:3d} {label:30s} splits {plan['splits']}: default {default:7.1f} us "
                    f"{nbytes / default / 1e6:.3f} TB/s; best {best[0]:7.1f} us {nbytes / best[0] / 1e6:.3f} TB/s "
                    f"({best[1]}; {100 * nbytes / best[0] * 1e6 / rd:.1f}% of read)  err vs bs16 {err:.1e}")  # fmt: skip
            print(line, flush=True)
            summary.append(line)
            del kc, vc
    print("\n".join(summary))


@torch.inference_mode()
def attention_mid() -> None:
    """Decode attention (Qwen3-0.6B heads) at 32-256 sequences of 200-2,048 tokens over a wider
    launch grid than attention-layout (warps 1-8, stages 2-5, 16-128 positions a trip, the KV range
    whole or split in two): the shipped plan against the four best, % of the plain read rate."""
    rd = read_ceiling()
    h, kvh, d = 16, 8, 128
    rng = np.random.default_rng(0)
    combos = list(itertools.product((1, 2, 4, 8), (2, 3, 4, 5), (16, 32, 64, 128), (1, 2)))
    lines = []
    for batch in (32, 64, 96, 128, 192, 256):
        lens = rng.integers(200, 2049, batch)
        plan, fn = varied_decode_attention(lens, h, kvh, d)
        shipped = dict(plan)
        pct = functools.partial(read_pct, lens, kvh, d, read_rate=rd)
        ref, default = fn().float(), graph_time([fn])
        found, skipped = [], 0
        for warps, stages, block_n, splits in combos:
            plan.update(block_n=block_n, launch={"num_warps": warps, "num_stages": stages}, splits=splits)
            try:
                out = fn().float()
            except Exception:  # noqa: BLE001 (a setting this Triton cannot compile or launch: skipped, counted)
                skipped += 1
                continue
            assert float((out - ref).norm() / ref.norm()) < 2e-2, (batch, warps, stages, block_n, splits)
            found.append((graph_time([fn]), warps, stages, block_n, splits))
        plan.update(shipped)
        best = ", ".join(f"{us:.1f} ({pct(us):.1f}%) w{w} st{st} n{n} sp{sp}" for us, w, st, n, sp in sorted(found)[:4])
        lines.append(f"batch {batch:3d}: shipped {default:.1f} us ({pct(default):.1f}% of read; n{shipped['block_n']} "
                     f"splits {shipped['splits']} {shipped['launch']}); best {best}; {skipped} settings skipped")  # fmt: skip
        print(lines[-1], flush=True)
    print("\n".join(lines))


@torch.inference_mode()
def attention_order() -> None:
    """Decode attention (Qwen3-0.6B heads) in both orders of the kernel's programs (tile_plan's
    heads_first: a tile's KV heads and splits one after another, or tiles first), at 1-256 sequences
    of 200-2,048 tokens and at four batches of shorter or narrower contexts as a throughput run has
    them (1 and 8 sequences: 2,048 tokens each); us per layer, best of three, the shipped order
    marked *."""
    rng = np.random.default_rng(0)
    cases = [(1, 2048, 2049), (8, 2048, 2049)] + [(b, 200, 2049) for b in (32, 48, 64, 96, 128, 160, 192, 256)]
    cases += [(256, 100, 1100), (192, 300, 1500), (128, 500, 1800), (64, 900, 2000)]
    for batch, lo, hi in cases:
        rows = plan_variants(rng.integers(lo, hi, batch), "heads_first", (True, False))
        print(f"batch {batch:3d} of {lo}-{hi - 1} tokens: "
              + ", ".join(f"{'heads' if first else 'tiles'} first{'*' if shipped else ''} {us:7.1f}"
                          for first, us, shipped in rows), flush=True)  # fmt: skip


@torch.inference_mode()
def attention_splits() -> None:
    """Decode attention (Qwen3-0.6B heads) at 4-256 sequences of 200-2,048 tokens, the KV range
    split 1-16 ways (the shipped plan otherwise; its split marked *): us per layer, best of three,
    and % of the plain read rate."""
    rd = read_ceiling()
    rng = np.random.default_rng(0)
    for batch in (4, 8, 16, 24, 32, 40, 48, 64, 80, 96, 128, 160, 192, 256):
        lens = rng.integers(200, 2049, batch)
        rows = plan_variants(lens, "splits", (1, 2, 3, 4, 6, 8, 12, 16))
        print(f"batch {batch:3d}: " + ", ".join(f"{splits}{'*' if shipped else ''}: {us:.1f} "
                                                f"({read_pct(lens, 8, 128, us, rd):.0f}%)"
                                                for splits, us, shipped in rows), flush=True)  # fmt: skip


@triton.jit
def _decode_dealt(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, block_tables_ptr, seq_lens_ptr, tile_seq_ptr, num_tiles, scale_log2,
    stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_ot, stride_oh,
    stride_bt,
    KVH: tl.constexpr, G: tl.constexpr, M: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, MAX_ITEMS: tl.constexpr, DOT_F32: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    """A decode step's attention with its (sequence, KV head) items dealt to a fixed number of
    programs: item ranks follow the tiles (longest context first, plan_tiles) times the KV heads, and
    program p takes ranks i * P + p in even rounds i, i * P + P - 1 - p in odd ones (a snake, so each
    program's total stays near the mean). A program walks all its items' loop trips as one loop,
    so its loads stay pipelined from one item into the next instead of starting over per program."""
    wait_prior_kernel(PDL)
    p = tl.program_id(0)
    P = tl.num_programs(0)
    i = tl.arange(0, MAX_ITEMS)
    rank = i * P + tl.where(i % 2 == 0, p, P - 1 - p)
    ok = rank < num_tiles * KVH
    b_i = tl.load(tile_seq_ptr + rank // KVH, mask=ok, other=-1)
    ok = ok & (b_i >= 0)  # padding tiles of a captured graph
    ctx_i = tl.load(seq_lens_ptr + b_i, mask=ok, other=0)
    trips_i = tl.where(ok, tl.cdiv(ctx_i, BLOCK_N), 0)
    total = tl.sum(trips_i)
    start_i = tl.where(ok, tl.cumsum(trips_i, 0) - trips_i, total)  # first trip of each item
    kvh_i = rank % KVH

    rows = tl.arange(0, M)
    row_ok = rows < G  # one token's G heads; the rest pads the rows tl.dot needs
    d = tl.arange(0, HEAD_PAD)
    d_ok = d < HEAD_DIM
    n_off = tl.arange(0, BLOCK_N)
    m_i = tl.full([M], float("-inf"), tl.float32)
    l_i = tl.zeros([M], tl.float32)
    acc = tl.zeros([M, HEAD_PAD], tl.float32)
    for t in range(0, total):
        # this trip's item, from registers (no load on the way to the K/V addresses)
        sel = i == tl.sum((start_i <= t).to(tl.int32)) - 1
        b = tl.sum(tl.where(sel, b_i, 0))
        kvh = tl.sum(tl.where(sel, kvh_i, 0))
        ctx = tl.sum(tl.where(sel, ctx_i, 0))
        pos0 = (t - tl.sum(tl.where(sel, start_i, 0))) * BLOCK_N
        head = kvh * G + rows
        q = tl.load(q_ptr + b * stride_qt + head[:, None] * stride_qh + d[None, :],
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # fmt: skip
        kpos = pos0 + n_off
        k_ok = kpos < ctx
        blk = tl.load(block_tables_ptr + b * stride_bt + kpos // BLOCK_SIZE, mask=k_ok, other=0).to(tl.int64)
        slot = kpos % BLOCK_SIZE
        kv_mask = k_ok[:, None] & d_ok[None, :]
        k = tl.load(k_cache_ptr + blk[:, None] * stride_kb + slot[:, None] * stride_ks + kvh * stride_kh + d[None, :],
                    mask=kv_mask, other=0.0)  # fmt: skip
        v = tl.load(v_cache_ptr + blk[:, None] * stride_vb + slot[:, None] * stride_vs + kvh * stride_vh + d[None, :],
                    mask=kv_mask, other=0.0)  # fmt: skip
        first = pos0 == 0  # a new item: its running maximum, sum and output start over
        m_i = tl.where(first, float("-inf"), m_i)
        l_i = tl.where(first, 0.0, l_i)
        acc = tl.where(first, 0.0, acc)
        if DOT_F32:
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee") * scale_log2
        else:
            s = tl.dot(q, tl.trans(k)) * scale_log2
        s = tl.where(k_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: every trip holds a visible position
        pr = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(pr, 1)
        if DOT_F32:
            acc = acc * alpha[:, None] + tl.dot(pr, v.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(pr.to(v.dtype), v)
        m_i = m_new
        if pos0 + BLOCK_N >= ctx:  # the item's last trip
            tl.store(out_ptr + b * stride_ot + head[:, None] * stride_oh + d[None, :],
                     (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])  # fmt: skip


def dealt_attention(q, kc, vc, meta, programs: int, warps: int):
    """decode_inputs' step through _decode_dealt on `programs` programs."""
    plan = meta.cache["triton"]
    (_, H, D), kvh = q.shape, kc.shape[2]
    items = max(2, triton.next_power_of_2(-(-plan["num_tiles"] * kvh // programs)))

    def run():
        out = torch.empty_like(q)
        _decode_dealt[(programs,)](
            q, kc, vc, out, meta.block_tables, meta.seq_lens, plan["tile_seq"], plan["num_tiles"], D**-0.5 * 1.4426950408889634,
            q.stride(0), q.stride(1), kc.stride(0), kc.stride(1), kc.stride(2), vc.stride(0), vc.stride(1), vc.stride(2),
            out.stride(0), out.stride(1), meta.block_tables.stride(0),
            KVH=kvh, G=H // kvh, M=16, HEAD_DIM=D, HEAD_PAD=triton.next_power_of_2(D), BLOCK_N=128, BLOCK_SIZE=kc.shape[1],
            MAX_ITEMS=items, DOT_F32=triton_interpreting(), num_stages=2, num_warps=warps, **triton_launch_options(DEV),
        )  # fmt: skip
        return out

    return run


@torch.inference_mode()
def attention_dealt() -> None:
    """An experiment, not in arcserve (session 41): decode attention whose (sequence, KV head) items
    are dealt to 2-4 programs per compute unit (_decode_dealt), against the tile kernel as shipped, at
    32-256 sequences of 200-2,048 tokens (Qwen3-0.6B heads); us per layer, % of the plain read rate."""
    rd = read_ceiling()
    h, kvh, d = 16, 8, 128
    units = compute_units(DEV)
    rng = np.random.default_rng(0)
    lines = []
    for batch in (32, 64, 96, 128, 192, 256):
        lens = rng.integers(200, 2049, batch)
        inputs = decode_inputs(lens, h, kvh, d)
        fn = shipped_attention(*inputs)
        pct = functools.partial(read_pct, lens, kvh, d, read_rate=rd)
        ref = fn().float()
        row = [("tiles", graph_time([fn]))]
        for per_unit, warps in itertools.product((2, 3, 4), (4, 8)):
            run = dealt_attention(*inputs, per_unit * units, warps)
            assert float((run().float() - ref).norm() / ref.norm()) < 2e-2, (batch, per_unit, warps)
            row.append((f"dealt {per_unit}/unit w{warps}", graph_time([run])))
        lines.append(f"batch {batch:3d}: " + ", ".join(f"{k} {us:.1f} ({pct(us):.1f}%)" for k, us in row))
        print(lines[-1], flush=True)
    print("\n".join(lines))


def prefill_steps(rng) -> dict:
    """name -> (new tokens, contexts) of the prompt-chunk steps prefill_sweep times."""
    lens = []
    while sum(lens) < 8192:
        lens.append(int(rng.integers(100, 1025)))
    lens[-1] -= sum(lens) - 8192
    chunks = np.full(16, 512)
    return {
        "fresh prompts of 100-1,024 tokens (8,192)": (np.array(lens), np.array(lens)),
        "512-token chunks over cached prefixes of 0-3,072 (8,192)": (chunks, chunks + rng.integers(0, 3073, 16)),
        "one 4,096-token prompt": (np.array([4096]), np.array([4096])),
    }


@torch.inference_mode()
def prefill_sweep() -> None:
    """The prompt-chunk tiles of a throughput run's mixed step (Qwen3-0.6B heads) and a long prompt:
    tile rows (tokens x heads), KV positions a trip, warps, stages, and the causal mask on every trip
    or only where a trip needs it (diag_only); FLOPs of the causal products over the measured matmul
    rate as the floor. Then a mixed step (the fresh prompts beside 200 decodes of 200-2,048 tokens) in
    one launch, as shipped, against its prompt tiles and decodes apart, the decodes on the decode plan."""
    bw, flops = measure_ceilings()
    h, d = 16, 128  # Qwen3-0.6B: 16 query heads of 128 over 8 KV heads (attention_step's defaults)
    rng = np.random.default_rng(0)
    steps = prefill_steps(rng)
    for label, (new, ctx) in steps.items():
        q, kc, vc, meta = attention_step(new, ctx)
        plan, qsl = meta.cache["triton"], meta.host["query_start_loc"]
        causal = sum(int(n) * (int(c) - int(n)) + int(n) * (int(n) + 1) / 2 for n, c in zip(new, ctx))
        floor = 2 * 2 * causal * h * d / flops * 1e6
        fn = shipped_attention(q, kc, vc, meta)
        ref = fn().float()
        shipped = (plan["block_q"], plan["block_n"])
        print(f"{label}: {len(new)} sequences, floor {floor:.1f} us, shipped BLOCK_Q {shipped[0]} "
              f"BLOCK_N {shipped[1]} splits {plan['splits']}", flush=True)  # fmt: skip
        results = []
        for rows, block_n, warps, stages, diag in itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3),
                                                                   (True, False)):  # fmt: skip
            block_q = rows // plan["g_pad"]
            seq, q0 = triton_attention.plan_tiles(qsl, block_q, ctx)
            tiles = torch.from_numpy(np.stack([seq, q0])).to(DEV)
            plan.update(block_q=block_q, block_n=block_n, tile_seq=tiles[0], tile_q=tiles[1], num_tiles=len(seq),
                        launch={"num_warps": warps, "num_stages": stages}, diag_only=diag)  # fmt: skip
            try:
                err = ((fn().float() - ref).norm() / ref.norm()).item()
                us = graph_time([fn])
            except triton.runtime.errors.OutOfResources:
                continue
            assert err < 1e-2, (rows, block_n, warps, stages, diag, err)
            results.append((us, rows, block_n, warps, stages, diag))
        as_shipped = [r for r in results if (r[1] // plan["g_pad"], r[2]) == shipped and r[3:5] == (4, 3)]
        for us, rows, block_n, warps, stages, diag in sorted(results)[:8] + as_shipped:
            print(f"  rows {rows:4d} BLOCK_N {block_n:4d} warps {warps} stages {stages} diag_only {diag!s:5}: "
                  f"{us:8.1f} us  {100 * floor / us:5.1f}% of floor", flush=True)  # fmt: skip

    new, ctx = next(iter(steps.values()))  # the fresh prompts
    dec = rng.integers(200, 2049, 200)
    parts = {"one launch (shipped)": (np.concatenate([new, np.ones(200, np.int64)]), np.concatenate([ctx, dec])),
             "prompt tiles alone": (new, ctx), "decodes alone (decode plan)": (np.ones(200, np.int64), dec)}
    for label, (n, c) in parts.items():
        q, kc, vc, meta = attention_step(n, c)
        fn, plan = shipped_attention(q, kc, vc, meta), meta.cache["triton"]
        print(f"mixed step, {label}: {min(graph_time([fn]) for _ in range(3)):.1f} us "
              f"(BLOCK_Q {plan['block_q']} BLOCK_N {plan['block_n']})", flush=True)  # fmt: skip


@torch.inference_mode()
def attention_diag() -> None:
    """Decode attention (Qwen3-0.6B heads, 200-2,048 tokens) with the causal and range masks on every
    loop trip or only on the last (tile_plan's diag_only): us per layer, best of three."""
    rng = np.random.default_rng(0)
    for batch in (1, 8, 32, 64, 96, 128, 192, 256):
        rows = plan_variants(rng.integers(200, 2049, batch), "diag_only", (True, False))
        print(f"batch {batch:3d}: " + ", ".join(f"diag_only {v}{'*' if shipped else ''} {us:7.1f}"
                                                for v, us, shipped in rows), flush=True)  # fmt: skip


# Qwen3-0.6B's decoder matrices: (outputs, inputs)
QWEN3_06B_MATRICES = {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072)}


@triton.jit
def _batch_mm(x_ptr, w_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym, BM: tl.constexpr, BN: tl.constexpr,
              BK: tl.constexpr, PREFETCH: tl.constexpr, PDL: tl.constexpr = False):  # fmt: skip
    """y = x @ w.T, one BM x BN tile a program; PREFETCH loads the first weight tile before waiting
    for the kernel before (programmatic dependent launch)."""
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    rm = tl.program_id(1) * BM + tl.arange(0, BM)
    rk = tl.arange(0, BK)
    n_ok, m_ok = rn < N, rm < M
    w_ptrs = w_ptr + rn[:, None] * stride_wn + rk[None, :]
    x_ptrs = x_ptr + rm[:, None] * stride_xm + rk[None, :]
    acc = tl.zeros([BM, BN], tl.float32)
    start = 0
    if PREFETCH:
        w = tl.load(w_ptrs, mask=n_ok[:, None], other=0.0)
        wait_prior_kernel(PDL)
        acc = tl.dot(tl.load(x_ptrs, mask=m_ok[:, None], other=0.0), tl.trans(w), acc)
        start = BK
    else:
        wait_prior_kernel(PDL)
    for k in range(start, K, BK):
        w = tl.load(w_ptrs + k, mask=n_ok[:, None], other=0.0)
        acc = tl.dot(tl.load(x_ptrs + k, mask=m_ok[:, None], other=0.0), tl.trans(w), acc)
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@torch.inference_mode()
def batch_gemm(wide: bool = False) -> None:
    """Qwen3-0.6B's decoder matrices at decode batches of 8-256 rows: cuBLAS (what arcserve runs)
    against a plain Triton GEMM over a grid of tiles (best per matrix, and the best single setting
    per batch size), to see whether the ~6-9 us each product takes at these sizes is the library's.
    wide (`batch-gemm-wide`): 64-256 rows only, row tiles of 64-256 and 4 or 8 warps (one row tile
    reads each weight once), the first weight tile loaded before the wait."""
    grid = list(itertools.product((16, 32, 64), (32, 64, 128), (64, 128), (0, 1), (3, 4), (4,)))
    if wide:
        grid = list(itertools.product((64, 128, 256), (32, 64, 128), (64, 128), (1,), (3, 4), (4, 8)))
    for m in (64, 128, 256) if wide else (8, 32, 64, 128, 256):
        per_setting: dict = {}
        lib_total = 0.0
        for name, (n, k) in QWEN3_06B_MATRICES.items():
            ws = copies(lambda n=n, k=k: torch.randn(n, k, device=DEV, dtype=BF16) * 0.02, 2 * n * k)
            x = torch.randn(m, k, device=DEV, dtype=BF16)
            lib = graph_time([lambda w=w: torch.nn.functional.linear(x, w) for w in ws])
            lib_total += lib
            ref = torch.nn.functional.linear(x, ws[0]).float()
            best = (float("inf"), None)
            for bm, bn, bk, pre, stages, warps in grid:
                if bm > max(16, triton.next_power_of_2(m)):
                    continue

                def run(w, bm=bm, bn=bn, bk=bk, pre=pre, stages=stages, warps=warps):
                    y = torch.empty(m, n, dtype=BF16, device=DEV)
                    _batch_mm[(triton.cdiv(n, bn), triton.cdiv(m, bm))](
                        x, w, y, m, n, k, x.stride(0), w.stride(0), y.stride(0), BM=bm, BN=bn, BK=bk,
                        PREFETCH=pre, num_warps=warps, num_stages=stages, **triton_launch_options(DEV))  # fmt: skip
                    return y

                try:
                    err = ((run(ws[0]).float() - ref).norm() / ref.norm()).item()
                except triton.runtime.errors.OutOfResources:  # tiles x stages past shared memory
                    continue
                assert err < 1e-2, (name, m, bm, bn, bk, err)
                us = graph_time([lambda w=w: run(w) for w in ws])
                key = (bm, bn, bk, pre, stages, warps)
                per_setting[key] = per_setting.get(key, 0.0) + us
                best = min(best, (us, key))
            print(f"rows {m:3d} {name:8s} cuBLAS {lib:6.2f} us   Triton best {best[0]:6.2f} us (BM, BN, BK, prefetch, stages, warps = {best[1]})")
        setting, total = min(per_setting.items(), key=lambda kv: kv[1])
        print(f"rows {m:3d} one layer's four products: cuBLAS {lib_total:.2f} us, Triton's best single setting {setting} {total:.2f} us")


def blas_libs() -> None:
    """Qwen3-0.6B's four decoder products at 8-256 rows (decode steps) and 8,192 (a mixed step) under
    each matrix-product library torch can prefer here, with the weights as the engine keeps them
    ([out, in], F.linear) and stored transposed ([in, out], x @ w): us per product, per layer."""
    from arcserve.platform import blas_libraries, prefer_blas_library

    libs = blas_libraries(DEV)
    if not libs:
        sys.exit(f"torch offers no choice of matrix-product library on {DEV}")
    mats = {name: copies(lambda n=n, k=k: torch.randn(n, k, device=DEV, dtype=BF16) * 0.02, 2 * n * k)
            for name, (n, k) in QWEN3_06B_MATRICES.items()}  # fmt: skip
    mats_t = {name: [w.t().contiguous() for w in ws] for name, ws in mats.items()}
    initial = prefer_blas_library(DEV, libs[0])  # (what the engine's products run with)
    print(f"torch's own preference here (the engine's): {initial}")
    print(f"{'rows':>5s} {'library':9s} {'layout':6s} " + " ".join(f"{n:>8s}" for n in mats) + "   layer us")
    for m in (8, 32, 64, 128, 192, 256, 8192):
        xs = {name: torch.randn(m, k, device=DEV, dtype=BF16) for name, (_, k) in QWEN3_06B_MATRICES.items()}
        refs = {name: (xs[name].double() @ mats[name][0].double().t()) for name in mats}
        for lib in libs:
            prefer_blas_library(DEV, lib)
            for layout in ("[o,i]", "[i,o]"):
                row = []
                for name in mats:
                    x = xs[name]
                    if layout == "[o,i]":
                        fns = [lambda w=w, x=x: torch.nn.functional.linear(x, w) for w in mats[name]]
                    else:
                        fns = [lambda w=w, x=x: x @ w for w in mats_t[name]]
                    err = ((fns[0]().double() - refs[name]).norm() / refs[name].norm()).item()
                    assert err < 1e-2, (m, lib, layout, name, err)
                    row.append(graph_time(fns))
                print(f"{m:5d} {lib:9s} {layout:6s} " + " ".join(f"{us:8.2f}" for us in row) + f"   {sum(row):8.2f}")
    prefer_blas_library(DEV, initial)


@triton.jit
def _mm_splitk(x_ptr, w_ptr, y_ptr, part_ptr, count_ptr, M, N, K_PER, stride_xm, stride_wn, stride_ym,
               BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPLIT: tl.constexpr, STAGES: tl.constexpr,
               PDL: tl.constexpr = False):  # fmt: skip
    """y = x @ w.T; program (n, m, s) sums the s-th K_PER slice of K into its tile. With SPLIT > 1 it
    writes that partial in float32, and the last of a tile's SPLIT programs to count itself in (its
    acquire sees the others' partials) adds them up in a fixed order: the result does not depend on
    which program finished first."""
    pid_n, pid_m, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rn = pid_n * BN + tl.arange(0, BN)
    rm = pid_m * BM + tl.arange(0, BM)
    rk = tl.arange(0, BK)
    n_ok, m_ok = rn < N, rm < M
    k0 = s * K_PER
    w_ptrs = w_ptr + rn[:, None] * stride_wn + (k0 + rk)[None, :]
    x_ptrs = x_ptr + rm[:, None] * stride_xm + (k0 + rk)[None, :]
    w = tl.load(w_ptrs, mask=n_ok[:, None], other=0.0)
    wait_prior_kernel(PDL)
    acc = tl.dot(tl.load(x_ptrs, mask=m_ok[:, None], other=0.0), tl.trans(w))
    for k in tl.range(BK, K_PER, BK, num_stages=STAGES):
        w = tl.load(w_ptrs + k, mask=n_ok[:, None], other=0.0)
        acc = tl.dot(tl.load(x_ptrs + k, mask=m_ok[:, None], other=0.0), tl.trans(w), acc)
    mask = m_ok[:, None] & n_ok[None, :]
    out = rm[:, None] * stride_ym + rn[None, :]
    if SPLIT == 1:
        tl.store(y_ptr + out, acc.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        plane = M * stride_ym
        tl.store(part_ptr + s * plane + out, acc, mask=mask)
        tl.debug_barrier()
        counter = count_ptr + pid_m * tl.num_programs(0) + pid_n
        if tl.atomic_add(counter, 1, sem="acq_rel") == SPLIT - 1:
            tot = tl.zeros([BM, BN], tl.float32)
            for j in tl.static_range(SPLIT):
                tot += tl.load(part_ptr + j * plane + out, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(y_ptr + out, tot.to(y_ptr.dtype.element_ty), mask=mask)
            tl.atomic_xchg(counter, 0)

def splitk_mm(x, w, parts: dict, bm: int, bn: int, bk: int, split: int, warps: int, stages: int):
    M, K = x.shape
    N = w.shape[0]
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if split > 1 and (M, N, split) not in parts:
        parts[M, N, split] = torch.empty(split * M * N, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(N, bn), triton.cdiv(M, bm), split)
    counts = triton_ops.zeroed_counters(grid[0] * grid[1], x.device) if split > 1 else y
    _mm_splitk[grid](x, w, y, parts.get((M, N, split), y), counts, M, N, K // split, x.stride(0), w.stride(0),
                     y.stride(0), BM=bm, BN=bn, BK=bk, SPLIT=split, STAGES=stages, num_warps=warps,
                     **triton_launch_options(DEV))  # fmt: skip
    return y


@torch.inference_mode()
def batch_gemm_splitk() -> None:
    """Qwen3-0.6B's decoder matrices at 64-256 rows: cuBLAS against a Triton GEMM that splits K over
    1-8 programs per output tile (more programs for the narrow o and down products, whose tiles
    alone leave most compute units idle), over a grid of tiles; every candidate is checked against
    a float64 product and for equal bits on a second run (the merge order is fixed)."""
    narrow = list(itertools.product((64, 128), (32, 64, 128), (64, 128), (1, 2, 4, 8), (4, 8), (3,)))
    wide = list(itertools.product((64, 128), (64, 128), (64,), (1, 2, 4), (4, 8), (3,)))
    parts: dict = {}
    summary = []
    for m in (64, 128, 192, 256):
        lib_total = best_total = 0.0
        for name, (n, k) in QWEN3_06B_MATRICES.items():
            ws = copies(lambda n=n, k=k: torch.randn(n, k, device=DEV, dtype=BF16) * 0.02, 2 * n * k)
            x = torch.randn(m, k, device=DEV, dtype=BF16)
            lib = graph_time([lambda w=w: torch.nn.functional.linear(x, w) for w in ws])
            ref = x.double() @ ws[0].double().T
            best = (float("inf"), None)
            for c in narrow if n <= 2048 else wide:
                bm, bn, bk, split = c[:4]
                if (k // split) % bk or bm > max(64, triton.next_power_of_2(m)):
                    continue
                try:
                    y1, y2 = (splitk_mm(x, ws[0], parts, *c) for _ in range(2))
                except triton.runtime.errors.OutOfResources:
                    continue
                err = ((y1.double() - ref).norm() / ref.norm()).item()
                assert err < 1e-2 and torch.equal(y1, y2), (name, m, c, err)
                best = min(best, (graph_time([lambda w=w, c=c: splitk_mm(x, w, parts, *c) for w in ws]), c))
            print(f"rows {m:3d} {name:8s} cuBLAS {lib:6.2f} us  split-K best {best[0]:6.2f} us "
                  f"(BM, BN, BK, split, warps, stages = {best[1]})", flush=True)  # fmt: skip
            lib_total += lib
            best_total += min(lib, best[0])
        summary.append(f"rows {m:3d}: one layer's four products cuBLAS {lib_total:.2f} us, best of either {best_total:.2f} us")
    print("\n".join(summary))


# One-row matrices of both models: (outputs, inputs); LM heads are the tied / untied vocabularies.
ONE_ROW_SHAPES = {"0.6b qkv": (4096, 1024), "0.6b o": (1024, 2048), "0.6b gate_up": (6144, 1024),
                  "0.6b down": (1024, 3072), "0.6b lm_head": (151936, 1024), "8b qkv": (6144, 4096),
                  "8b o": (4096, 4096), "8b gate_up": (28672, 4096), "8b down": (4096, 14336),
                  "8b lm_head": (128256, 4096)}  # fmt: skip


def one_row_inputs(n: int, k: int, bw: float):
    """Rotated weight copies, an input row twice as wide (the SiLU-mul prologue reads gate | up), a
    residual, norm weights, and the matrix's floor in us."""
    ws = copies(lambda: torch.randn(n, k, device=DEV, dtype=BF16) * 0.02, 2 * n * k)
    x = torch.randn(1, 2 * k, device=DEV, dtype=BF16)
    r = torch.randn(1, k, device=DEV, dtype=BF16)
    return ws, x, r, torch.ones(k, device=DEV, dtype=BF16), 2 * n * k / bw * 1e6


@torch.inference_mode()
def linear_sweep() -> None:
    """One-row linears of both models: the library GEMM, the matrix-vector kernel, and the fused
    prologues against the op + library pair they replace."""
    bw = measure_ceilings()[0]
    print(f"{'linear, 1 row':44s} {'us':>8s} {'% floor':>8s}")
    for name, (n, k) in ONE_ROW_SHAPES.items():
        ws, x, r, nw, floor = one_row_inputs(n, k, bw)
        runs = {"gemv": lambda w: triton_linear.gemv(x[:, :k], w),
                "library": lambda w: reference.linear(x[:, :k], w),
                "norm + library": lambda w: reference.linear(triton_ops.fused_add_rms_norm(x[:, :k], r, nw, 1e-6)[0], w),
                "silu_mul + library": lambda w: reference.linear(triton_ops.silu_and_mul(x), w),
                "fused norm gemv": lambda w: triton_linear._launch(x[:, :k], w, None, triton_linear._ADD_RMS_NORM, k, r, nw, torch.empty_like(r), 1e-6),
                "fused silu_mul gemv": lambda w: triton_linear._launch(x, w, None, triton_linear._SILU_MUL, k)}  # fmt: skip
        for label, fn in runs.items():
            t = graph_time([lambda w=w: fn(w) for w in ws])
            print(f"{name + ' ' + label:44s} {t:8.2f} {100 * floor / t:7.0f}%")


# Program shapes (BLOCK_N, BLOCK_K, warps) of the matrix-vector kernel: a grid on Llama-8B's decoder
# matrices (no prologue), and a few candidates on every matrix with its prologue.
GEMV_GRID = [(bn, max(16, tile // bn), warps) for bn in (4, 8, 16, 32) for tile in (4096, 8192, 16384)
             for warps in (4, 8, 16)]  # fmt: skip
GEMV_CANDIDATES = [(4, 1024, 4), (4, 1024, 8), (8, 1024, 4), (4, 4096, 4), (8, 512, 4)]


@contextlib.contextmanager
def gemv_setting(block_n: int, block_k: int, warps: int):
    """The matrix-vector kernel launched with this program shape (BLOCK_K capped at the row)."""
    shipped = triton_linear._tiles, triton_linear._WARPS
    triton_linear._tiles = lambda M, K, interpreted=False: (1, block_n, min(block_k, triton.next_power_of_2(K)))
    triton_linear._WARPS = warps
    try:
        yield
    finally:
        triton_linear._tiles, triton_linear._WARPS = shipped


@torch.inference_mode()
def gemv_sweep(grid: bool) -> None:
    """The shipped program shape, then each setting (GEMV_GRID or GEMV_CANDIDATES); the candidates
    run with the prologue each matrix takes in the model (norm before qkv and gate_up, SiLU-mul
    before down) and beside the library."""
    bw = measure_ceilings()[0]
    prologue = {} if grid else {"qkv": triton_linear._ADD_RMS_NORM, "gate_up": triton_linear._ADD_RMS_NORM,
                                "down": triton_linear._SILU_MUL}  # fmt: skip
    shapes = {k: v for k, v in ONE_ROW_SHAPES.items() if not grid or (k.startswith("8b") and "lm_head" not in k)}
    print(f"{'matrix':14s} {'setting':>16s} {'us':>8s} {'% floor':>8s}")
    for name, (n, k) in shapes.items():
        ws, x, r, nw, floor = one_row_inputs(n, k, bw)
        pro = prologue.get(name.split()[1], triton_linear._PLAIN)
        if pro == triton_linear._ADD_RMS_NORM:
            fns = [lambda w=w: triton_linear._launch(x[:, :k], w, None, pro, k, r, nw, torch.empty_like(r), 1e-6) for w in ws]
        else:
            fns = [lambda w=w: triton_linear._launch(x if pro else x[:, :k], w, None, pro, k) for w in ws]
        if not grid:
            t = graph_time([lambda w=w: reference.linear(x[:, :k], w) for w in ws])
            print(f"{name:14s} {'library':>16s} {t:8.2f} {100 * floor / t:7.0f}%")
        t = graph_time(fns)
        print(f"{name:14s} {'shipped':>16s} {t:8.2f} {100 * floor / t:7.0f}%")
        for bn, bk, warps in GEMV_GRID if grid else GEMV_CANDIDATES:
            label = f"{bn}x{bk} w{warps}"
            try:
                with gemv_setting(bn, bk, warps):
                    t = graph_time(fns)
            except Exception as e:  # noqa: BLE001 (a setting the compiler refuses)
                print(f"{name:14s} {label:>16s} failed: {type(e).__name__}")
                continue
            print(f"{name:14s} {label:>16s} {t:8.2f} {100 * floor / t:7.0f}%")


def main() -> None:
    if sys.argv[1:] in (["gemv-grid"], ["gemv-candidates"]):
        return gemv_sweep(grid=sys.argv[1] == "gemv-grid")
    if sys.argv[2:] not in ([], ["fp8"]):
        sys.exit(f"unknown option {' '.join(sys.argv[2:])!r}: the attention benchmarks take fp8 (an 8-bit cache) or nothing")
    cache = torch.float8_e4m3fn if sys.argv[2:] == ["fp8"] else BF16
    if sys.argv[1:2] == ["attention-sweep"]:
        return attention_sweep(cache)
    if sys.argv[1:2] == ["attention-varied"]:
        return attention_varied(cache)
    if sys.argv[1:] == ["attention-layout"]:
        return attention_layout()
    if sys.argv[1:] == ["attention-mid"]:
        return attention_mid()
    if sys.argv[1:] == ["attention-dealt"]:
        return attention_dealt()
    if sys.argv[1:] == ["attention-order"]:
        return attention_order()
    if sys.argv[1:] == ["attention-splits"]:
        return attention_splits()
    if sys.argv[1:] == ["blas-libs"]:
        return blas_libs()
    if sys.argv[1:] == ["batch-gemm-splitk"]:
        return batch_gemm_splitk()
    if sys.argv[1:] in (["batch-gemm"], ["batch-gemm-wide"]):
        return batch_gemm(wide=sys.argv[1] == "batch-gemm-wide")
    if sys.argv[1:] == ["prefill-sweep"]:
        return prefill_sweep()
    if sys.argv[1:] == ["attention-diag"]:
        return attention_diag()
    if sys.argv[1:] == ["linear-sweep"]:
        return linear_sweep()
    bw, flops = measure_ceilings()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s (read + write), bf16 matmul {flops / 1e12:.0f} TFLOP/s")
    rows = []

    def add(name: str, us: float, nbytes: float, nflops: float = 0.0) -> None:
        floor = max(nbytes / bw, nflops / flops) * 1e6
        rows.append((name, us, floor))

    # Linear layers: library GEMM against the matrix-vector kernel, 1, 2 and 64 rows.
    shapes = {"0.6b qkv": (4096, 1024), "0.6b o": (1024, 2048), "0.6b gate_up": (6144, 1024),
              "0.6b down": (1024, 3072), "0.6b lm_head": (151936, 1024), "8b qkv": (6144, 4096),
              "8b o": (4096, 4096), "8b gate_up": (28672, 4096), "8b down": (4096, 14336)}  # fmt: skip
    for name, (n, k) in shapes.items():
        ws = copies(lambda n=n, k=k: torch.randn(n, k, device=DEV, dtype=BF16) * 0.02, 2 * n * k)
        for m in (1, 2, 64):
            x = torch.randn(m, k, device=DEV, dtype=BF16)
            nbytes = 2 * (n * k + m * k + m * n)
            add(f"linear {name} M={m} library", graph_time([lambda w=w, x=x: reference.linear(x, w) for w in ws]), nbytes, 2 * m * n * k)
            if m <= 2:
                add(f"linear {name} M={m} triton gemv", graph_time([lambda w=w, x=x: triton_linear.gemv(x, w) for w in ws]), nbytes, 2 * m * n * k)

    # One row, the op before the product fused into the matrix-vector kernel, against the two launches.
    xr = torch.randn(2, 1024, device=DEV, dtype=BF16)
    nw = torch.ones(1024, device=DEV, dtype=BF16)
    for name, (n, k) in (("0.6b qkv", (4096, 1024)), ("0.6b gate_up", (6144, 1024))):
        ws = copies(lambda n=n, k=k: torch.randn(n, k, device=DEV, dtype=BF16) * 0.02, 2 * n * k)
        nbytes = 2 * (n * k + 3 * k + n)
        add(f"add+rms_norm then linear {name}, 1 row: two launches",
            graph_time([lambda w=w: triton_linear.linear(triton_ops.fused_add_rms_norm(xr[:1], xr[1:], nw, 1e-6)[0], w) for w in ws]), nbytes)
        add(f"add+rms_norm then linear {name}, 1 row: fused",
            graph_time([lambda w=w: triton_linear.add_rms_norm_linear(xr[:1], xr[1:], nw, 1e-6, w) for w in ws]), nbytes)
    gu = torch.randn(1, 6144, device=DEV, dtype=BF16)
    ws = copies(lambda: torch.randn(1024, 3072, device=DEV, dtype=BF16) * 0.02, 2 * 1024 * 3072)
    nbytes = 2 * (1024 * 3072 + 6144 + 1024)
    add("silu_mul then linear 0.6b down, 1 row: two launches", graph_time([lambda w=w: triton_linear.linear(triton_ops.silu_and_mul(gu), w) for w in ws]), nbytes)
    add("silu_mul then linear 0.6b down, 1 row: fused", graph_time([lambda w=w: triton_linear.silu_mul_linear(gu, w) for w in ws]), nbytes)

    # Elementwise kernels at one decode token and at a 2,048-token prefill.
    for T in (1, 256, 2048):
        xs = copies(lambda T=T: (torch.randn(T, 1024, device=DEV, dtype=BF16), torch.randn(T, 1024, device=DEV, dtype=BF16)), 4 * T * 1024)
        w = torch.ones(1024, device=DEV, dtype=BF16)
        add(f"fused_add_rms_norm T={T} x 1024", graph_time([lambda p=p: triton_ops.fused_add_rms_norm(p[0], p[1], w, 1e-6) for p in xs]), 2 * 4 * T * 1024)
        gs = copies(lambda T=T: torch.randn(T, 6144, device=DEV, dtype=BF16), 2 * T * 6144)
        add(f"silu_and_mul T={T} x 3072", graph_time([lambda g=g: triton_ops.silu_and_mul(g) for g in gs]), 2 * T * (6144 + 3072))

    # qkv_prepare (Qwen3: q/k norm + RoPE + K/V store), 16 q heads, 8 kv heads, head_dim 128.
    cos_sin = torch.randn(4096, 128, device=DEV)
    for T in (1, 2048):
        qkv = torch.randn(T, 32, 128, device=DEV, dtype=BF16)
        kc = torch.zeros(T // 16 + 1, 16, 8, 128, device=DEV, dtype=BF16)
        vc = torch.zeros_like(kc)
        pos = torch.arange(T, device=DEV)
        rope = triton_ops.rope_cos_sin(cos_sin, pos, BF16)
        slots = torch.arange(T, device=DEV)
        nw = torch.ones(128, device=DEV, dtype=BF16)
        add(f"qkv_prepare T={T} (16q/8kv x 128)", graph_time([lambda: triton_ops.qkv_prepare(qkv, 16, nw, nw, 1e-6, rope, kc, vc, slots)]), 2 * T * (32 * 128 + 24 * 128))

    # Paged attention: decode (bytes: the KV read) and prefill (FLOPs: causal QK^T and PV).
    for h, kvh, d, label in ((16, 8, 128, "0.6b"), (32, 8, 128, "8b")):
        for batch, ctx in ((1, 256), (1, 512), (1, 8192), (64, 1024), (256, 1024)):
            plan, fn = decode_attention(batch, ctx, h, kvh, d)
            chosen = plan["splits"]
            for splits in sorted({chosen, 1, 4, 16}) if batch == 1 else [chosen]:
                plan["splits"] = splits
                add(f"attention decode {label} batch {batch} ctx {ctx} splits {splits}{'*' if splits == chosen else ''}",
                    graph_time([fn]), 2 * 2 * batch * ctx * kvh * d)  # fmt: skip
        T = 2048
        meta, nblocks = prefill_meta(T)
        kc = torch.randn(nblocks, 16, kvh, d, device=DEV, dtype=BF16)
        vc = torch.randn_like(kc)
        q = torch.randn(T, h, d, device=DEV, dtype=BF16)
        triton_attention.prepare(meta, h, kvh, DEV)
        fn = lambda: triton_attention.paged_attention(q, None, None, kc, vc, meta, d**-0.5, None, 0)  # noqa: E731
        add(f"attention prefill {label} T={T}", graph_time([fn]), 2 * T * (2 * h + 2 * kvh) * d, 2 * 2 * T * T * h * d / 2)

    print(f"{'kernel':50s} {'us':>9s} {'floor us':>9s} {'% floor':>8s}")
    for name, us, floor in rows:
        print(f"{name:50s} {us:9.2f} {floor:9.2f} {100 * floor / us:7.0f}%")


if __name__ == "__main__":
    main()
