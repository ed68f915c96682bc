"""config.json variants real checkpoints carry: sliding windows as transformers reads them (per layer:
`layer_types`, or Qwen2/Qwen3's use_sliding_window + max_window_layers), a window of 0, Qwen3's
default head_dim, activations other than SiLU, weights whose shapes contradict the config, bias
tensors the config does not ask for, extra weight files, RoPE keys in their older spellings, and
config.json's EOS ids and dtype keys beside generation_config.json."""

from __future__ import annotations

import json
import random

import pytest
import torch
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


def _rewrite_weights(model_dir, change) -> None:
    from safetensors.torch import load_file, save_file

    path = model_dir / "model.safetensors"
    save_file(change(load_file(path)), path, metadata={"format": "pt"})


def test_biases_the_config_does_not_ask_for_are_not_used(tmp_path):
    """As transformers: a bias tensor in the file that config.json gives no bias (attention_bias /
    mlp_bias false, or one Qwen2 never has) is ignored; a q/k/v set with a part missing is refused
    by name."""
    d = make_model_dir(tmp_path / "l", "llama")
    want = hf_greedy(d, PROMPTS, 10)
    g = torch.Generator().manual_seed(0)

    def add(sd, names):
        return {**sd, **{n: torch.randn(sd[n.replace(".bias", ".weight")].shape[0], generator=g) for n in names}}

    a = "model.layers.0.self_attn."
    _rewrite_weights(d, lambda sd: add(sd, [a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias",
                                           a + "o_proj.bias", "model.layers.1.mlp.down_proj.bias"]))  # fmt: skip
    assert greedy(d) == want
    edit_config(d, attention_bias=True)  # now asked for: read, as transformers reads them
    assert greedy(d) == hf_greedy(d, PROMPTS, 10) != want
    _rewrite_weights(d, lambda sd: {k: v for k, v in sd.items() if k != a + "k_proj.bias"})
    with pytest.raises(ValueError, match=r"has some of .*q_proj.bias.* but not \['layers.0.self_attn.k_proj.bias'\]"):
        LLM(str(d), dtype="float32")


def test_weight_files_as_transformers_picks_them(tmp_path):
    """model.safetensors is the model even with other *.safetensors beside it (another precision's
    copy); files without an index that both hold one weight are refused, not merged last-wins."""
    import shutil

    d = make_model_dir(tmp_path / "q", "qwen3")
    want = hf_greedy(d, PROMPTS, 10)
    other = make_model_dir(tmp_path / "other", "qwen3", seed=1)
    shutil.copy(other / "model.safetensors", d / "model_fp16.safetensors")
    assert greedy(d) == want
    (d / "model.safetensors").rename(d / "model-a.safetensors")
    with pytest.raises(ValueError, match="is in both model-a.safetensors and model_fp16.safetensors; .*index.json"):
        LLM(str(d), dtype="float32")


def test_rope_keys_as_transformers_reads_them(tmp_path):
    """rope_parameters' older "type" key names the kind (linear here, not plain RoPE); its rope_theta
    comes before a different top-level one; `rope_scaling`, when present, replaces rope_parameters."""
    d = make_model_dir(tmp_path / "l", "llama")
    edit_config(d, rope_scaling=None, rope_theta=50.0,
                rope_parameters={"type": "linear", "factor": 3.0, "rope_theta": 10000.0})  # fmt: skip
    cfg = ModelConfig.from_dir(str(d))
    assert cfg.rope_scaling["rope_type"] == "linear" and cfg.rope_theta == 10000.0
    assert greedy(d) == hf_greedy(d, PROMPTS, 10)
    edit_config(d, rope_scaling={"rope_type": "default"})
    cfg = ModelConfig.from_dir(str(d))
    assert cfg.rope_scaling is None and cfg.rope_theta == 50.0
    assert greedy(d) == hf_greedy(d, PROMPTS, 10)


@pytest.mark.parametrize(
    "change,message",
    [
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor 0.5 in config.json"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "'llama3' in config.json needs a numeric 'low_freq"),
        ({"rope_scaling": {"type": "yarn", "factor": 4.0}}, "Unsupported rope scaling 'yarn'"),
    ],
)
def test_rope_arcserve_cannot_compute_is_refused(tmp_path, change, message):
    d = make_model_dir(tmp_path / "l", "llama")
    edit_config(d, **change)
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dir(str(d))


def test_config_json_eos_and_dtype_as_transformers(tmp_path):
    """config.json's EOS ids count only where there is no generation_config.json (a generation config
    replaces them, as in transformers and vLLM); its `dtype` key comes before the older `torch_dtype`."""
    from arcserve.config import EngineArgs
    from arcserve.engine.inputs import InputProcessor

    d = make_model_dir(tmp_path / "l", "llama")
    edit_config(d, eos_token_id=[2, 130], dtype="bfloat16", torch_dtype="float32")
    assert ModelConfig.from_dir(str(d)).config_dtype == torch.bfloat16
    assert InputProcessor(EngineArgs(model=str(d))).eos_token_ids == {2}
    (d / "generation_config.json").unlink()
    assert InputProcessor(EngineArgs(model=str(d))).eos_token_ids == {2, 130}


def test_config_json_mistakes_are_named(tmp_path):
    d = make_model_dir(tmp_path / "l", "llama")
    for text, message in [("[1, 2]", "must hold a JSON object, got list"), ("{nope", "is not valid JSON"),
                          (json.dumps({"architectures": ["LlamaForCausalLM"], "hidden_size": 64}),
                           "lacks \\(integer\\) vocab_size, intermediate_size")]:  # fmt: skip
        (d / "config.json").write_text(text)
        with pytest.raises(ValueError, match=message):
            ModelConfig.from_dir(str(d))
    with pytest.raises(FileNotFoundError, match="is a file; give the model's folder"):
        ModelConfig.from_dir(str(d / "config.json"))
    with pytest.raises(FileNotFoundError, match="downloads nothing: fetch the model first"):
        ModelConfig.from_dir("NoSuchOrg/NoSuchModel")
