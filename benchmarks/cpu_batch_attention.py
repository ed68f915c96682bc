"""Batched decode attention on the CPU over a decode mirror in the model's dtype (CPUs with native
half products keep a bf16 mirror), SmolLM2-135M's heads (9 query heads, 3 KV heads of 64): SDPA in
its GQA form (as shipped), SDPA in the rows form, and plain matrix products with a float32 softmax,
30 layers in turn (each its own buffers, as in a decode step), rows of random lengths.

    python benchmarks/cpu_batch_attention.py [--rows 64] [--lengths 200 400]

Prints ms per 30 layers for each formulation and its largest error against a float64 reference.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--lengths", type=int, nargs="+", default=[200, 400])
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--reps", type=int, default=10)
    a = p.parse_args()
    dt = getattr(torch, a.dtype)
    gen = torch.Generator().manual_seed(0)
    for L in a.lengths:
        run_length(L, a.rows, dt, a.reps, gen)


def run_length(L: int, n: int, dt: torch.dtype, reps: int, gen: torch.Generator) -> None:
    layers, heads, kvh, d = 30, 9, 3, 64
    g = heads // kvh
    scale = d**-0.5
    cap = L + 128
    K = [torch.randn(n, kvh, cap, d, generator=gen).to(dt) for _ in range(layers)]
    V = [torch.randn(n, kvh, cap, d, generator=gen).to(dt) for _ in range(layers)]
    q = [torch.randn(n, heads, d, generator=gen).to(dt) for _ in range(layers)]
    lens = torch.randint(L - L // 2, L + 1, (n,), generator=gen)
    lens[0] = L
    valid = torch.arange(L)[None, :] < lens[:, None]  # [n, L]
    mask4 = valid[:, None, None, :]
    bias = torch.zeros(n, 1, 1, L).masked_fill(~mask4, float("-inf"))

    def sdpa_gqa(i):
        return F.scaled_dot_product_attention(
            q[i].view(n, heads, 1, d),
            K[i][:, :, :L],
            V[i][:, :, :L],
            attn_mask=mask4,
            scale=scale,
            enable_gqa=True,
        ).view(n, heads, d)

    def sdpa_rows(i):
        return F.scaled_dot_product_attention(
            q[i].view(n, kvh, g, d), K[i][:, :, :L], V[i][:, :, :L], attn_mask=mask4, scale=scale
        ).view(n, heads, d)

    def matmul(i):
        s = torch.matmul(q[i].view(n, kvh, g, d), K[i][:, :, :L].transpose(-1, -2)).float() * scale + bias
        pr = torch.softmax(s, -1).to(dt)
        return torch.matmul(pr, V[i][:, :, :L]).view(n, heads, d)

    def matmul_f32out(
        i,
    ):  # scores accumulated and kept in float32 (baddbmm into a float32 buffer is not allowed)
        s = (
            torch.matmul(q[i].view(n, kvh, g, d).float(), K[i][:, :, :L].transpose(-1, -2).float()) * scale
            + bias
        )
        return torch.matmul(torch.softmax(s, -1), V[i][:, :, :L].float()).to(dt).view(n, heads, d)

    ref = []
    for i in range(2):
        s = torch.matmul(q[i].double().view(n, kvh, g, d), K[i][:, :, :L].double().transpose(-1, -2)) * scale
        s = s.masked_fill(~mask4, float("-inf"))
        ref.append(torch.matmul(torch.softmax(s, -1), V[i][:, :, :L].double()).view(n, heads, d))
    for name, fn in (
        ("sdpa_gqa", sdpa_gqa),
        ("sdpa_rows", sdpa_rows),
        ("matmul", matmul),
        ("matmul_f32", matmul_f32out),
    ):
        err = max((fn(i).double() - ref[i]).abs().max().item() for i in range(2))
        best = float("inf")
        for _ in range(reps):
            t = time.perf_counter()
            for i in range(layers):
                fn(i)
            best = min(best, time.perf_counter() - t)
        print(f"rows {n} len {L}: {name:>11} {best * 1e3:8.2f} ms / 30 layers   max err {err:.4f}")


if __name__ == "__main__":
    main()
