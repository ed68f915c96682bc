"""Tiny random Hugging Face model folders for tests (built locally; no hub)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

CORPUS = [
    "The quick brown fox jumps over the lazy dog. ",
    "def add(a, b):\n    return a + b\n",
    "Paris is the capital of France; Berlin is the capital of Germany. ",
    "Unicode: café, naïve, 東京, Привет, emoji 🙂🚀 and more. ",
    "Numbers 0 1 2 3 4 5 6 7 8 9 10 100 1000. ",
]
TOKENIZER_VOCAB = 300
MODEL_VOCAB = 320  # larger than the tokenizer's, as Qwen checkpoints pad it


def make_tokenizer(path: Path, kind: str = "bpe"):
    """A small byte-level BPE (GPT-2 / Qwen style) or a Metaspace BPE (SentencePiece / Llama style)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    special = ["<unk>", "<s>", "</s>"]
    if kind == "bpe":
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=TOKENIZER_VOCAB, special_tokens=special,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        )  # fmt: skip
    else:
        tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
        tok.decoder = decoders.Sequence(
            [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
        )
        byte_tokens = [f"<0x{i:02X}>" for i in range(256)]
        trainer = trainers.BpeTrainer(vocab_size=TOKENIZER_VOCAB + 256, special_tokens=special + byte_tokens)
    tok.train_from_iterator(CORPUS * 20, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
        chat_template=(
            "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
            "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
        ),
    )  # fmt: skip
    fast.save_pretrained(path)
    return fast


def copy_with_bos_tokenizer(src: Path, dst: Path) -> Path:
    """A copy of model folder `src` whose tokenizer puts its BOS (<s>, id 1) in front of what it
    encodes with special tokens, as Llama's do."""
    import shutil

    shutil.copytree(src, dst)
    spec = json.loads((dst / "tokenizer.json").read_text())
    bos, seq = {"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}
    spec["post_processor"] = {"type": "TemplateProcessing", "single": [bos, seq], "pair": [bos, seq, seq],
                              "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}}  # fmt: skip
    (dst / "tokenizer.json").write_text(json.dumps(spec))
    return dst


def make_config(arch: str, **over):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    common = dict(
        vocab_size=MODEL_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, rms_norm_eps=1e-6,
    )  # fmt: skip
    if arch == "llama":
        common.update(
            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
            rope_theta=500000.0,
        )  # fmt: skip
        cls = LlamaConfig
    elif arch == "mistral":
        common.update(sliding_window=48, num_attention_heads=6, num_key_value_heads=2, hidden_size=96)
        cls = MistralConfig
    elif arch == "qwen2":
        common.update(tie_word_embeddings=True, num_attention_heads=4, num_key_value_heads=4)
        cls = Qwen2Config
    elif arch == "qwen3":
        common.update(head_dim=32, num_attention_heads=4, num_key_value_heads=1)
        cls = Qwen3Config
    else:
        raise ValueError(arch)
    common.update(over)
    return cls(**common)


def make_model_dir(path: Path, arch: str, seed: int = 0, shard: bool = False, tokenizer: str = "bpe", **over):
    """Write config.json + safetensors + tokenizer for a random tiny model of `arch`."""
    from transformers import AutoModelForCausalLM

    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    config = make_config(arch, **over)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # bigger weights than the default init: sharper, less tie-prone logits
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.25)
    model.save_pretrained(path, max_shard_size="100KB" if shard else "1GB")
    make_tokenizer(path, tokenizer)
    gen = {"bos_token_id": 1, "eos_token_id": 2}
    (path / "generation_config.json").write_text(json.dumps(gen))
    return path


def text_of(tok, ids: list[int], **decode_kw) -> str:
    """The text the engine gives for generated ids: their decode, less the U+FFFD of bytes that the
    last tokens left short of a character (they never become text; vLLM leaves them out too)."""
    return tok.decode(ids, **decode_kw).rstrip("\ufffd")


def hf_greedy(model_dir: Path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' greedy continuation of each prompt (one at a time: no padding effects)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.generation_config.eos_token_id = None
    outs = []
    for p in prompts:
        ids = torch.tensor([p])
        g = model.generate(
            ids, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0,
            attention_mask=torch.ones_like(ids),
        )  # fmt: skip
        outs.append(g[0, len(p) :].tolist())
    return outs


def beam_reference(model, ids, width, max_tokens, eos, penalty, max_len=256, score_eos=frozenset({2})):
    """The search as vLLM defines it, over transformers' logits: every step extends each beam by its
    2 x width most likely tokens, beams ending in an `eos` id are finished, the width best of the rest
    live on; score = cumulative logprob / length ** penalty (length with the prompt, less a final
    `score_eos` id, which vLLM drops under ignore_eos too)."""

    def score(b):
        toks, cum = b
        return cum / max(len(toks) - (toks[-1] in score_eos), 1) ** penalty

    beams, done = [(list(ids), 0.0)], []
    for _ in range(max_tokens):
        if not beams:
            break
        grown = []
        for toks, cum in beams:
            with torch.no_grad():
                lp = model(torch.tensor([toks])).logits[0, -1].float().log_softmax(-1)
            values, index = lp.topk(min(2 * width, lp.numel()))
            for t, v in zip(index.tolist(), values.tolist()):
                (done if t in eos else grown).append((toks + [t], cum + v))
        grown.sort(key=score, reverse=True)
        beams = []
        for b in grown[:width]:
            (done if len(b[0]) >= max_len else beams).append(b)
    return sorted(done + beams, key=score, reverse=True)[:width]


def _matcher(model_dir, so):
    """A matcher built here, from llguidance's own constructors (not arcserve's translation)."""
    import llguidance
    import llguidance.hf
    from transformers import AutoTokenizer

    tok = llguidance.hf.from_tokenizer(AutoTokenizer.from_pretrained(model_dir), n_vocab=MODEL_VOCAB, eos_token=[2])
    kind = so.kind
    if kind in ("json", "json_object"):
        schema = json.loads(so.json) if isinstance(so.json, str) else so.json or {"type": "object"}
        g = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": not so.disable_any_whitespace})
    elif kind == "regex":
        g = llguidance.LLMatcher.grammar_from_regex(so.regex)
    elif kind == "choice":
        g = llguidance.grammar_from("choice", json.dumps(so.choice))
    else:
        g = llguidance.grammar_from("grammar", so.grammar)
    return llguidance.LLMatcher(tok, g)


def grammar_greedy(model, model_dir, prompt: list[int], so, max_tokens: int) -> list[int]:
    """transformers' greedy tokens with every token a StructuredOutputsParams' grammar does not allow
    masked, step by step, the grammar's matcher built here from llguidance's own constructors (not
    arcserve's translation); ends with EOS (id 2) when the grammar is complete and EOS wins."""
    import numpy as np

    m = _matcher(model_dir, so)
    ids, out = list(prompt), []
    for _ in range(max_tokens):
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1]
        bits = np.unpackbits(np.frombuffer(m.compute_bitmask(), dtype=np.uint8), bitorder="little")
        allowed = torch.from_numpy(bits[: logits.shape[0]].astype(bool))
        t = int(torch.where(allowed, logits, float("-inf")).argmax())
        out.append(t)
        if t == 2:
            break
        assert m.consume_token(t)
        ids.append(t)
    return out


def penalized_greedy(model, prompt: list[int], max_tokens: int, repetition: float = 1.0, frequency: float = 0.0,
                     presence: float = 0.0) -> list[int]:  # fmt: skip
    """transformers' greedy tokens under vLLM's penalties, written out from their definitions on every
    token id in turn: repetition divides a positive logit (multiplies a negative one) of every id in
    the prompt or the output so far; frequency subtracts f times the id's count in the output;
    presence subtracts p once if the output holds the id."""
    ids, out = list(prompt), []
    for _ in range(max_tokens):
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1].tolist()
        best, best_v = None, None
        for t, v in enumerate(logits):
            if t in ids:
                v = v / repetition if v > 0 else v * repetition
            n = out.count(t)
            v -= frequency * n + (presence if n else 0.0)
            if best_v is None or v > best_v:
                best, best_v = t, v
        out.append(best)
        ids.append(best)
    return out
