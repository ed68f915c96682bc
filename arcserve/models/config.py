"""ModelConfig: the few numbers of a Hugging Face config.json that the decoder needs."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

import torch

from arcserve.models.registry import Family, resolve_family

_DTYPES = {
    "float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "half": torch.float16, "fp16": torch.float16,
}  # fmt: skip
SUPPORTED_ROPE = ("default", "linear", "llama3")
_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


@dataclass
class ModelConfig:
    model_dir: str
    architecture: str
    family: Family
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    sliding_window: int | None
    config_dtype: torch.dtype
    eos_token_ids: list[int]
    bos_token_id: int | None
    positions_known: bool = True  # config.json states max_position_embeddings

    @classmethod
    def from_dir(cls, model_dir: str) -> ModelConfig:
        path = os.path.join(model_dir, "config.json")
        if os.path.isfile(model_dir):
            raise FileNotFoundError(f"{model_dir} is a file; give the model's folder (config.json, tokenizer, weights)")
        if not os.path.isdir(model_dir):
            hint = ""
            if model_dir.count("/") == 1 and not model_dir.startswith((".", "/")):  # a hub id, e.g. Qwen/Qwen3-0.6B
                hint = (" (arcserve loads local folders and downloads nothing: fetch the model first, e.g. "
                        f"`hf download {model_dir} --local-dir DIR`, and serve DIR)")  # fmt: skip
            raise FileNotFoundError(f"Model folder not found: {model_dir}{hint}")
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"{model_dir} has no config.json; a Hugging Face model folder needs config.json, "
                "tokenizer files and *.safetensors weights"
            )
        try:
            with open(path) as f:
                c = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{path} is not valid JSON: {e}") from None
        if not isinstance(c, dict):
            raise ValueError(f"{path} must hold a JSON object, got {type(c).__name__}")
        arch, family = resolve_family(c.get("architectures"), model_dir)
        missing = [k for k in _REQUIRED if not isinstance(c.get(k), int) or isinstance(c.get(k), bool)]
        if missing:
            raise ValueError(f"{path} lacks (integer) {', '.join(missing)}")
        heads = c["num_attention_heads"]
        rope, scaling = _rope(c)
        act = c.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"Unsupported hidden_act {act!r}: the decoder's MLP is SiLU-gated (silu)")
        eos = c.get("eos_token_id")
        bias = bool(c.get("attention_bias", False))
        return cls(
            model_dir=model_dir,
            architecture=arch,
            family=family,
            vocab_size=c["vocab_size"],
            hidden_size=c["hidden_size"],
            intermediate_size=c["intermediate_size"],
            num_layers=c["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=c.get("num_key_value_heads") or heads,
            head_dim=c.get("head_dim") or (128 if family.name == "qwen3" else c["hidden_size"] // heads),
            rms_norm_eps=c.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope.get("rope_theta") or c.get("rope_theta") or 10000.0),
            rope_scaling=scaling,
            max_position_embeddings=c.get("max_position_embeddings", 2048),
            positions_known="max_position_embeddings" in c,
            tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
            qkv_bias=bias if family.qkv_bias is None else family.qkv_bias,
            o_bias=bias if family.o_bias is None else family.o_bias,
            mlp_bias=bool(c.get("mlp_bias", False)),
            sliding_window=_sliding_window(c, family.name),
            config_dtype=_DTYPES.get(str(c.get("dtype") or c.get("torch_dtype") or "float32"), torch.float32),
            eos_token_ids=[eos] if isinstance(eos, int) else list(eos or []),
            bos_token_id=c.get("bos_token_id"),
        )

    def resolve_dtype(self, dtype: str | torch.dtype) -> torch.dtype:
        if isinstance(dtype, torch.dtype):
            return dtype
        if dtype == "auto":
            return self.config_dtype
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of auto, float32, bfloat16, float16; got {dtype!r}")
        return _DTYPES[dtype]

    @property
    def trained_positions(self) -> int | None:
        """The longest context the checkpoint was made for, as vLLM derives it: max_position_embeddings,
        times the factor of linear RoPE scaling (Llama 3's scaling is in max_position_embeddings already);
        None when config.json does not say (its 2,048 default is then only max_model_len's default)."""
        if not self.positions_known:
            return None
        s = self.rope_scaling
        if s and s["rope_type"] == "linear":
            return int(self.max_position_embeddings * s["factor"])
        return self.max_position_embeddings

    def rope_cos_sin(self, max_pos: int) -> torch.Tensor:
        """[max_pos, head_dim] float32: cos of every position in the first half, sin in the second."""
        dim = self.head_dim
        inv_freq = 1.0 / (self.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        s = self.rope_scaling
        if s and s["rope_type"] == "linear":
            inv_freq = inv_freq / s["factor"]
        elif s and s["rope_type"] == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, s)
        t = torch.arange(max_pos, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        return torch.cat((freqs.cos(), freqs.sin()), dim=-1).float()


def _rope(c: dict) -> tuple[dict, dict | None]:
    """(RoPE parameters, the scaling to apply or None), read as transformers 5 reads them:
    `rope_scaling` (the older key) if present, else `rope_parameters`; the kind under "rope_type" or
    the older "type"; rope_theta there before the top-level one. Kinds arcserve does not compute,
    and partial rotary embeddings, are refused rather than run as plain RoPE."""
    rope = dict(c.get("rope_scaling") or c.get("rope_parameters") or {})
    kind = rope.get("rope_type") or rope.get("type") or "default"
    if kind not in SUPPORTED_ROPE:
        raise ValueError(f"Unsupported rope scaling {kind!r}; supported: {', '.join(SUPPORTED_ROPE)}")
    factor = rope.get("partial_rotary_factor", c.get("partial_rotary_factor"))
    if factor not in (None, 1, 1.0):
        raise ValueError(f"partial_rotary_factor {factor} in config.json: arcserve rotates the whole head only")
    if kind == "default":
        return rope, None
    needs = ["factor"] + (["low_freq_factor", "high_freq_factor"] if kind == "llama3" else [])
    for key in needs:
        if not isinstance(rope.get(key), (int, float)):
            raise ValueError(f"rope scaling {kind!r} in config.json needs a numeric {key!r}")
    scaling = {**rope, "rope_type": kind}
    if kind == "llama3":  # (transformers' default for the pre-scaling length)
        scaling.setdefault("original_max_position_embeddings", c.get("max_position_embeddings", 2048))
    return rope, scaling


def _sliding_window(c: dict, family: str) -> int | None:
    """The attention window every layer uses, or None for full attention. transformers decides per
    layer: `layer_types` when config.json lists them, else for Qwen2/Qwen3 `use_sliding_window`, the
    layers from `max_window_layers` on sliding; a window of 0 or less means none (vLLM's reading).
    Windows on some layers only are refused (as vLLM does)."""
    window = c.get("sliding_window")
    if not isinstance(window, int) or window <= 0:
        return None
    types = c.get("layer_types")
    if types is None and family in ("qwen2", "qwen3"):
        if not c.get("use_sliding_window", False):
            return None
        first = c.get("max_window_layers", 28)  # transformers' default for both
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(c["num_hidden_layers"])]
    if types is not None:
        sliding = [t == "sliding_attention" for t in types]
        if not any(sliding):
            return None
        if not all(sliding):
            raise ValueError(
                f"config.json gives a sliding window ({window}) to {sum(sliding)} of {len(sliding)} layers; "
                "arcserve runs one attention kind for all layers (a window on every layer, or on none)"
            )
    return window


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    """Llama 3.1 frequency-dependent scaling: long wavelengths scaled by `factor`, short ones kept,
    a smooth blend in between."""
    factor = s["factor"]
    low, high = s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    out = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
    return torch.where(mid, blended, out)
