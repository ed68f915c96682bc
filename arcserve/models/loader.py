"""Load a Hugging Face model folder (safetensors, single file or sharded) into a DecoderModel."""

from __future__ import annotations

import glob
import json
import logging
import os
import zlib
from types import SimpleNamespace

import torch
from safetensors import safe_open

from arcserve.models.config import ModelConfig
from arcserve.models.decoder import DecoderModel, LayerWeights

log = logging.getLogger(__name__)


def weight_files(model_dir: str) -> list[str]:
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        missing = [s for s in shards if not os.path.isfile(os.path.join(model_dir, s))]
        if missing:
            raise FileNotFoundError(
                f"{model_dir}: model.safetensors.index.json names shards that are missing: {missing}"
            )
        return [os.path.join(model_dir, s) for s in shards]
    single = os.path.join(model_dir, "model.safetensors")
    if os.path.isfile(single):  # (other *.safetensors beside it, e.g. another precision's, are not read)
        return [single]
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if files:
        return files
    other = [os.path.basename(p) for p in glob.glob(os.path.join(model_dir, "*.bin"))]
    hint = f" (found {other}; only safetensors weights are supported)" if other else ""
    raise FileNotFoundError(
        f"{model_dir} has no weights: expected model.safetensors or model.safetensors.index.json "
        f"with its shards{hint}"
    )


def expected_shapes(cfg: ModelConfig, optional: str) -> dict[str, tuple]:
    """Every weight the decoder reads (our names: the checkpoint's without "model."), with its shape
    as config.json implies it. optional: "all" lists every family's optional biases and q/k norms
    (a checkpoint's are read when present), "config" only those the config asks for (dummy weights)."""
    h, d, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q, kv = cfg.num_heads * d, cfg.num_kv_heads * d
    every = optional == "all"
    shapes: dict[str, tuple] = {"embed_tokens.weight": (cfg.vocab_size, h), "norm.weight": (h,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        a, m = p + "self_attn.", p + "mlp."
        shapes.update({
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            a + "q_proj.weight": (q, h), a + "k_proj.weight": (kv, h), a + "v_proj.weight": (kv, h),
            a + "o_proj.weight": (h, q), m + "gate_proj.weight": (inter, h), m + "up_proj.weight": (inter, h),
            m + "down_proj.weight": (h, inter),
        })  # fmt: skip
        if every or cfg.qkv_bias:
            shapes.update({a + "q_proj.bias": (q,), a + "k_proj.bias": (kv,), a + "v_proj.bias": (kv,)})
        if every or cfg.o_bias:
            shapes[a + "o_proj.bias"] = (h,)
        if every or cfg.mlp_bias:
            shapes.update({m + "gate_proj.bias": (inter,), m + "up_proj.bias": (inter,), m + "down_proj.bias": (h,)})
        if every or cfg.family.qk_norm:
            shapes.update({a + "q_norm.weight": (d,), a + "k_norm.weight": (d,)})
    return shapes


class _Weights:
    """Name -> tensor over all shards, converted to the target dtype and device on read, its shape
    checked against config.json's."""

    def __init__(self, files: list[str], dtype: torch.dtype, device: torch.device, cfg: ModelConfig) -> None:
        self.dtype, self.device = dtype, device
        self.shapes = expected_shapes(cfg, "all")
        self.where: dict[str, tuple] = {}  # our name -> (file handle, key in the file, file path)
        for path in files:
            h = safe_open(path, framework="pt")
            for key in h.keys():
                name = key.removeprefix("model.")
                if name in self.where:
                    raise ValueError(
                        f"weight {key!r} is in both {os.path.basename(self.where[name][2])} and "
                        f"{os.path.basename(path)}; a model split over several files needs "
                        "model.safetensors.index.json to say which file holds each weight"
                    )
                self.where[name] = (h, key, path)

    def has(self, name: str) -> bool:
        return name in self.where

    def get(self, name: str) -> torch.Tensor:
        if name not in self.where:
            raise ValueError(f"weight {name!r} is missing from the checkpoint")
        h, key, _ = self.where[name]
        t = h.get_tensor(key)
        want = self.shapes.get(name)
        if want is not None and tuple(t.shape) != want:
            raise ValueError(
                f"weight {name!r} has shape {tuple(t.shape)} but config.json implies {want} (hidden_size, "
                "num_attention_heads, num_key_value_heads, head_dim, intermediate_size, vocab_size)"
            )
        return t.to(device=self.device, dtype=self.dtype)

    def opt(self, name: str) -> torch.Tensor | None:
        return self.get(name) if self.has(name) else None


class _DummyWeights:
    """Random weights of the checkpoint's shapes, from config.json alone (load_format="dummy", as
    vLLM's): matrices uniform in [-1e-3, 1e-3], norm scales 1. For benchmarks. Each tensor is seeded
    by (seed, its name), so a config with fewer layers gives exactly the first layers, embeddings and
    head of a deeper one (a truncated model: the speculative-decoding benchmark's draft)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device, seed: int) -> None:
        self.dtype, self.device, self.seed = dtype, device, seed
        self.gen = torch.Generator(device=device)
        self.shapes = expected_shapes(cfg, "config")

    def has(self, name: str) -> bool:
        return name in self.shapes

    def get(self, name: str) -> torch.Tensor:
        shape = self.shapes[name]
        if name.endswith("norm.weight"):
            return torch.ones(shape, dtype=self.dtype, device=self.device)
        self.gen.manual_seed(self.seed * 1_000_003 + zlib.crc32(name.encode()))
        t = torch.empty(shape, dtype=torch.float32, device=self.device).uniform_(-1e-3, 1e-3, generator=self.gen)
        return t.to(self.dtype)

    def opt(self, name: str) -> torch.Tensor | None:
        return self.get(name) if self.has(name) else None


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(parts, dim=0).contiguous()


def _biases(w, names: list[str], wanted: bool) -> torch.Tensor | None:
    """The projections' biases, stacked, when config.json gives them biases (as transformers, a
    bias the config does not ask for is not used, even when the file has it; one it asks for and
    the file lacks is zero); None when none are used."""
    if not wanted:
        return None
    parts = [w.opt(n) for n in names]
    if all(p is None for p in parts):
        return None
    missing = [n for n, p in zip(names, parts) if p is None]
    if missing:
        raise ValueError(f"the checkpoint has some of {names} but not {missing}")
    return _cat(parts)


def load_model(
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    ops: SimpleNamespace,
    max_positions: int,
    load_format: str = "auto",
    seed: int = 0,
) -> DecoderModel:
    if load_format == "dummy":
        w = _DummyWeights(cfg, dtype, device, seed)
    else:
        w = _Weights(weight_files(cfg.model_dir), dtype, device, cfg)
    layers = []
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        a, m = p + "self_attn.", p + "mlp."
        layers.append(
            LayerWeights(
                input_norm=w.get(p + "input_layernorm.weight"),
                qkv=_cat([w.get(a + f"{x}_proj.weight") for x in "qkv"]),
                qkv_bias=_biases(w, [a + f"{x}_proj.bias" for x in "qkv"], cfg.qkv_bias),
                o=w.get(a + "o_proj.weight"),
                o_bias=_biases(w, [a + "o_proj.bias"], cfg.o_bias),
                q_norm=w.opt(a + "q_norm.weight") if cfg.family.qk_norm else None,
                k_norm=w.opt(a + "k_norm.weight") if cfg.family.qk_norm else None,
                post_norm=w.get(p + "post_attention_layernorm.weight"),
                gate_up=_cat([w.get(m + "gate_proj.weight"), w.get(m + "up_proj.weight")]),
                gate_up_bias=_biases(w, [m + "gate_proj.bias", m + "up_proj.bias"], cfg.mlp_bias),
                down=w.get(m + "down_proj.weight"),
                down_bias=_biases(w, [m + "down_proj.bias"], cfg.mlp_bias),
            )
        )
        if cfg.family.qk_norm and layers[-1].q_norm is None:
            raise ValueError(f"{cfg.architecture} needs {a}q_norm.weight, missing from the checkpoint")
    embed = w.get("embed_tokens.weight")
    lm_head = embed if cfg.tie_word_embeddings else w.get("lm_head.weight")
    if cfg.tie_word_embeddings and w.has("lm_head.weight") and not torch.equal(w.get("lm_head.weight"), embed):
        log.warning("config.json ties the LM head to the embeddings (tie_word_embeddings), so the checkpoint's "
                    "own, different lm_head.weight is not used (as in vLLM; transformers 5 would use it)")  # fmt: skip
    pack = ops.pack_linear_weight
    for lw in layers:
        lw.qkv, lw.o, lw.gate_up, lw.down = pack(lw.qkv), pack(lw.o), pack(lw.gate_up), pack(lw.down)
    lm_head = pack(lm_head)
    return DecoderModel(cfg, embed, layers, w.get("norm.weight"), lm_head, ops, max_positions)
