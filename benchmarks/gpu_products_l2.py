"""Are a decode step's matrix products slow because their weights come from device memory? (An
experiment, not in arcserve; session 41, CUDA only: a side stream and a PTX prefetch.)

Qwen3-0.6B's four products per layer (o, gate_up, down, then the next layer's qkv; cuBLAS, as
arcserve runs them) at 64-256 rows, 28 layers in one graph: with each layer's own weights (cold,
880 MB in all) against one layer's weights throughout (hot: 31.5 MB, in L2); then the decode
attention of as many sequences (200-2,048 tokens) before each layer's products, alone, with the
products, and with the products' weights prefetched into L2 on a side stream while attention runs
(Triton loads with evict_last, or PTX prefetch.global.L2::evict_last), and the prefetch run serially
before the products without attention. us per layer.

    PYTHONPATH=. python3 benchmarks/gpu_products_l2.py
"""

import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).parent))
from gpu_kernels import BF16, DEV, QWEN3_06B_MATRICES, graph_time, varied_decode_attention  # noqa: E402

from arcserve.platform import current_stream, new_stream, on_stream  # noqa: E402


@triton.jit
def _prefetch_load(w_ptr, n, out_ptr, BLOCK: tl.constexpr):
    """Reads w[:n] with evict_last (kept in L2 before other lines); stores nothing it need not."""
    pid = tl.program_id(0)
    acc = tl.zeros([BLOCK], tl.float32)
    for start in range(pid * BLOCK, n, tl.num_programs(0) * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        acc += tl.load(w_ptr + offs, mask=offs < n, other=0.0, eviction_policy="evict_last").to(tl.float32)
    s = tl.sum(acc)
    if s == 12345.678:  # (never, but the loads must not be dropped)
        tl.store(out_ptr + pid, s)


@triton.jit
def _prefetch_l2(w_ptr, n, BLOCK: tl.constexpr):
    """One PTX L2 prefetch (evict_last) per 128-byte line of w[:n]; no registers kept."""
    pid = tl.program_id(0)
    for start in range(pid * BLOCK, n, tl.num_programs(0) * BLOCK):
        ptrs = w_ptr + start + tl.arange(0, BLOCK // 64) * 64
        tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1]; mov.u32 $0, 0;", "=r,l", [ptrs],
                                  dtype=tl.int32, is_pure=False, pack=1)  # fmt: skip


LAYERS, HEADS, KV_HEADS, HEAD_DIM = 28, 16, 8, 128
SIZES = {name: QWEN3_06B_MATRICES[name] for name in ("o", "gate_up", "down", "qkv")}  # in run order


@torch.inference_mode()
def main() -> None:
    per_layer = sum(n * k for n, k in SIZES.values())
    bufs = [torch.randn(per_layer, device=DEV, dtype=BF16) * 0.02 for _ in range(LAYERS)]  # a layer's weights, one run
    weights = []
    for buf in bufs:
        w, off = {}, 0
        for name, (n, k) in SIZES.items():
            w[name] = buf[off : off + n * k].view(n, k)
            off += n * k
        weights.append(w)
    sink = torch.zeros(4096, device=DEV)
    side = new_stream(DEV)
    rng = np.random.default_rng(0)
    for rows in (64, 128, 192, 256):
        x = {k: torch.randn(rows, k, device=DEV, dtype=BF16) for k in (1024, 2048, 3072)}

        def products(w):
            for name, (_, k) in SIZES.items():
                F.linear(x[k], w[name])

        _, attn = varied_decode_attention(rng.integers(200, 2049, rows), HEADS, KV_HEADS, HEAD_DIM)
        per = lambda fn: graph_time([fn], 2) / LAYERS  # noqa: E731
        cold = per(lambda: [products(weights[i]) for i in range(LAYERS)])
        hot = per(lambda: [products(weights[0]) for _ in range(LAYERS)])
        alone = per(lambda: [attn() for _ in range(LAYERS)])
        both = per(lambda: [(attn(), products(weights[i])) for i in range(LAYERS)])
        found = {}
        for label, kind, programs in (("loads x132", "load", 132), ("loads x264", "load", 264),
                                      ("PTX x132", "ptx", 132), ("PTX x528", "ptx", 528)):  # fmt: skip

            def fwd(kind=kind, programs=programs):
                main_s = current_stream(DEV)
                for i in range(LAYERS):
                    side.wait_stream(main_s)
                    with on_stream(side):  # this layer's products' weights, while attention runs
                        if kind == "load":
                            _prefetch_load[(programs,)](bufs[i], per_layer, sink, BLOCK=2048, num_warps=4)
                        else:
                            _prefetch_l2[(programs,)](bufs[i], per_layer, BLOCK=8192, num_warps=4)
                    attn()
                    main_s.wait_stream(side)
                    products(weights[i])

            found[label] = per(fwd)

        def serial():
            for i in range(LAYERS):
                _prefetch_l2[(528,)](bufs[i], per_layer, BLOCK=8192, num_warps=4)
                products(weights[i])

        print(f"rows {rows:3d}: products cold {cold:6.2f}, hot {hot:6.2f} | attention {alone:6.2f}, then products "
              f"{both:6.2f}, with the prefetch beside attention: " + ", ".join(f"{k} {v:6.2f}" for k, v in found.items())
              + f" | PTX prefetch then products, no attention {per(serial):6.2f}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
