"""Batched CPU decode attention: SDPA over padded rows (as the decode mirror runs it, heads as rows)
against torch's FlexAttention with a block mask from the rows' lengths (blocks past a row's length
skipped), and a plain sum over the same K and V for the read rate. SmolLM2's heads; the same
buffers every call (so a large L3 may hold them).

    python benchmarks/cpu_flex_attention.py [float32|bfloat16] [block size, e.g. 64]
"""

import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

torch.manual_seed(0)
dt = getattr(torch, sys.argv[1] if len(sys.argv) > 1 else "float32")
block = int(sys.argv[2]) if len(sys.argv) > 2 else 64
B, Hkv, G, D, L = 64, 3, 3, 64, 512  # rows, KV heads, queries per KV head, head dim, capacity
lens = torch.randint(100, 500, (B,))
K, V = torch.randn(B, Hkv, L, D, dtype=dt), torch.randn(B, Hkv, L, D, dtype=dt)
q = torch.randn(B, Hkv, G, D, dtype=dt)
Lm = int(lens.max())
valid = torch.arange(Lm)[None, :] < lens[:, None]
mask = torch.zeros(B, 1, 1, Lm, dtype=dt).masked_fill(~valid[:, None, None, :], float("-inf"))
blocks = create_block_mask(lambda b, h, qi, kv: kv < lens[b], B, None, G, Lm, device="cpu", BLOCK_SIZE=block)
flex = torch.compile(flex_attention, dynamic=False)


def sdpa_rows():
    return F.scaled_dot_product_attention(q, K[:, :, :Lm], V[:, :, :Lm], attn_mask=mask)


def flex_rows():
    return flex(q, K[:, :, :Lm], V[:, :, :Lm], block_mask=blocks)


def sum_kv():
    return K.sum() + V.sum()


print("max |sdpa - flex|", (sdpa_rows().float() - flex_rows().float()).abs().max().item())
for f in (sdpa_rows, flex_rows, sum_kv, sdpa_rows, flex_rows):
    for _ in range(3):
        f()
    t = time.perf_counter()
    for _ in range(30):
        f()
    print(f"{f.__name__:10s} {(time.perf_counter() - t) / 30 * 1e3:.3f} ms")
print(f"valid K+V {lens.sum().item() * Hkv * D * 2 * dt.itemsize / 1e6:.1f} MB, whole buffers {K.numel() * 2 * dt.itemsize / 1e6:.1f} MB")
