"""Model folders of real shapes for GPU benchmarks with load_format="dummy": config.json plus a
small tokenizer trained here (prompts are token ids; ids past its vocabulary decode to nothing).
A few kilobytes stand in for a checkpoint of any size.

    python benchmarks/model_shapes.py DIR   # writes DIR/qwen3-0.6b, DIR/llama-3.1-8b, DIR/smollm2-135m
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

SHAPES = {
    "qwen3-0.6b": {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936, "hidden_size": 1024,
        "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
        "head_dim": 128, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000,
        "tie_word_embeddings": True, "torch_dtype": "bfloat16", "attention_bias": False,
        "bos_token_id": 1, "eos_token_id": 2,
    },
    "llama-3.1-8b": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 128, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192},
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2,
    },
    # CPU benchmarks (issue 2's model) on machines without the checkpoint
    "smollm2-135m": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 49152, "hidden_size": 576,
        "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
        "head_dim": 64, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 100000.0,
        "tie_word_embeddings": True, "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2,
    },
}  # fmt: skip

# A tiny Qwen3-like model for measuring host work (not a real shape; not among SHAPES)
TINY = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "vocab_size": 1024, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "tie_word_embeddings": True, "torch_dtype": "float32",
}  # fmt: skip


def write_model_dir(path: Path, cfg: dict) -> Path:
    """config.json and the small tokenizer in `path`."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    if not (path / "tokenizer.json").exists():
        write_tokenizer(path)
    return path


def write_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    tok.train_from_iterator(["The quick brown fox jumps over the lazy dog. 0 1 2 3 4 5 6 7 8 9"] * 50, trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(path)  # fmt: skip


def make_shape_dirs(root: str | Path) -> dict[str, Path]:
    return {name: write_model_dir(Path(root) / name, cfg) for name, cfg in SHAPES.items()}


if __name__ == "__main__":
    print(make_shape_dirs(sys.argv[1] if len(sys.argv) > 1 else "/tmp/arcserve-shapes"))
