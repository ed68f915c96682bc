"""The real SmolLM2-135M-Instruct (bundled demo model): sensible chat answer, greedy tokens = transformers'."""

import subprocess
import sys

import pytest
import torch

from arcserve import LLM, SamplingParams


@pytest.fixture(scope="module")
def smol(smollm2_dir):
    return LLM(str(smollm2_dir), dtype="float32", max_model_len=1024)


def test_chat_answer_is_sensible(smol):
    out = smol.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(temperature=0, max_tokens=32),
        use_tqdm=False,
    )[0].outputs[0]
    assert "Paris" in out.text
    assert out.finish_reason == "stop"  # ends with <|im_end|>, not by length


def test_greedy_tokens_equal_transformers(smol, smollm2_dir):
    from transformers import AutoModelForCausalLM

    tok = smol.get_tokenizer()
    prompts = ["def quicksort(arr):", "The three primary colors are", "Once upon a time, in a village by the sea,"]
    ours = smol.generate(prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False)
    hf = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    for p, o in zip(prompts, ours):
        ids = torch.tensor([tok.encode(p)])
        ref = hf.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False,
            eos_token_id=None, pad_token_id=tok.pad_token_id,
        )  # fmt: skip
        assert o.outputs[0].token_ids == ref[0, ids.shape[1] :].tolist(), p


def test_cli_generate_prints_completion(smollm2_dir):
    r = subprocess.run(
        [sys.executable, "-m", "arcserve.cli", "generate", str(smollm2_dir), "--prompt",
         "What is the capital of France?", "--chat", "--temperature", "0", "--max-tokens", "24",
         "--log-level", "warning"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout


def test_cli_reports_bad_input_cleanly(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "arcserve.cli", "generate", str(tmp_path / "missing"), "--prompt", "x"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 2 and "Model folder not found" in r.stderr and "Traceback" not in r.stderr
