"""CPU micro-benchmarks behind the choices in arcserve/kernels/reference.py (bf16, SmolLM2-135M shapes):
linear (F.linear vs oneDNN-packed weights), KV block gather (advanced indexing vs index_select),
RMSNorm (F.rms_norm vs a vector_norm formulation, which was not kept: no reproducible gain), and a
small op's cost right after a product has streamed a layer's weights through the caches (what the
ops between the products of a decode step pay in the model), and oneDNN's fused post-ops for the
ops between products (not kept: slower).

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
    gate_up = [
        torch.ops.mkldnn._reorder_linear_weight((torch.randn(3072, 576) * 0.05).to(bf), 64) for _ in range(60)
    ]
    plain = [(torch.randn(3072, 576) * 0.05).to(bf) for _ in range(60)]
    small = torch.ops.mkldnn._reorder_linear_weight((torch.randn(576, 576) * 0.05).to(bf), 64)
    print("\nresidual add + RMSNorm (us), alone and right after another op; 2 threads, then 1 thread:")
    for m in (1, 64):
        x, r = torch.randn(m, 576).to(bf), torch.randn(m, 576).to(bf)
        before = {
            "nothing": None,
            "a 3,072 x 576 product (3.5 MB of weights)": lambda i, x=x: torch.ops.mkldnn._linear_pointwise(
                x, gate_up[i], None, "none", [], ""),
            "a 576 x 576 product (0.66 MB)": lambda i, x=x: torch.ops.mkldnn._linear_pointwise(
                x, small, None, "none", [], ""),
            "float32 sum() over the same 3.5 MB": lambda i: plain[i].view(torch.float32).sum(),
            "a 50 us busy wait": lambda i: busy_wait(50e-6),
        }  # fmt: skip
        for threads in (2, 1):
            torch.set_num_threads(threads)
            for name, op in before.items():
                total = 0.0
                for i in range(3 * len(gate_up)):
                    if op is not None:
                        op(i % len(gate_up))
                    t = time.perf_counter()
                    F.rms_norm(x + r, (576,), w, 1e-5)
                    total += time.perf_counter() - t
                print(
                    f"  rows {m:>3}, {threads} thread(s), after {name:42s} {total / (3 * len(gate_up)) * 1e6:8.1f}"
                )
        torch.set_num_threads(2)

    post_op_fusion(bf)


def busy_wait(seconds: float) -> None:
    t = time.perf_counter()
    while time.perf_counter() - t < seconds:
        pass


def post_op_fusion(bf) -> None:
    """A decoder's products and the ops between them (attention left out), 30 layers of SmolLM2's
    shapes, as arcserve runs them against oneDNN's fused post-ops: the residual adds as a binary
    "add" post-op of the o and down products, SiLU-mul as a "swish" post-op of the gate product and
    a binary "mul" post-op of the up product (two products instead of gate_up). Not kept: slower."""
    H, INTER, L = 576, 1536, 30
    lin = torch.ops.mkldnn._linear_pointwise
    pack = lambda w: torch.ops.mkldnn._reorder_linear_weight(w, 64)  # noqa: E731

    def rand(n, k):
        return (torch.randn(n, k) * 0.05).to(bf)

    layers = []
    for _ in range(L):
        wg, wu = rand(INTER, H), rand(INTER, H)
        layers.append({"qkv": pack(rand(960, H)), "o": pack(rand(H, H)), "gu": pack(torch.cat([wg, wu])),
                       "g": pack(wg), "u": pack(wu), "d": pack(rand(H, INTER)), "n": torch.randn(H).to(bf)})  # fmt: skip

    def eager(r, attn):
        h = F.rms_norm(r, (H,), layers[0]["n"], 1e-5)
        for w in layers:
            lin(h, w["qkv"], None, "none", [], "")
            r = lin(attn, w["o"], None, "none", [], "") + r
            gu = lin(F.rms_norm(r, (H,), w["n"], 1e-5), w["gu"], None, "none", [], "")
            r = lin(F.silu(gu[:, :INTER]) * gu[:, INTER:], w["d"], None, "none", [], "") + r
            h = F.rms_norm(r, (H,), w["n"], 1e-5)
        return h

    def fused(r, attn):
        h = F.rms_norm(r, (H,), layers[0]["n"], 1e-5)
        for w in layers:
            lin(h, w["qkv"], None, "none", [], "")
            r = lin(attn, r, w["o"], None, "add")
            h = F.rms_norm(r, (H,), w["n"], 1e-5)
            a = lin(h, lin(h, w["g"], None, "swish", [], ""), w["u"], None, "mul")
            r = lin(a, r, w["d"], None, "add")
            h = F.rms_norm(r, (H,), w["n"], 1e-5)
        return h

    print("\n30 decoder layers without attention (ms): eager ops against oneDNN post-ops")
    for m in (1, 64):
        r, attn = torch.randn(m, H).to(bf), torch.randn(m, H).to(bf)
        times = {"eager": [], "post-ops": []}
        for _ in range(5):
            times["eager"].append(timed(lambda r=r, attn=attn: eager(r, attn), 5))
            times["post-ops"].append(timed(lambda r=r, attn=attn: fused(r, attn), 5))
        e, f = (sorted(v)[2] for v in times.values())
        print(f"  rows {m:>3}: eager {e:7.2f}   post-ops {f:7.2f}")


if __name__ == "__main__":
    main()
