"""IncrementalDetokenizer: token-by-token text equals decoding everything at once (multi-byte UTF-8,
leading spaces, both tokenizer styles, the real SmolLM2 tokenizer), unknown ids, stop strings and
the hold-back of deltas."""

from __future__ import annotations

import random

import pytest
from tiny_models import MODEL_VOCAB, make_tokenizer

from arcserve.engine.detokenizer import IncrementalDetokenizer

KINDS = ["bpe", "sp"]


@pytest.fixture(scope="module")
def toks(tmp_path_factory):
    root = tmp_path_factory.mktemp("tokenizers")
    return {kind: make_tokenizer(root / kind, kind) for kind in KINDS}


# (prompt, output): the output is what the model "generates", tokenized after the prompt.
CASES = [
    ("Unicode:", " café 東京 🙂🚀 Привет мир"),
    ("Q:", "  two leading spaces, é and naïve"),
    ("Say", " 🎉🚀 rocket 😀, Ёлка и 北京"),  # 🎉, 😀, Ё, 北 are not in the training corpus
    ("The quick brown fox jumps over the lazy dog.", " 東京🙂"),
    ("x", " ñ"),
]


def feed(d: IncrementalDetokenizer, ids: list[int], check_fffd: bool = True) -> list[str]:
    """Add ids one by one; return the text after each step."""
    texts = []
    for t in ids:
        assert d.add_token(t) is None
        texts.append(d.text)
        if check_fffd:
            assert "\ufffd" not in d.text, (texts, ids)
    return texts


def expected_continuation(tok, prompt_ids: list[int], out_ids: list[int], skip: bool) -> str:
    before = tok.decode(prompt_ids, skip_special_tokens=skip)
    full = tok.decode(prompt_ids + out_ids, skip_special_tokens=skip)
    assert full.startswith(before) and "\ufffd" not in full
    return full[len(before) :]


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("case", range(len(CASES)))
def test_token_by_token_equals_full_decode(toks, kind, case, skip):
    tok = toks[kind]
    prompt_text, out_text = CASES[case]
    prompt_ids = tok.encode(prompt_text)
    out_ids = tok.encode(out_text, add_special_tokens=False)
    d = IncrementalDetokenizer(tok, prompt_ids, skip_special_tokens=skip)
    texts = feed(d, out_ids)
    expected = expected_continuation(tok, prompt_ids, out_ids, skip)
    assert d.text == expected
    for a, b in zip(texts, texts[1:]):
        assert b.startswith(a)  # text only ever grows
    if kind == "bpe":
        # byte-level BPE is lossless: the exact output string, and decode(output ids) alone
        assert expected == out_text == tok.decode(out_ids, skip_special_tokens=skip)
        assert len(set(texts)) < len(texts)  # some tokens held back (partial UTF-8 sequences)
    else:
        # SentencePiece style: decoding the output ids alone drops the one leading space that the
        # prompt context keeps.
        assert tok.decode(out_ids, skip_special_tokens=skip) == expected.removeprefix(" ")
        if not skip:  # (this tokenizer marks its <0x..> byte pieces special; kept only here)
            assert expected == out_text
    d.flush()
    assert d.text == expected


@pytest.mark.parametrize("kind", KINDS)
def test_no_prompt_context_equals_decode_of_output(toks, kind):
    tok = toks[kind]
    for _, out_text in CASES:
        out_ids = tok.encode(out_text, add_special_tokens=False)
        d = IncrementalDetokenizer(tok, [], skip_special_tokens=False)
        feed(d, out_ids)
        assert d.text == tok.decode(out_ids)


def test_held_back_until_character_complete(toks):
    tok = toks["bpe"]
    ids = tok.encode(" 🎉", add_special_tokens=False)  # not in the corpus: 4 bytes in >= 2 tokens
    assert len(ids) >= 3
    d = IncrementalDetokenizer(tok, tok.encode("Hi"))
    assert feed(d, ids) == [" "] * (len(ids) - 1) + [" 🎉"]


@pytest.mark.parametrize("lazy", [False, True])
def test_cut_inside_a_character_leaves_its_bytes_out(toks, lazy):
    """A sequence that ends (max_tokens) between the tokens of one character: its text stops before
    that character, the complete ones before it in the same window kept; streamed deltas add up to
    the same text (vLLM's text has no trailing U+FFFD either)."""
    tok = toks["bpe"]
    ids = tok.encode(" ok 🎉", add_special_tokens=False)  # 🎉 is in no merge: >= 2 tokens of bytes
    part = next(k for k in range(1, len(ids)) if tok.decode(ids[:k]).endswith("\ufffd"))
    assert tok.decode(ids[:part]).rstrip("\ufffd") == " ok "
    d = IncrementalDetokenizer(tok, tok.encode("Say"), lazy=lazy)
    streamed = ""
    for t in ids[:part]:
        assert d.add_token(t) is None
        streamed += d.delta(False)
    d.flush()
    streamed += d.delta(True)
    assert d.text == streamed == " ok " and d.visible_text(True) == " ok "


@pytest.mark.parametrize("kind", KINDS)
def test_random_ids_match_full_decode(toks, kind):
    """Random token sequences: after flush, the text equals decoding prompt + output at once, less
    the U+FFFD of bytes still incomplete at the end."""
    tok = toks[kind]
    vocab = tok.get_vocab()
    if kind == "bpe":
        pool = list(range(3, len(tok)))
    else:  # whole pieces only (byte pieces form invalid UTF-8 that decodes lossily)
        pool = sorted(i for t, i in vocab.items() if not t.startswith("<"))
    rng = random.Random(0)
    checked = cut = 0
    for _ in range(600):
        p = [rng.choice(pool) for _ in range(rng.randrange(1, 8))]
        o = [rng.choice(pool) for _ in range(rng.randrange(1, 20))]
        before, full = tok.decode(p), tok.decode(p + o)
        if "\ufffd" in before or not full.startswith(before):
            continue  # prompt ends inside a character: no well-defined continuation
        d = IncrementalDetokenizer(tok, p)
        for t in o:
            d.add_token(t)
        d.flush()
        assert d.text == full[len(before) :].rstrip("\ufffd"), (p, o)
        checked += 1
        cut += full.endswith("\ufffd")
    assert checked > 80 and (cut > 5 or kind == "sp")  # (sp: whole pieces only, no cuts)


@pytest.mark.parametrize("kind", KINDS)
def test_lazy_mode_gives_the_incremental_text(toks, kind):
    """Lazy mode (final-only outputs without stop strings) collects ids and decodes when asked: the
    same text as token-by-token decoding, read mid-way (visible_text) or at the end (flush), with
    prompt context, unknown ids and partial characters; with stop strings it stays incremental."""
    tok = toks[kind]
    rng = random.Random(1)
    pool = list(range(3, len(tok) + 5))  # a few ids past the tokenizer's vocabulary too
    for prompt_text, out_text in CASES + [("", "")]:
        prompt_ids = tok.encode(prompt_text) if prompt_text else []
        out_ids = tok.encode(out_text, add_special_tokens=False) + [rng.choice(pool) for _ in range(12)]
        eager = IncrementalDetokenizer(tok, prompt_ids)
        lazy = IncrementalDetokenizer(tok, prompt_ids, lazy=True)
        assert lazy.lazy
        half = len(out_ids) // 2
        for t in out_ids[:half]:
            eager.add_token(t)
            assert lazy.add_token(t) is None
        assert lazy.visible_text(False) == eager.visible_text(False)
        for t in out_ids[half:]:
            eager.add_token(t)
            lazy.add_token(t)
        eager.flush(), lazy.flush()
        assert lazy.text == eager.text and lazy.visible_text(True) == eager.visible_text(True)
    assert not IncrementalDetokenizer(tok, [], stop=["x"], lazy=True).lazy


@pytest.mark.parametrize("kind", KINDS)
def test_ids_beyond_tokenizer_vocab_decode_to_nothing(toks, kind):
    tok = toks[kind]
    V = len(tok)
    oov = [V, V + 1, max(MODEL_VOCAB, V) + 5, V + 1000]
    prompt_ids = tok.encode("Unicode:") + [V + 3]
    out_ids = tok.encode(" 東京 🙂 é", add_special_tokens=False)
    mixed = []
    for i, t in enumerate(out_ids):
        mixed.append(t)
        mixed.append(oov[i % len(oov)])  # also between the bytes of one character
    d = IncrementalDetokenizer(tok, prompt_ids, skip_special_tokens=False)
    feed(d, [oov[0], *mixed])
    d.flush()
    assert d.text == expected_continuation(tok, prompt_ids[:-1], out_ids, False)
    d = IncrementalDetokenizer(tok, [V + 7])
    feed(d, oov)
    d.flush()
    assert d.text == ""


# ---- stop strings ---------------------------------------------------------------------------
def run_engine_like(d: IncrementalDetokenizer, ids: list[int]) -> tuple[str | None, int, list[str]]:
    """Feed tokens as the engine does, taking a delta after each; returns (stop string, step it was
    found at, deltas). visible_text always equals what the deltas have handed out."""
    deltas = []
    for step, t in enumerate(ids):
        stop = d.add_token(t)
        deltas.append(d.delta(finished=stop is not None))
        assert d.visible_text(finished=stop is not None) == "".join(deltas)
        if stop is not None:
            return stop, step, deltas
    d.flush()
    deltas.append(d.delta(finished=True))
    return None, len(ids) - 1, deltas


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("kind", KINDS)
def test_stop_string_trims_text(toks, kind, include):
    tok = toks[kind]
    prompt_ids = tok.encode("Q:")
    out_ids = tok.encode(" café, 東京 and 🙂 more text", add_special_tokens=False)
    d = IncrementalDetokenizer(
        tok, prompt_ids, skip_special_tokens=False, stop=["東京"], include_stop_str_in_output=include
    )
    stop, step, deltas = run_engine_like(d, out_ids)
    assert stop == "東京"
    # found at the first token whose text completes 京
    full = IncrementalDetokenizer(tok, prompt_ids, skip_special_tokens=False)
    texts = feed(full, out_ids)
    assert step == next(i for i, t in enumerate(texts) if "東京" in t)
    assert d.text == (" café, 東京" if include else " café, ")
    assert "".join(deltas) == d.text


@pytest.mark.parametrize("kind", KINDS)
def test_stop_string_spanning_tokens(toks, kind):
    tok = toks[kind]
    prompt_ids = tok.encode("Fact:")
    out_text = " Paris is the capital of France; Berlin is the capital of Germany."
    out_ids = tok.encode(out_text, add_special_tokens=False)
    texts = feed(IncrementalDetokenizer(tok, prompt_ids, skip_special_tokens=False), out_ids)
    assert texts[-1] == out_text
    # Pick a stop string made of the last 2 chars of one token's text and the first 2 of the next.
    boundaries = [len(t) for t in texts]
    cut = next(
        b
        for a, b, c in zip(boundaries, boundaries[1:], boundaries[2:])
        if b - a >= 2 and c - b >= 2 and b > 20
    )
    stop = texts[-1][cut - 2 : cut + 2]
    assert texts[-1].find(stop) == cut - 2  # first occurrence
    for include in (False, True):
        d = IncrementalDetokenizer(
            tok, prompt_ids, skip_special_tokens=False, stop=["zzz", stop], include_stop_str_in_output=include
        )
        found, step, deltas = run_engine_like(d, out_ids)
        assert found == stop
        assert boundaries[step] >= cut + 2 and boundaries[step - 1] <= cut  # completed by 2 tokens
        assert d.text == out_text[: cut + 2 if include else cut - 2]
        assert "".join(deltas) == d.text


@pytest.mark.parametrize("kind", KINDS)
def test_deltas_hold_back_possible_stop_strings(toks, kind):
    tok = toks[kind]
    prompt_ids = tok.encode("Fact:")
    out_text = " Paris is the capital of France; Paris is in Europe. 東京 🙂!"
    out_ids = tok.encode(out_text, add_special_tokens=False)
    full = IncrementalDetokenizer(tok, prompt_ids, skip_special_tokens=False)
    feed(full, out_ids)
    assert full.text == out_text
    # "Paris is in" starts like "Paris is the": the delta must not run past "Paris is " until the
    # text decides; with stop "Paris is in" the text ends before the second "Paris".
    for stops, want in [
        (["Paris is in"], out_text[: out_text.index("Paris is in")]),
        (["capital of Spain", "is in Europe. 東京 🙂?"], full.text),  # never matched: all of it
        (["🙂!"], out_text[: out_text.index("🙂!")]),
        (["京 🙂", "Paris is in"], out_text[: out_text.index("Paris is in")]),
    ]:
        d = IncrementalDetokenizer(tok, prompt_ids, skip_special_tokens=False, stop=stops)
        found, _, deltas = run_engine_like(d, out_ids)
        assert d.text == want
        present = [s for s in stops if s in out_text]
        assert found == (min(present, key=out_text.index) if present else None)
        sent = ""
        for delta in deltas:
            sent += delta
            assert want.startswith(sent)  # never emitted what a stop string later removed
        assert sent == want
        # while unfinished, the last (longest stop - 1) characters stay unsent
        if found is None:
            assert len("".join(deltas[:-1])) <= len(want) - (max(map(len, stops)) - 1)


# ---- the real SmolLM2 tokenizer -------------------------------------------------------------
def test_smollm2_tokenizer_round_trip(smollm2_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    prompt_ids = tok.encode("Translate into many languages:\n")
    out_text = " Héllo wörld! 東京は晴れ 🙂🚀🎉 Привет, мир. Ça va? ¿Qué tal? नमस्ते 👩‍💻 done"
    out_ids = tok.encode(out_text, add_special_tokens=False)
    assert len(out_ids) > len(out_text) // 3  # several multi-token characters
    d = IncrementalDetokenizer(tok, prompt_ids)
    texts = feed(d, out_ids)
    assert d.text == out_text == tok.decode(out_ids)
    assert len(set(texts)) < len(texts)  # incomplete characters were held back
    # with a stop string inside the emoji run, deltas stop right before it
    d = IncrementalDetokenizer(tok, prompt_ids, stop=["🚀🎉"])
    found, _, deltas = run_engine_like(d, out_ids)
    assert found == "🚀🎉"
    assert "".join(deltas) == d.text == out_text[: out_text.index("🚀🎉")]


class _CleaningTokenizer:
    """A tokenizer whose decode cleans up spaces by default (transformers' slow tokenizers, and its
    4.x fast ones with clean_up_tokenization_spaces=True, e.g. Llama-3's): no Rust backend exposed."""

    def __init__(self, fast) -> None:
        self.fast = fast

    def __len__(self) -> int:
        return len(self.fast)

    def decode(self, ids, skip_special_tokens=False, clean_up_tokenization_spaces=True):
        text = self.fast.decode(ids, skip_special_tokens=skip_special_tokens)
        if clean_up_tokenization_spaces:
            for a, b in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" 's", "'s")):
                text = text.replace(a, b)
        return text


@pytest.mark.parametrize("text", [" x != y", " Hello . world . .", " a , b ?", " the word 's end"])
def test_no_space_clean_up(toks, text):
    """As vLLM: text is decoded without transformers' clean-up of spaces, streamed or not (a clean-up
    across the window's edge dropped characters from streamed text: "x != y" came out "x = y")."""
    fast = toks["bpe"]
    tok = _CleaningTokenizer(fast)
    prompt = fast.encode("Q:")
    ids = fast.encode(text, add_special_tokens=False)
    for lazy in (False, True):
        d = IncrementalDetokenizer(tok, prompt, lazy=lazy)
        for t in ids:
            d.add_token(t)
        d.flush()
        assert d.delta(True) == d.text == fast.decode(ids) == text
