"""Supported architectures and their per-family switches over the one shared decoder."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    name: str
    qkv_bias: bool | None = None  # None: follow config.attention_bias
    o_bias: bool | None = None
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k before RoPE


FAMILIES: dict[str, Family] = {
    "LlamaForCausalLM": Family("llama"),
    "MistralForCausalLM": Family("mistral", qkv_bias=False, o_bias=False),
    "Qwen2ForCausalLM": Family("qwen2", qkv_bias=True, o_bias=False),
    "Qwen3ForCausalLM": Family("qwen3", qk_norm=True),
}


def resolve_family(architectures: list[str] | None, model_dir: str) -> tuple[str, Family]:
    for arch in architectures or []:
        if arch in FAMILIES:
            return arch, FAMILIES[arch]
    raise ValueError(
        f"Unsupported model architecture {architectures!r} in {model_dir}/config.json; "
        f"arcserve supports: {', '.join(FAMILIES)}"
    )
