"""EngineArgs: every engine knob in one dataclass. CLI flags map to it one to one."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


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
    num_kv_blocks: int | None = None  # fixes the KV cache size; else from kv_cache_memory_bytes
    kv_cache_memory_bytes: int | None = None  # CPU default: min(4 GiB, 30% of available memory)
    seed: int = 0
    scheduling_policy: Any = "fcfs"  # "fcfs" | "priority" | a SchedulingPolicy instance
    device: str = "auto"  # auto | cuda | xpu | cpu
    kernels: str = "auto"  # auto (triton on GPUs, torch on CPU) | torch | triton
    generation_config: str = "auto"  # auto (model folder) | a folder | "vllm" (ignore the model's)
    gpu_memory_utilization: float = 0.9  # GPU: share of device memory for weights, activations, KV cache
    enforce_eager: bool = False  # GPU: no decode graphs
    load_format: str = "auto"  # auto (safetensors) | dummy (random weights from config.json; benchmarks)
    async_scheduling: bool | None = None  # overlapped steps; None = on for GPUs, off on the CPU
    # speculative decoding, vLLM's shape: {"method": "ngram", "num_speculative_tokens": k,
    # "prompt_lookup_min": a, "prompt_lookup_max": b} or {"model": DRAFT_DIR, "num_speculative_tokens": k}
    speculative_config: Any = None

    def __post_init__(self) -> None:
        def positive(name: str) -> None:
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < 1):
                raise ValueError(f"{name} must be a positive integer, got {v!r}")

        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "num_kv_blocks",
                     "kv_cache_memory_bytes"):  # fmt: skip
            positive(name)
        if not (isinstance(self.gpu_memory_utilization, (int, float)) and 0 < self.gpu_memory_utilization <= 1):
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        if self.load_format not in ("auto", "safetensors", "dummy"):
            raise ValueError(f"load_format must be auto, safetensors or dummy, got {self.load_format!r}")
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128):
            raise ValueError(f"block_size must be a power of two from 1 to 128, got {self.block_size}")
        from arcserve.engine.speculative import SpeculativeConfig

        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)}
