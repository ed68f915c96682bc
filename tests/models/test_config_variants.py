"""config.json variants real checkpoints carry: sliding windows as transformers reads them (per layer:
`layer_types`, or Qwen2/Qwen3's use_sliding_window + max_window_layers), a window of 0, Qwen3's
default head_dim, activations other than SiLU, and weights whose shapes contradict the config."""

from __future__ import annotations

import json
import random

import pytest
from tiny_models import TOKENIZER_VOCAB, hf_greedy, make_model_dir

from arcserve import LLM, SamplingParams
from arcserve.models.config import ModelConfig

PROMPTS = [[random.Random(i).randrange(3, TOKENIZER_VOCAB) for _ in range(n)] for i, n in enumerate((30, 41))]


def greedy(model_dir, **kw) -> list[list[int]]:
    llm = LLM(str(model_dir), dtype="float32", **kw)
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp, use_tqdm=False)]


def edit_config(model_dir, **changes) -> None:
    path = model_dir / "config.json"
    c = json.loads(path.read_text())
    for k, v in changes.items():
        if v is None:
            c.pop(k, None)
        else:
            c[k] = v
    path.write_text(json.dumps(c))


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
@pytest.mark.parametrize("use,first,window", [(True, 0, 16), (True, 28, None), (False, 0, None)])
def test_qwen_sliding_window_as_transformers(tmp_path, arch, use, first, window):
    """use_sliding_window with max_window_layers=0: every layer slides (prompts longer than the
    window); with 28 (>= the 2 layers) or use_sliding_window false: none does."""
    d = make_model_dir(tmp_path / arch, arch, use_sliding_window=use, sliding_window=16, max_window_layers=first)
    assert ModelConfig.from_dir(str(d)).sliding_window == window
    assert greedy(d) == hf_greedy(d, PROMPTS, 10)


def test_window_on_some_layers_is_refused(tmp_path):
    d = make_model_dir(tmp_path / "q", "qwen2", use_sliding_window=True, sliding_window=16, max_window_layers=1)
    with pytest.raises(ValueError, match="sliding window \\(16\\) to 1 of 2 layers"):
        ModelConfig.from_dir(str(d))


def test_window_of_zero_means_none(tmp_path):
    d = make_model_dir(tmp_path / "m", "mistral", sliding_window=None)
    want = hf_greedy(d, PROMPTS, 10)
    edit_config(d, sliding_window=0)  # some checkpoints say 0 for "no window" (vLLM reads it so)
    assert ModelConfig.from_dir(str(d)).sliding_window is None
    assert greedy(d) == want


def test_qwen3_head_dim_defaults_to_128(tmp_path):
    d = make_model_dir(tmp_path / "q3", "qwen3", head_dim=128)  # hidden 64 / 4 heads would say 16
    edit_config(d, head_dim=None)
    assert ModelConfig.from_dir(str(d)).head_dim == 128
    assert greedy(d) == hf_greedy(d, PROMPTS, 10)


def test_other_activations_are_refused(tmp_path):
    d = make_model_dir(tmp_path / "g", "llama", hidden_act="gelu_pytorch_tanh")
    with pytest.raises(ValueError, match="Unsupported hidden_act 'gelu_pytorch_tanh'"):
        LLM(str(d), dtype="float32")


def test_weight_shapes_must_match_the_config(tmp_path):
    d = make_model_dir(tmp_path / "l", "llama")
    edit_config(d, intermediate_size=96)
    with pytest.raises(ValueError, match=r"weight 'layers.0.mlp.gate_proj.weight' has shape \(128, 64\) but "
                                         r"config.json implies \(96, 64\)"):  # fmt: skip
        LLM(str(d), dtype="float32")


def test_rope_scaling_without_factor_is_refused(tmp_path):
    d = make_model_dir(tmp_path / "r", "llama")
    edit_config(d, rope_scaling={"type": "linear"}, rope_parameters=None)
    with pytest.raises(ValueError, match="rope scaling 'linear' in config.json needs a numeric 'factor'"):
        ModelConfig.from_dir(str(d))
