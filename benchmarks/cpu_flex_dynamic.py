"""FlexAttention with dynamic shapes for the CPU decode mirror's batched attention (rows form: a KV
head's queries as its query rows), its block mask built from the rows' lengths
(BlockMask.from_kv_blocks: whole blocks without a mask, each row's last block masked), against SDPA
over rows padded to the longest; several (rows, length) shapes in turn, each compiled once at most,
printing the first call's time (compiles), the largest difference from SDPA and both times per
layer. cpu_flex_attention.py times the static-shape version.

    python benchmarks/cpu_flex_dynamic.py
"""

import functools
import time

import cpu_ops
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention

timed = functools.partial(cpu_ops.timed, n=5)  # ms a call
BS = 128  # KV positions per block
KVH, G, D = 3, 3, 64  # SmolLM2: KV heads, queries per KV head, head dim


def block_mask(lens: torch.Tensor, width: int) -> BlockMask:
    n, nb = lens.shape[0], width // BS
    full = (lens // BS).to(torch.int32)
    part = ((lens + BS - 1) // BS).to(torch.int32)
    idx = torch.arange(nb, dtype=torch.int32).expand(n, KVH, 1, nb).contiguous()

    def mask_mod(b, h, q, kv):
        return kv < lens[b]

    return BlockMask.from_kv_blocks(
        (part - full).view(n, 1, 1).expand(n, KVH, 1).contiguous(),
        (idx + full.view(n, 1, 1, 1)).clamp_max(nb - 1).contiguous(),
        full.view(n, 1, 1).expand(n, KVH, 1).contiguous(), idx,
        BLOCK_SIZE=(BS, BS), mask_mod=mask_mod, seq_lengths=(G, width),
    )  # fmt: skip


def main() -> None:
    torch.manual_seed(0)
    flex = torch.compile(flex_attention, dynamic=True)
    scale = D**-0.5
    for n, width in [(64, 512), (60, 384), (33, 512), (64, 640), (17, 256), (2, 128)]:
        lens = torch.randint(max(1, width - 300), width + 1, (n,))
        lens[0] = width
        k, v = torch.randn(n, KVH, width + 64, D), torch.randn(n, KVH, width + 64, D)
        q = torch.randn(n, KVH, G, D)
        longest = int(lens.max())
        valid = torch.arange(longest)[None, :] < lens[:, None]
        mask = torch.zeros(n, 1, 1, longest).masked_fill(~valid[:, None, None, :], float("-inf"))

        def sdpa(q=q, k=k, v=v, mask=mask, longest=longest):
            return F.scaled_dot_product_attention(q, k[:, :, :longest], v[:, :, :longest], attn_mask=mask, scale=scale)

        def flexed(q=q, k=k, v=v, lens=lens, width=width):
            return flex(q, k[:, :, :width], v[:, :, :width], block_mask=block_mask(lens, width), scale=scale)

        t = time.perf_counter()
        out = flexed()
        first = time.perf_counter() - t
        err = (out - sdpa()).abs().max().item()
        print(f"{n} rows, {width} positions: first call {first:.2f} s, max diff {err:.2e}, "
              f"SDPA {timed(sdpa):.3f} ms, flex {timed(flexed):.3f} ms", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
