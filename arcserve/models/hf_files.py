"""Tokenizer and generation_config.json from a Hugging Face model folder."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

# generation_config.json keys that become SamplingParams defaults (as vLLM reads them).
_SAMPLING_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "max_new_tokens": "max_tokens",
}


# tokenizer_config.json classes that name transformers' generic tokenizers-backed tokenizer.
_GENERIC_TOKENIZERS = ("TokenizersBackend", "PreTrainedTokenizerFast")


def generic_tokenizer_class(path: str):
    """transformers' generic tokenizers-backed class where AutoTokenizer would pick it for the folder
    `path`, found without AutoConfig: the folder names a generic class in tokenizer_config.json, has a
    tokenizer.json and no code of its own, and its model type has no tokenizer class of its own nor a
    known-wrong declared one. Else None (AutoTokenizer decides). AutoTokenizer reads the model's
    configuration through AutoConfig, whose imports (transformers 5: its model-loading modules) cost
    SmolLM2's tokenizer 4.0-4.2 s against 2.5 s this way (2-vCPU VM, docs/BENCHMARKS.md session 44);
    SmolLM2 (the demo model) and the Llama-3 family declare the generic class."""
    try:
        with open(os.path.join(path, "tokenizer_config.json")) as f:
            declared = json.load(f)
        with open(os.path.join(path, "config.json")) as f:
            model_type = json.load(f).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None
    if (not isinstance(declared, dict) or declared.get("tokenizer_class") not in _GENERIC_TOKENIZERS
            or "auto_map" in declared or not os.path.isfile(os.path.join(path, "tokenizer.json"))):  # fmt: skip
        return None
    try:  # (transformers 5; 4.x has neither name: AutoTokenizer then)
        from transformers import TokenizersBackend
        from transformers.models.auto.tokenization_auto import (
            MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS,
            TOKENIZER_MAPPING_NAMES,
        )
    except ImportError:
        return None
    if model_type in MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS:
        return None
    if TOKENIZER_MAPPING_NAMES.get(model_type) not in (None, *_GENERIC_TOKENIZERS):
        return None
    return TokenizersBackend


def load_tokenizer(path: str, trust_remote_code: bool = False):
    """trust_remote_code: let a tokenizer that ships its own Python code run it (vLLM's flag; model
    architectures are arcserve's own either way)."""
    try:
        generic = generic_tokenizer_class(path)
        if generic is not None:
            return generic.from_pretrained(path)
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as e:  # transformers raises many kinds; name the folder and the cause
        raise ValueError(
            f"Could not load a tokenizer from {path} (it needs tokenizer.json or the tokenizer "
            f"files of its family): {type(e).__name__}: {e}"
        ) from e


@dataclass
class GenerationDefaults:
    eos_token_ids: list[int] = field(default_factory=list)
    sampling: dict = field(default_factory=dict)  # SamplingParams field -> default value
    found: bool = False  # a generation_config.json was read (else config.json's EOS ids stand in)


def load_generation_defaults(source: str, model_dir: str, overrides: dict | None = None) -> GenerationDefaults:
    """source: "auto" (the model folder), a folder holding generation_config.json, or "vllm"
    (ignore the model's sampling defaults and use SamplingParams' own; its EOS ids still count, as
    in vLLM). overrides: generation_config.json keys over the file's sampling ones (vLLM's
    override_generation_config; they apply under "vllm" too, as in vLLM; other keys are ignored)."""
    folder = model_dir if source in ("auto", "vllm") else source
    path = os.path.join(folder, "generation_config.json")
    g = {}
    found = os.path.isfile(path)
    if found:
        with open(path) as f:
            g = json.load(f)
    elif source not in ("auto", "vllm"):
        raise FileNotFoundError(f"--generation-config {source}: no generation_config.json there")
    eos = g.get("eos_token_id")
    eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
    if source == "vllm":
        g = {}
    g = {**g, **(overrides or {})}
    sampling = {ours: g[theirs] for theirs, ours in _SAMPLING_KEYS.items() if g.get(theirs) is not None}
    if sampling.get("top_k") == 0:
        sampling["top_k"] = -1
    return GenerationDefaults(eos_token_ids=eos_ids, sampling=sampling, found=found)
