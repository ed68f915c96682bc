"""Decode attention of many sequences at once over the decode mirror (cpu_attention.DecodeMirror,
float32 or the model's half dtype), compiled by inductor, for half models: the tier whose one-token
steps run compiled (reference.compiled_half).

SDPA over the mirror (the rows form: each KV head's query heads as its query rows) reads every row
to the step's longest, the rest masked, and its CPU kernel runs far below the memory's speed at a
few queries per KV head: 64 rows of SmolLM2-135M's heads (3 query heads a KV head) at up to 400
positions, 30 layers, read their float32 K and V at ~16 GB/s of the ~30-47 a plain sum reaches on
a 2-vCPU Zen 4 EPYC (docs/BENCHMARKS.md, session 37). This kernel:
- reads the positions in blocks of BLOCK, and a block past a row's length (or before its sliding
  window) as the row's first block instead, which the caches hold: padding costs arithmetic, not
  memory traffic;
- sums the softmax-weighted values with one accumulator per 16 lanes of each query head, all in
  one loop over the positions (stacked sums, as cpu_compiled._gemv's tiles): left to inductor,
  each 16 output lanes were a loop of their own, a chain of dependent adds over the positions
  re-reading V from the caches once per lane group (measured: that half of the kernel 1.9x slower);
  the scores likewise, each query head's dot products a sum of their own in one loop over the
  positions, over queries scaled and converted once (the kernel ~15% faster than one sum over
  every query head, which read each K row once per query head).
One kernel serves every decode batch: the rows, the mirror's layout and the number of blocks read
are symbolic sizes (the engine compiles it at startup, ModelRunner.warm_up). Sums in float32 and
one rounding to the queries' dtype, as SDPA over a float32 mirror (in another order)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from arcserve.kernels import cpu_inductor

BLOCK = 16  # positions a block: what the kernel reads, or skips (reads the row's first block instead)
LANES = 16  # output lanes an accumulator sums (one AVX-512 float32 vector, two AVX2 ones)
# Accumulators the value sum keeps (query heads a KV head x head_dim / LANES); past this many the
# batch takes SDPA. Measured on a 2-vCPU Zen 4 (benchmarks/cpu_rows_attention.py, 400 positions):
# 12 sums (SmolLM2's heads) 2.0x SDPA's speed, 28 (Qwen2.5-0.5B's) 1.6x, 32 (Llama-3-8B's) 1.9x,
# 64 1.2x (left to SDPA: little margin, one run).
MAX_SUMS = 32


def _attend(q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, layer: torch.Tensor, lens: torch.Tensor,
            blocks: torch.Tensor, *, scale: float, window: int | None) -> torch.Tensor:  # fmt: skip
    """q [n, heads, hd] over rows 0..n-1 of layer `layer` (a 1-element index) of K, V [layers, rows,
    kv heads, capacity / BLOCK, BLOCK, hd] (float32 or q's dtype): row i's first lens[i] positions (the last
    `window` of them with a sliding window), blocks.shape[0] blocks of each row read. Query heads
    grouped on their KV head as SDPA's GQA does; the result in q's dtype."""
    n, heads, hd = q.shape
    kvh, nb = K.shape[2], blocks.shape[0]
    g = heads // kvh
    last = lens[:, None]
    b = torch.arange(nb)[None, :]
    read = b * BLOCK < last
    pos = torch.arange(nb * BLOCK)[None, :]
    valid = pos < last
    if window is not None:
        read &= (b + 1) * BLOCK > last - window
        valid &= pos > last - 1 - window
    blk = torch.where(read, b, 0)[:, None, :]  # [n, 1, nb]: blocks not read stand in as block 0
    at = (layer.view(1, 1, 1), torch.arange(n).view(n, 1, 1), torch.arange(kvh).view(1, kvh, 1), blk)
    k = K[at].view(n, kvh, nb * BLOCK, hd)
    v = V[at].view(n, kvh, nb * BLOCK, hd)
    # the scaled queries stored before the loop (inductor otherwise converts them at every position),
    # and each query head's scores its own sum in one loop over the positions (K read once a row)
    qs = torch.ops.prims.inductor_force_stride_order(q.float() * scale, (heads * hd, hd, 1)).view(n, kvh, g, hd)
    s = torch.stack([(qs[:, :, j, None, :] * k).sum(-1) for j in range(g)], 2)  # [n, kvh, g, positions]
    p = torch.softmax(torch.where(valid[:, None, None, :], s, float("-inf")), -1)
    sums = [(p[:, :, j, :, None] * v[..., c : c + LANES]).sum(2) for j in range(g) for c in range(0, hd, LANES)]
    return torch.stack(sums, 2).view(n, heads, hd).to(q.dtype)


class RowsAttention:
    """A step's attention for n >= 2 decoding sequences over rows 0..n-1 of the KV buffers K, V
    [layers, rows, kv heads, capacity, hd] (cpu_attention.DecodeMirror's, float32 or q's dtype), row i's first
    lens[i] positions: `self(q, layer)` runs it as one compiled call (q [n, heads, hd]; layer a
    1-element int64 tensor), or returns None if the kernel fails to compile."""

    def __init__(self, K: torch.Tensor, V: torch.Tensor, lens: torch.Tensor, width: int, scale: float,
                 window: int | None) -> None:  # fmt: skip
        layers, rows, kvh, cap, hd = K.shape
        self.K = K.view(layers, rows, kvh, cap // BLOCK, BLOCK, hd)
        self.V = V.view(layers, rows, kvh, cap // BLOCK, BLOCK, hd)
        self.lens, self.scale, self.window = lens, scale, window
        # at least 2 blocks: tracing specializes a size of 1, and one kernel should serve every step
        self.blocks = torch.empty(min(max(-(-width // BLOCK), 2), cap // BLOCK), dtype=torch.uint8)
        self._kernel: Callable | None = None

    def __call__(self, q: torch.Tensor, layer: torch.Tensor) -> torch.Tensor | None:
        args = (q, self.K, self.V, layer, self.lens, self.blocks)
        if self._kernel is None:  # looked up at the step's first layer
            dynamic = {0: (0,), 1: (1, 3), 2: (1, 3), 4: (0,), 5: (0,)}
            self._kernel = cpu_inductor.kernel(_attend, args, dynamic, scale=self.scale, window=self.window)
            if self._kernel is None:
                return None
        return self._kernel(*args)


def decode_attention(K: torch.Tensor, V: torch.Tensor, lens: torch.Tensor, width: int, heads: int,
                     dtype: torch.dtype, scale: float, window: int | None) -> RowsAttention | None:  # fmt: skip
    """For a step decoding len(lens) >= 2 sequences (`heads` queries each, in `dtype`) over the KV buffers K, V
    (float32 or `dtype`; rows 0.. of cpu_attention.DecodeMirror's, row i's first lens[i] positions valid, `width`
    the longest): the step's attention (RowsAttention), decided once per step, in place of SDPA.
    None where it does not apply (the caller runs SDPA): not a half model (cpu_inductor.serves),
    one row, a head size not a multiple of LANES, more query
    heads a KV head than the kernel's sums fit (MAX_SUMS)."""
    kvh, cap, hd = K.shape[2:]
    if not cpu_inductor.serves(dtype) or K.dtype not in (torch.float32, dtype) or len(lens) < 2:
        return None
    if hd % LANES or cap % BLOCK or heads % kvh or heads // kvh * hd // LANES > MAX_SUMS:
        return None
    return RowsAttention(K, V, lens, width, scale, window)
