"""EngineArgs: every engine knob in one dataclass. CLI flags map to it one to one. SpeculativeConfig:
the shape of its speculative_config (vLLM's)."""

from __future__ import annotations

import dataclasses
import json
import operator
from dataclasses import dataclass
from typing import Any

SPEC_METHODS = ("ngram", "draft_model")
# kv_cache_dtype names (vLLM's) -> the torch dtype of the cache (None: the model's dtype)
KV_CACHE_DTYPES = {"auto": None, "fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}


@dataclass
class SpeculativeConfig:
    method: str  # "ngram" (prompt lookup) | "draft_model"
    num_speculative_tokens: int  # k: the most drafts per request and step
    prompt_lookup_min: int = 2  # ngram: shortest suffix n-gram to look up
    prompt_lookup_max: int = 5  # ngram: longest (tried first)
    model: str | None = None  # draft_model: its Hugging Face folder (same tokenizer as the target)

    @classmethod
    def parse(cls, spec) -> SpeculativeConfig | None:
        """From vLLM's dict shape (or its JSON text, as --speculative-config takes it); None for None.
        The method is "draft_model" when only `model` is given. Raises ValueError naming what is wrong."""
        if spec is None or isinstance(spec, SpeculativeConfig):
            return spec
        spec = _json_dict(spec, "speculative_config")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(spec) - known
        if unknown:
            raise ValueError(f"speculative_config: unknown keys {sorted(unknown)}; known: {sorted(known)}")
        method = spec.setdefault("method", "draft_model" if spec.get("model") else None)
        if method not in SPEC_METHODS:
            raise ValueError(f"speculative_config: method must be one of {SPEC_METHODS} (or give 'model'), got {method!r}")
        if "num_speculative_tokens" not in spec:
            raise ValueError("speculative_config needs num_speculative_tokens")
        if method == "draft_model" and not spec.get("model"):
            raise ValueError("speculative_config: method 'draft_model' needs 'model', the draft model's folder")
        if method == "ngram" and spec.get("model"):
            raise ValueError("speculative_config: method 'ngram' takes no 'model'")
        if method == "ngram" and "prompt_lookup_min" not in spec and "prompt_lookup_max" in spec:
            spec["prompt_lookup_min"] = min(cls.prompt_lookup_min, spec["prompt_lookup_max"])
        cfg = cls(**spec)
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
            v = getattr(cfg, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"speculative_config: {name} must be a positive integer, got {v!r}")
        if cfg.num_speculative_tokens > 16:
            raise ValueError(f"speculative_config: num_speculative_tokens is at most 16, got {cfg.num_speculative_tokens}")
        if cfg.prompt_lookup_min > cfg.prompt_lookup_max:
            raise ValueError(
                f"speculative_config: prompt_lookup_min ({cfg.prompt_lookup_min}) exceeds prompt_lookup_max "
                f"({cfg.prompt_lookup_max})"
            )
        return cfg


@dataclass
class EngineArgs:
    model: str | None = None  # model folder; None = the bundled demo model
    tokenizer: str | None = None  # defaults to the model folder
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    max_model_len: int | None = None  # defaults to max_position_embeddings
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None  # per-step token budget; default 2048 on the CPU, 8192 on GPUs
    block_size: int = 16
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "auto"  # auto (the model dtype) | fp8 (= fp8_e4m3) | fp8_e4m3 | fp8_e5m2
    num_kv_blocks: int | None = None  # fixes the KV cache size; else from kv_cache_memory_bytes
    kv_cache_memory_bytes: int | None = None  # CPU default: min(4 GiB, 30% of available memory)
    seed: int = 0
    scheduling_policy: Any = "fcfs"  # "fcfs" | "priority" | a SchedulingPolicy instance
    device: str = "auto"  # auto | cuda | xpu | cpu
    kernels: str = "auto"  # auto (triton on GPUs, torch on CPU) | torch | triton
    generation_config: str = "auto"  # auto (model folder) | a folder | "vllm" (ignore the model's)
    # generation_config.json keys over the file's (vLLM's; JSON text too): {"temperature": 0.5, ...}
    override_generation_config: Any = None
    gpu_memory_utilization: float = 0.9  # GPU: share of device memory for weights, activations, KV cache
    enforce_eager: bool = False  # GPU: no step graphs; CPU: no compiled decode kernels
    load_format: str = "auto"  # auto (safetensors) | dummy (random weights from config.json; benchmarks)
    async_scheduling: bool | None = None  # overlapped steps; None = on for GPUs, off on the CPU
    # speculative decoding, vLLM's shape: {"method": "ngram", "num_speculative_tokens": k,
    # "prompt_lookup_min": a, "prompt_lookup_max": b} or {"model": DRAFT_DIR, "num_speculative_tokens": k}
    speculative_config: Any = None
    trust_remote_code: bool = False  # tokenizers only: run a tokenizer's own code (models are arcserve's)
    tensor_parallel_size: int = 1  # vLLM's; arcserve runs a model on one device
    disable_log_stats: bool = False  # no periodic stats line (engine/stat_logger.py); LLM() defaults to True
    # the most logprobs a request may ask for per token (vLLM's default, 20); -1: no limit (a request's
    # logprobs=-1, the whole vocabulary, then passes)
    max_logprobs: int = 20

    def __post_init__(self) -> None:
        def positive(name: str) -> None:
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ValueError(f"{name} must be a positive integer, got {v!r}")

        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "num_kv_blocks",
                     "kv_cache_memory_bytes"):  # fmt: skip
            positive(name)
        for name in ("enable_prefix_caching", "enforce_eager", "trust_remote_code", "disable_log_stats",
                     "async_scheduling"):  # fmt: skip
            v = getattr(self, name)
            if not isinstance(v, bool) and not (v is None and name == "async_scheduling"):
                raise ValueError(f"{name} must be True or False, got {v!r}")
        if isinstance(self.max_logprobs, bool) or not isinstance(self.max_logprobs, int) or self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be an integer >= 0, or -1 (no limit), got {self.max_logprobs!r}")
        try:
            seed = None if isinstance(self.seed, bool) else operator.index(self.seed)
        except TypeError:
            seed = None
        if seed is None or not 0 <= seed < 2**63:
            raise ValueError(f"seed must be an integer in [0, 2**63), got {self.seed!r}")
        self.seed = seed
        if not (isinstance(self.gpu_memory_utilization, (int, float)) and 0 < self.gpu_memory_utilization <= 1):
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        if self.load_format not in ("auto", "safetensors", "dummy"):
            raise ValueError(f"load_format must be auto, safetensors or dummy, got {self.load_format!r}")
        if not isinstance(self.kv_cache_dtype, str) or self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128):
            raise ValueError(f"block_size must be a power of two from 1 to 128, got {self.block_size}")
        if self.tensor_parallel_size != 1:
            raise ValueError(f"tensor_parallel_size must be 1 (arcserve runs a model on one device), "
                             f"got {self.tensor_parallel_size!r}")  # fmt: skip
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        self.override_generation_config = _json_dict(self.override_generation_config, "override_generation_config")

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)}


def _json_dict(value, name: str) -> dict:
    """A dict given as a dict or as JSON text (a CLI flag); {} for None."""
    if value is None:
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{name} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a dict (a JSON object), got {type(value).__name__}")
    return dict(value)
