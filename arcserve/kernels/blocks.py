"""A decoder layer's two halves around attention, composed from a kernel namespace's ops.

The model calls `ops.decoder_layer` (get_ops binds `ops` to these), which is `decoder_layer` below
(pre_attention, ops.paged_attention, post_attention) except where a backend runs a whole layer as
one unit: cpu_layer.py does for steps decoding one sequence. The halves are units of their own
too: cpu_compiled runs each as one compiled call for other one-token steps, replacing the ~5 calls
(and their per-call overhead) each is made of. Any other backend or step runs the ops below one
after another.

`lw` is the layer's weights (models.decoder.LayerWeights: any object with those fields).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch


@dataclass(frozen=True)
class LayerDims:
    """What every decoder layer of a model shares: head counts and size, norm epsilon, attention
    scale and sliding window."""

    num_q: int
    num_kv: int
    head_dim: int
    eps: float
    scale: float
    sliding_window: int | None


def decoder_layer(
    ops: SimpleNamespace, x: torch.Tensor, residual: torch.Tensor | None, lw, layer: int, dims: LayerDims,
    rope: tuple, k_cache: torch.Tensor, v_cache: torch.Tensor, meta,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """One decoder layer: pre_attention, attention over the paged cache (`meta`: the step's
    AttentionMetadata; `layer`: this layer's index), post_attention. Returns the layer's output
    and the new residual."""
    d = dims
    q, k, v, residual = ops.pre_attention(x, residual, lw, d.eps, rope, d.num_q, d.num_kv, d.head_dim, k_cache,
                                          v_cache, meta.slot_mapping)  # fmt: skip
    attn = ops.paged_attention(q, k, v, k_cache, v_cache, meta, d.scale, d.sliding_window, layer)
    return ops.post_attention(attn.view(x.shape[0], d.num_q * d.head_dim), residual, lw, d.eps)


def pre_attention(
    ops: SimpleNamespace, x: torch.Tensor, residual: torch.Tensor | None, lw, eps: float, rope: tuple,
    num_q: int, num_kv: int, head_dim: int, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """residual add + input RMSNorm, the qkv product, q/k norm + RoPE, K/V into the paged cache.
    Returns q, k, v ([T, heads, head_dim] each) and the new residual."""
    qkv, residual = ops.add_rms_norm_linear(x, residual, lw.input_norm, eps, lw.qkv, lw.qkv_bias)
    qkv = qkv.view(x.shape[0], num_q + 2 * num_kv, head_dim)
    q, k, v = ops.qkv_prepare(qkv, num_q, lw.q_norm, lw.k_norm, eps, rope, k_cache, v_cache, slots)
    return q, k, v, residual


def post_attention(
    ops: SimpleNamespace, attn: torch.Tensor, residual: torch.Tensor, lw, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The o product, residual add + post-attention RMSNorm, gate_up product, SiLU-mul, down
    product. attn: [T, heads * head_dim]. Returns the layer's output and the new residual."""
    x = ops.linear(attn, lw.o, lw.o_bias)
    gate_up, residual = ops.add_rms_norm_linear(x, residual, lw.post_norm, eps, lw.gate_up, lw.gate_up_bias)
    return ops.silu_mul_linear(gate_up, lw.down, lw.down_bias), residual
