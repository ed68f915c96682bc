"""Decode attention of many float32 mirror rows on the CPU: SDPA's rows form with the mirror's
additive mask (what the mirror ran before) against cpu_rows_attention's compiled kernel, 30
layers in turn (each its own buffers, views of an arena as the mirror's), rows of random lengths
between --min-frac of the longest and the longest. Default heads: SmolLM2-135M's (9 query heads,
3 KV heads of 64).

    python benchmarks/cpu_rows_attention.py [--rows 64] [--lengths 200 400] [--heads 9 --kv-heads 3 --head-dim 64]

Prints ms per 30 layers for each, the MB a layer reads padded and needed, and the kernel's
largest difference from SDPA (both rounded to bf16). The kernel compiles on the first call
(inductor's disk cache keeps it); each timing is the mean of --reps passes after two more.
"""

from __future__ import annotations

import argparse
import functools

import cpu_ops
import torch
import torch.nn.functional as F

from arcserve.kernels import cpu_rows_attention, reference

LAYERS = 30


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--lengths", type=int, nargs="+", default=[200, 400])
    p.add_argument("--min-frac", type=float, default=0.5)
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--reps", type=int, default=5)
    a = p.parse_args()
    gen = torch.Generator().manual_seed(0)
    for L in a.lengths:
        run_length(a, L, gen)


def run_length(a: argparse.Namespace, L: int, gen: torch.Generator) -> None:
    timed = functools.partial(cpu_ops.timed, n=a.reps)
    n, heads, kvh, d = a.rows, a.heads, a.kv_heads, a.head_dim
    cap = -(-L // 128) * 128
    size = n * kvh * cap * d
    K = torch.randn(LAYERS, size + 1, generator=gen)[:, :size].view(LAYERS, n, kvh, cap, d)
    V = torch.randn(LAYERS, size + 1, generator=gen)[:, :size].view(LAYERS, n, kvh, cap, d)
    q = [torch.randn(n, heads, d, generator=gen).bfloat16() for _ in range(LAYERS)]
    lens = torch.randint(int(L * a.min_frac), L + 1, (n,), generator=gen)
    lens[0] = L
    mask = reference.decode_mask(lens, L, None, torch.float32)
    layer = [torch.tensor([i]) for i in range(LAYERS)]

    def sdpa(i):
        o = F.scaled_dot_product_attention(q[i].view(n, kvh, heads // kvh, d).float(), K[i, :, :, :L],
                                           V[i, :, :, :L], attn_mask=mask, scale=d**-0.5)  # fmt: skip
        return o.view(n, heads, d).bfloat16()

    run = cpu_rows_attention.decode_attention(K, V, lens, L, heads, torch.bfloat16, d**-0.5, None)
    if run is None or run(q[0], layer[0]) is None:  # (wider heads than MAX_SUMS: None)
        print(f"len {L}: the kernel does not apply to these heads (or failed to compile)")
        return
    err = max((run(q[i], layer[i]).float() - sdpa(i).float()).abs().max().item() for i in range(2))
    t_sdpa = timed(lambda: [sdpa(i) for i in range(LAYERS)])
    t_rows = timed(lambda: [run(q[i], layer[i]) for i in range(LAYERS)])
    padded, needed = (2 * kvh * d * 4 * x / 1e6 for x in (n * L, int(lens.sum())))
    print(f"rows {n} len {L}: SDPA {t_sdpa:.2f} ms, kernel {t_rows:.2f} ms / {LAYERS} layers "
          f"({t_sdpa / t_rows:.2f}x); MB a layer padded {padded:.1f}, needed {needed:.1f}; max diff {err:.4f}")  # fmt: skip

if __name__ == "__main__":
    main()
