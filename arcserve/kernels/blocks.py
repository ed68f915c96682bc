"""A decoder layer's two halves around attention, composed from a kernel namespace's ops.

The model calls `ops.pre_attention` and `ops.post_attention` (get_ops binds `ops` to these), so a
backend may run either half as one unit: cpu_compiled does for one-token steps, where one compiled
call per half replaces the ~5 calls (and their per-call overhead) it is made of. Any other backend
or step runs the ops below one after another.

`lw` is the layer's weights (models.decoder.LayerWeights: any object with those fields).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch


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
