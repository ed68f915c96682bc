"""CPU micro-benchmarks behind the choices in arcserve/kernels/reference.py (bf16, SmolLM2-135M shapes):
linear (F.linear vs oneDNN-packed weights), KV block gather (advanced indexing vs index_select),
RMSNorm (F.rms_norm vs a vector_norm formulation, which was not kept: no reproducible gain), and a
small op's cost right after a product has streamed a layer's weights through the caches (what the
ops between the products of a decode step pay in the model).

    python benchmarks/cpu_ops.py
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F


def timed(fn, n: int = 20) -> float:
    fn()
    fn()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n * 1e3


def main() -> None:
    torch.manual_seed(0)
    bf = torch.bfloat16
    shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # qkv, o, gate_up, down
    layers = [[(torch.randn(*s) * 0.05).to(bf) for s in shapes] for _ in range(30)]
    packed = [[torch.ops.mkldnn._reorder_linear_weight(w, 64) for w in ws] for ws in layers]
    print("30 layers of weights, one pass (ms):")
    print(f"{'rows':>6} {'F.linear':>10} {'packed':>10}")
    for m in (1, 8, 64, 512):
        xs = {576: torch.randn(m, 576).to(bf), 1536: torch.randn(m, 1536).to(bf)}
        plain = timed(lambda xs=xs: [F.linear(xs[w.shape[1]], w) for ws in layers for w in ws], 5)
        pk = timed(
            lambda xs=xs: [
                torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], p, None, "none", [], "")
                for ws, ps in zip(layers, packed) for w, p in zip(ws, ps)
            ],
            5,
        )  # fmt: skip
        print(f"{m:>6} {plain:>10.2f} {pk:>10.2f}")

    nb, bs, kvh, hd, B = 4000, 16, 3, 64, 64
    cache = torch.randn(nb, bs, kvh, hd).to(bf)
    blocks = torch.stack([torch.randperm(nb)[:32] for _ in range(B)])
    print(f"\nKV gather, {B} sequences x 32 blocks of 16 tokens (ms):")
    print(f"  cache[blocks]                 {timed(lambda: cache[blocks]):.2f}")
    print(f"  cache.index_select(0, blocks) {timed(lambda: cache.index_select(0, blocks.reshape(-1))):.2f}")

    print("\nRMSNorm over 576 features (us):")
    w = torch.randn(576).to(bf)
    for m in (1, 64, 2048):
        x = torch.randn(m, 576).to(bf)

        def vn(x=x):
            xf = x.float()
            ms = torch.linalg.vector_norm(xf, dim=-1, keepdim=True).square_().div_(576)
            return (xf * ms.add_(1e-5).rsqrt_() * w).to(bf)

        a = timed(lambda x=x: F.rms_norm(x, (576,), w, 1e-5), 100) * 1e3
        b = timed(vn, 100) * 1e3
        print(f"  rows {m:>5}: F.rms_norm {a:8.1f}   vector_norm form {b:8.1f}")

    # The gate_up matrix of 60 layers in turn (~210 MB, past the caches), as a decode step streams them.
    gate_up = [torch.ops.mkldnn._reorder_linear_weight((torch.randn(3072, 576) * 0.05).to(bf), 64) for _ in range(60)]
    print("\nresidual add + RMSNorm, alone and right after a 3,072 x 576 product (us):")
    for m in (1, 64):
        x, r = torch.randn(m, 576).to(bf), torch.randn(m, 576).to(bf)
        times = {}
        for after in (False, True):
            total = 0.0
            for p in gate_up * 3:
                if after:
                    torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")
                t = time.perf_counter()
                F.rms_norm(x + r, (576,), w, 1e-5)
                total += time.perf_counter() - t
            times[after] = total / (3 * len(gate_up)) * 1e6
        print(f"  rows {m:>5}: alone {times[False]:8.1f}   after a product {times[True]:8.1f}")


if __name__ == "__main__":
    main()
