"""The shared decoder-only transformer (Llama, Mistral, Qwen2, Qwen3) over a paged KV cache.

Weights live in plain tensors (no nn.Module per layer): the forward pass is a short loop of fused
ops, which keeps Python overhead per step low. q/k/v and gate/up projections are concatenated at load
time so each is one matmul.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from arcserve.kernels.blocks import LayerDims
from arcserve.kernels.reference import AttentionMetadata
from arcserve.models.config import ModelConfig


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    o_bias: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    post_norm: torch.Tensor
    gate_up: torch.Tensor
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor
    down_bias: torch.Tensor | None


class DecoderModel:
    def __init__(
        self,
        cfg: ModelConfig,
        embed: torch.Tensor,
        layers: list[LayerWeights],
        final_norm: torch.Tensor,
        lm_head: torch.Tensor,
        ops: SimpleNamespace,
        max_positions: int,
    ) -> None:
        self.cfg = cfg
        self.embed = embed
        self.layers = layers
        self.final_norm = final_norm
        self.lm_head = lm_head
        self.ops = ops
        self.dtype = embed.dtype
        self.device = embed.device
        self.kv_cache_dtype = self.dtype  # the engine sets an 8-bit float here for kv_cache_dtype="fp8..."
        self.cos_sin = cfg.rope_cos_sin(max_positions).to(self.device)
        self.scale = cfg.head_dim**-0.5
        self.dims = LayerDims(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps, self.scale,
                              cfg.sliding_window)  # fmt: skip
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        """input_ids/positions: [T]. Returns the final hidden states [T, hidden]."""
        ops = self.ops
        x = F.embedding(input_ids, self.embed)
        residual = None
        rope = ops.rope_cos_sin(self.cos_sin, positions, self.dtype)
        for i, (lw, (k_cache, v_cache)) in enumerate(zip(self.layers, kv_caches)):
            # add + RMSNorm, qkv, q/k norm (Qwen3) and RoPE, K/V into the paged cache, attention,
            # o, add + RMSNorm, gate_up, SiLU-mul, down (kernels/blocks.py)
            x, residual = ops.decoder_layer(x, residual, lw, i, self.dims, rope, k_cache, v_cache, meta)
        x, _ = ops.fused_add_rms_norm(x, residual, self.final_norm, self.dims.eps)
        return x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[rows, vocab] in the model's dtype: the sampler reads them as they are (argmax, the
        sampling kernel) and makes float32 copies only for what needs them (logprobs, penalties,
        top-k/p); a float32 copy of 256 rows of a 152k vocabulary cost ~120 us a step on the H100."""
        return self.ops.linear(hidden, self.lm_head)
