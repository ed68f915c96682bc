"""Pure-PyTorch kernels: the CPU path, and the twin every Triton kernel is tested against.

Shapes: tokens are flattened (T = all scheduled tokens of the step); q is [T, num_heads, head_dim],
k/v are [T, num_kv_heads, head_dim]; a layer's KV cache is k_cache/v_cache of shape
[num_blocks, block_size, num_kv_heads, head_dim].
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from arcserve.platform import cpu_matrix_tiles, host_memory

log = logging.getLogger("arcserve")

_PACK_BATCH_HINT = 64  # oneDNN layout tuned for ~64 rows; measured best from 1 to 2048 rows
# Float32 copies of half weights (CPUs without native half products) are made only while this share
# of the host's memory stays available; past it, layers keep their half weights alone.
FLOAT_COPY_RESERVE = 0.25
_warned_short_memory = False


def native_half_matmul(dtype: torch.dtype) -> bool:
    """Whether this CPU multiplies bf16/fp16 matrices natively (oneDNN with AVX-512-BF16/AMX/FP16
    paths). Without (e.g. AVX2-only CPUs), torch emulates them 4-9x slower than float32."""
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16:
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return torch.ops.mkldnn._is_mkldnn_fp16_supported()


def half_tiles(dtype: torch.dtype) -> bool:
    """Whether this CPU has matrix tiles for the half dtype (AMX) besides native half products.
    Only the form of SDPA over a half decode mirror depends on it (cpu_attention.DecodeMirror's
    gqa_form: the query heads as SDPA's GQA, the faster form there), for the decode batches that
    the compiled attention kernels leave to SDPA."""
    return dtype in (torch.bfloat16, torch.float16) and native_half_matmul(dtype) and cpu_matrix_tiles(dtype)


def compiled_half(dtype: torch.dtype) -> bool:
    """A half dtype, whose models take the compiled CPU tier (cpu_compiled.py, cpu_rows_attention.py)
    and read the decode mirror at any context (cpu_attention.py), whatever the CPU's half
    products: AVX2-only CPUs (emulated), AVX-512-BF16 ones (e.g. Zen 4) and AMX Xeons alike. On
    AMX, where torch's own half kernels and eager one-token steps served until session 39, the tier
    measured on two cores of a Xeon host, SmolLM2-135M's shape, 64 requests: +9% to +36% out
    tok/s, a lone sequence 1.3-1.9x faster (docs/BENCHMARKS.md, session 39); on a 2-vCPU Zen 4 the
    eager one-token step ran 2.4x slower than compiled (session 36)."""
    return dtype in (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class EmulatedHalfWeight:
    """bf16/fp16 weights on a CPU without native half-precision products (AVX2-only, e.g. AMD
    Zen 3), kept two ways, measured on such a CPU (docs/BENCHMARKS.md):
    - `half`, the checkpoint's tensor, for one-row products: torch's half matrix-vector path
      streams half the bytes of a float32 one (30 decoder layers of SmolLM2-135M: 13 ms vs 22 ms);
    - `batched`, a float32 copy in oneDNN's blocked layout (plain float32 without oneDNN), for more
      rows: torch emulates half matrix products 4-9x slower than float32, and oneDNN's float32
      product is ~2x F.linear's at 4-64 rows there.
    Both compute x @ W.T with float32 accumulation, rounded once to the activations' dtype.
    `batched` is None when memory was short for the copy: every product then takes `half`.
    `rows16`, when set, is `half` in the layout of cpu_compiled's one-token product (this module
    does not use it).
    On a CPU with native half products, cpu_compiled keeps a half
    model's weights as this too: `half` None, `batched` oneDNN's packed half tensor (every row count
    but the compiled one-token steps'), and `rows16`."""

    half: torch.Tensor | None
    batched: torch.Tensor | None
    rows16: torch.Tensor | None = None


def host_can_spare(nbytes: int) -> bool:
    """Whether a copy of nbytes leaves FLOAT_COPY_RESERVE of the host's memory available."""
    available, total = host_memory()
    return available - nbytes >= FLOAT_COPY_RESERVE * total


def pack_linear_weight(weight: torch.Tensor) -> torch.Tensor | EmulatedHalfWeight:
    """On CPU, prepare bf16/fp16 weights once for the CPU's fastest matrix product:
    - with native half-precision matmul: reorder into oneDNN's blocked layout (AMX/AVX-512
      friendly): the same results as F.linear, ~1.4x faster for 1 to 64 rows and on par at 512
      (benchmarks/cpu_ops.py, docs/BENCHMARKS.md);
    - without (per dtype: a CPU may have the bf16 path and lack the fp16 one, seen on an AMD EPYC),
      an EmulatedHalfWeight (the half tensor for one row, a float32 copy for more, while the host
      has memory for it: FLOAT_COPY_RESERVE).
    fp32 weights stay as they are, so fp32 runs remain bit-identical to transformers."""
    if weight.device.type != "cpu" or weight.dtype not in (torch.bfloat16, torch.float16):
        return weight
    if native_half_matmul(weight.dtype):
        return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), _PACK_BATCH_HINT)
    if not host_can_spare(4 * weight.numel()):
        global _warned_short_memory
        if not _warned_short_memory:
            _warned_short_memory = True
            log.warning("host memory is short for float32 copies of the %s weights: some layers keep "
                        "only their %s weights and multiply more than one row slowly", weight.dtype, weight.dtype)  # fmt: skip
        return EmulatedHalfWeight(weight.contiguous(), None)
    batched = weight.float().contiguous()
    if torch.backends.mkldnn.is_available():
        batched = torch.ops.mkldnn._reorder_linear_weight(batched, _PACK_BATCH_HINT)
    return EmulatedHalfWeight(weight.contiguous(), batched)


def linear(
    x: torch.Tensor, weight: torch.Tensor | EmulatedHalfWeight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x @ weight.T (+ bias), for plain or prepared (pack_linear_weight) weights."""
    if isinstance(weight, EmulatedHalfWeight):
        if weight.half is None:  # native half products (oneDNN's packed half tensor) for every row count
            return linear(x, weight.batched, bias)
        if weight.batched is None or (x.dim() == 2 and x.shape[0] == 1):
            return F.linear(x, weight.half, bias)
        y = linear(x.float(), weight.batched, None if bias is None else bias.float())
        return y.to(x.dtype)
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim with float32 accumulation (bit-equal to transformers in fp32)."""
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """residual += x; return (rms_norm(residual), residual). With residual None, x starts it."""
    residual = x if residual is None else x + residual
    return rms_norm(residual, weight, eps), residual


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


def add_rms_norm_linear(
    x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
    weight: torch.Tensor, bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """fused_add_rms_norm, then the linear layer: (linear(rms_norm(x + residual)), x + residual)."""
    h, residual = fused_add_rms_norm(x, residual, norm_weight, eps)
    return linear(h, weight, bias), residual


def silu_mul_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """silu_and_mul, then the linear layer."""
    return linear(silu_and_mul(x), weight, bias)


# Inverse-CDF sampling flushes tokens under ~e^-79.3 of the row's top probability to zero mass:
# exp() of float32 inputs whose result would be denormal (below ~e^-87.3), or -inf, takes a slow
# path on x86 CPUs (64 x 49,152 values: 0.6 ms normally, 6 ms at -inf, 56 ms with denormal results),
# and a real model's logits at temperature 0.6 put most of the vocabulary there. Clamping at -80
# keeps exp() on its fast path; subtracting twice exp(-80) then takes every clamped token (filtered
# ones at -inf among them) to exactly 0 whatever exp's last-bit rounding.
_FLUSH_AT = -80.0
_FLUSH_MASS = 2 * math.exp(_FLUSH_AT)


def sample_from_cdf(x: torch.Tensor, inv_temp: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: per row, the first token whose cumulative probability under
    softmax(x * inv_temp) (in float32, whatever x's dtype) exceeds u (in [0, 1)). Tokens at -inf
    (filtered out) are never picked, nor tokens under ~e^-79 of the row's most likely one."""
    d = x.to(torch.float32, copy=True).mul_(inv_temp[:, None])
    d.sub_(d.amax(dim=-1, keepdim=True))
    # unnormalised: u is scaled by the row total below (the top token keeps mass 1)
    cdf = d.clamp_(min=_FLUSH_AT).exp_().sub_(_FLUSH_MASS).clamp_(min=0.0).cumsum_(dim=-1)
    # right=True: the first index whose cumulative mass exceeds u, so zero-probability tokens
    # (flat steps of the cdf) are never picked.
    picked = torch.searchsorted(cdf, u[:, None] * cdf[:, -1:], right=True)[:, 0]
    return picked.clamp_(max=x.shape[1] - 1)


def apply_penalties(logits: torch.Tensor, rows: torch.Tensor, counts: torch.Tensor, prompt: torch.Tensor,
                    slots: torch.Tensor, params: torch.Tensor) -> None:  # fmt: skip
    """In place on the float32 logits [B, V]: row rows[j] takes the penalties of table row slots[j]
    (counts [S, V] float32, the output's count of each token; prompt [S, V] bool, the prompt holds
    the token; params [S, 3] float32: repetition, frequency, presence). Repetition divides a positive
    logit and multiplies a negative one where the prompt or the output holds the token; frequency
    subtracts f times the count; presence subtracts p where the output holds the token."""
    c, f, sub = counts[slots], params[slots], logits[rows]
    rep = f[:, 0:1]
    sub = torch.where(prompt[slots] | (c > 0), torch.where(sub > 0, sub / rep, sub * rep), sub)
    logits[rows] = sub - f[:, 1:2] * c - f[:, 2:3] * (c > 0).float()


def rope_cos_sin(cos_sin: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype) -> tuple:
    """The step's rotary context for rotary_embedding, computed once per step in `dtype`: per-token
    (cos, sin), each [T, 1, rot_dim // 2], and their full-width NeoX forms (cos, cos) and
    (-sin, sin), each [T, 1, rot_dim]. (cos_sin: [max_pos, rot_dim], the cos half then the sin
    half, float32.)"""
    cs = cos_sin[positions].to(dtype)
    half = cs.shape[-1] // 2
    cos, sin = cs[:, None, :half], cs[:, None, half:]
    return cos, sin, torch.cat((cos, cos), -1), torch.cat((-sin, sin), -1)


def rotary_embedding(qk: torch.Tensor, rope: tuple, neox: bool = True) -> torch.Tensor:
    """Rotate q and k heads together: qk is [T, heads, head_dim] (q heads then k heads); rope is
    rope_cos_sin's result. NeoX layout rotates the two halves, GPT-J interleaved pairs. With a
    rotary dim below head_dim, the remaining features pass through."""
    cos, sin, cos2, sin2 = rope
    rot = 2 * cos.shape[-1]
    if rot < qk.shape[-1]:
        return torch.cat((rotary_embedding(qk[..., :rot], rope, neox), qk[..., rot:]), dim=-1)
    if neox:
        # x * (cos, cos) + (x2, x1) * (-sin, sin): transformers' q * cos + rotate_half(q) * sin,
        # the same roundings, in four ops (ops cost more than their arithmetic on a CPU at one token)
        return qk * cos2 + qk.roll(rot // 2, -1) * sin2
    x1, x2 = qk[..., 0::2], qk[..., 1::2]  # GPT-J: interleaved pairs
    return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)


def to_kv_cache(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x in a KV cache's dtype. An 8-bit float cache (kv_cache_dtype fp8*, scale 1.0) takes the
    nearest 8-bit value, saturating at its largest finite one (448 for e4m3, 57,344 for e5m2)."""
    if x.dtype == dtype:
        return x
    if dtype.itemsize == 1:
        big = torch.finfo(dtype).max
        x = x.clamp(-big, big)
    return x.to(dtype)


def kv_round_trip(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """x as an 8-bit float cache gives it back (x itself for a cache in x's dtype): what attention
    reads of a token it stored this step."""
    return x if cache_dtype == x.dtype else to_kv_cache(x, cache_dtype).to(x.dtype)


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """An 8-bit float cache indexed as bytes (torch has no float8 index_copy_/index_select on the
    CPU); any other tensor itself."""
    return t.view(torch.uint8) if t.dtype.itemsize == 1 and t.dtype.is_floating_point else t


def store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor
) -> None:
    """Write each token's K/V to its slot (block * block_size + offset) in the paged cache."""
    nb, bs = k_cache.shape[:2]
    kc, vc = _as_bytes(k_cache), _as_bytes(v_cache)
    if kc is not k_cache:  # an 8-bit cache: the rounded values, as bytes
        k, v = _as_bytes(to_kv_cache(k, k_cache.dtype)), _as_bytes(to_kv_cache(v, v_cache.dtype))
    kc.view(nb * bs, *kc.shape[2:]).index_copy_(0, slots, k)
    vc.view(nb * bs, *vc.shape[2:]).index_copy_(0, slots, v)


def qkv_prepare(qkv: torch.Tensor, num_q: int, q_norm: torch.Tensor | None, k_norm: torch.Tensor | None,
                eps: float, rope: tuple, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                neox: bool = True, parts: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """From the qkv projection [T, q heads + 2 kv heads, head_dim]: per-head RMSNorm of q and k
    (Qwen3; when the norms are given), RoPE of q and k, K/V stored at their cache slots.
    Returns (q, k, v) views of [T, heads, head_dim]. `parts` = (rms_norm, rotary_embedding,
    store_kv) to compose instead of this module's (the Triton path's unfused fallback)."""
    norm, rotate, store = parts or (rms_norm, rotary_embedding, store_kv)
    nkv = (qkv.shape[1] - num_q) // 2
    qk, v = qkv[:, : num_q + nkv], qkv[:, num_q + nkv :]
    if q_norm is not None:
        qk = torch.cat((norm(qk[:, :num_q], q_norm, eps), norm(qk[:, num_q:], k_norm, eps)), 1)
    qk = rotate(qk, rope, neox)
    q, k = qk[:, :num_q], qk[:, num_q:]
    store(k, v, k_cache, v_cache, slots)
    return q, k, v


@dataclass
class AttentionMetadata:
    """Per-step attention inputs, shared by every layer (built once per step by the runner)."""

    query_start_loc: torch.Tensor  # [B + 1] int32, offsets of each sequence's tokens in the batch
    seq_lens: torch.Tensor  # [B] int32, context length after this step (cached + new)
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with 0
    slot_mapping: torch.Tensor  # [T] int64
    # Host copies (numpy) for backends that plan on the host, and derived tensors they cache.
    host: dict = field(default_factory=dict)
    cache: dict = field(default_factory=dict)


def decode_mask(lens: torch.Tensor, width: int, sliding_window: int | None, dtype: torch.dtype) -> torch.Tensor | None:
    """[B, 1, 1, width] SDPA mask of the cached positions each decoding sequence (context length
    `lens`) reads: additive, in `dtype` (0 there, -inf elsewhere), made once a step for every layer
    (SDPA converts a bool mask in each call: 64 rows of up to 450 positions, 30 layers on a 2-vCPU
    Zen 4 EPYC, 144 ms with a bool mask, 109 ms with this one; the same bits). None when every
    position is read (one sequence, whole width, no window)."""
    if len(lens) == 1 and int(lens[0]) == width and sliding_window is None:
        return None
    pos = torch.arange(width, device=lens.device)[None, :]
    keep = pos < lens[:, None]
    if sliding_window is not None:
        keep &= pos > lens[:, None] - 1 - sliding_window
    return torch.zeros(keep.shape, dtype=dtype, device=lens.device).masked_fill_(~keep, float("-inf"))[:, None, None, :]


def _plan(meta: AttentionMetadata, block_size: int, sliding_window: int | None, dtype: torch.dtype) -> dict:
    """How the torch backend reads the cache this step, computed once and reused by every layer.
    Decode tokens (one query each) are batched into one call over gathered blocks; each prefill
    chunk gets its own call, and a chunk with no cached context attends to its own K/V directly."""
    if "plan" in meta.cache:
        return meta.cache["plan"]
    qsl, seq_lens = meta.host["query_start_loc"], meta.host["seq_lens"]
    q_lens = qsl[1:] - qsl[:-1]
    bt = meta.block_tables
    dev = bt.device
    plan: dict = {"decode": None, "prefill": []}
    dec = (q_lens == 1).nonzero()[0]
    if len(dec):
        lens = seq_lens[dec]
        max_len = int(lens.max())
        nblk = -(-max_len // block_size)
        idx = torch.from_numpy(dec).to(dev)
        mask = decode_mask(torch.from_numpy(lens).to(dev), nblk * block_size, sliding_window, dtype)
        tok = torch.from_numpy(qsl[dec]).to(dev)  # decode sequences' token rows in the batch
        plan["decode"] = (tok, bt[idx, :nblk].long(), mask)
    for i in (q_lens > 1).nonzero()[0]:
        n, ctx = int(q_lens[i]), int(seq_lens[i])
        blocks = None if ctx == n else bt[i, : -(-ctx // block_size)].long()
        plan["prefill"].append((int(qsl[i]), n, ctx, blocks))
    meta.cache["plan"] = plan
    return plan


def _gather(cache: torch.Tensor, blocks: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """[..., nblk] block ids -> [..., kv_heads, nblk * block_size, head_dim], in `dtype` (default:
    the cache's). index_select copies whole blocks and is ~4x faster on CPU than advanced indexing."""
    _, bs, kvh, hd = cache.shape
    src = _as_bytes(cache)
    g = src.index_select(0, blocks.reshape(-1))
    if src is not cache:
        g = g.view(cache.dtype)
    if dtype is not None and dtype != g.dtype:
        g = g.to(dtype)
    return g.view(*blocks.shape[:-1], blocks.shape[-1] * bs, kvh, hd).transpose(-3, -2)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    layer: int = 0,
    skip_decode: bool = False,
) -> torch.Tensor:
    """Causal attention of every scheduled token over its sequence's context: the cached prefix
    (the cache already holds this step's K/V too) and, for fresh prefill chunks, k/v directly.
    q: [T, heads, head_dim]; k, v: [T, kv_heads, head_dim]. Returns [T, heads, head_dim].
    skip_decode leaves the decode tokens' rows unwritten (a caller that computes them itself)."""
    plan = _plan(meta, k_cache.shape[1], sliding_window, q.dtype)
    gqa = q.shape[1] != k_cache.shape[2]
    decode = None if skip_decode else plan["decode"]
    if decode is not None:
        tok, blocks, mask = decode
        kd, vd = _gather(k_cache, blocks, q.dtype), _gather(v_cache, blocks, q.dtype)  # [B, KVH, L, D]
        qd = q if not plan["prefill"] else q[tok]  # decode-only steps: tokens are the rows, in order
        o = F.scaled_dot_product_attention(qd.unsqueeze(2), kd, vd, attn_mask=mask, scale=scale, enable_gqa=gqa)
        if not plan["prefill"]:
            return o.squeeze(2)
    out = torch.empty_like(q)
    if decode is not None:
        out[tok] = o.squeeze(2)
    for start, n, ctx, blocks in plan["prefill"]:
        qp = q[start : start + n].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        if blocks is None:  # what the cache gives back of them (an 8-bit cache rounds them)
            kp = kv_round_trip(k[start : start + n], k_cache.dtype).transpose(0, 1).unsqueeze(0)
            vp = kv_round_trip(v[start : start + n], v_cache.dtype).transpose(0, 1).unsqueeze(0)
        else:
            kp = _gather(k_cache, blocks, q.dtype)[:, :ctx].unsqueeze(0)
            vp = _gather(v_cache, blocks, q.dtype)[:, :ctx].unsqueeze(0)
        if ctx == n and sliding_window is None:
            o = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, scale=scale, enable_gqa=gqa)
        else:
            qpos = torch.arange(ctx - n, ctx, device=q.device)[:, None]
            kpos = torch.arange(ctx, device=q.device)[None, :]
            mask = kpos <= qpos
            if sliding_window is not None:
                mask = mask & (kpos > qpos - sliding_window)
            o = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, scale=scale, enable_gqa=gqa)
        out[start : start + n] = o[0].transpose(0, 1)
    return out
