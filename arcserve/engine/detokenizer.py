"""Incremental detokenization and stop strings.

Text is decoded from a sliding window of token ids: decode(window) minus decode(window without the
newest tokens) is the new text. The window starts with a few prompt tokens so that tokenizers that
drop a leading space at the start of a decode (SentencePiece) or merge bytes across tokens (byte-level
BPE) produce the same text as decoding everything at once. Text ending in U+FFFD (an incomplete
UTF-8 sequence) is held back until the next token completes it; a sequence that ends before it is
complete leaves those bytes out of its text.

Ids the tokenizer does not know (checkpoints pad vocab_size past the tokenizer) decode to nothing.

A request that needs no text before it ends (final-only output, no stop strings: LLM.generate, a
non-streaming completion) is detokenized lazily: its tokens are collected and decoded in one
window when the text is asked for, which gives the same text at a fraction of the per-token cost.
"""

from __future__ import annotations

import functools

_CONTEXT = 5  # prompt tokens kept in front of the window


def decoder_of(tokenizer):
    """decode(ids, skip_special_tokens=...) without transformers' clean-up of spaces (as vLLM
    decodes): the clean-up rewrites text across the window's edge (" ." -> "."), so streamed deltas
    would lose characters and disagree with the whole text. A fast tokenizer's Rust backend is
    called directly (it never cleans up; ~3x cheaper per call than the Python wrapper)."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is not None:
        return backend.decode
    return functools.partial(tokenizer.decode, clean_up_tokenization_spaces=False)


class TokenTexts:
    """Text of single token ids (logprob entries), decoded once per id: an id decodes alike always."""

    def __init__(self, tokenizer) -> None:
        self.decode = decoder_of(tokenizer)
        self.vocab_len = len(tokenizer)
        self.cache: dict[int, str] = {}

    def __call__(self, tid: int) -> str:
        s = self.cache.get(tid)
        if s is None:
            s = self.cache[tid] = self.decode([tid], skip_special_tokens=False) if tid < self.vocab_len else ""
        return s


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer,
        prompt_token_ids: list[int],
        skip_special_tokens: bool = True,
        stop: list[str] | None = None,
        include_stop_str_in_output: bool = False,
        lazy: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_len = len(tokenizer)
        self._decode_fn = decoder_of(tokenizer)  # two calls per token
        self.skip_special = skip_special_tokens
        self.stop = stop or []
        self.include_stop = include_stop_str_in_output
        # Stop strings can straddle deltas: keep this many trailing chars unsent until we know.
        self.holdback = max((len(s) for s in self.stop), default=1) - 1
        self.ids = [t for t in prompt_token_ids[-_CONTEXT:] if t < self.vocab_len]
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""
        self.sent = 0  # chars of text already handed out as deltas
        self.lazy = lazy and not self.stop  # stop strings are looked for at every token

    def _decode(self, ids: list[int]) -> str:
        return self._decode_fn(ids, skip_special_tokens=self.skip_special)

    def add_token(self, token: int, check_stop: bool = True) -> str | None:
        """Append a token; return the stop string if the text now contains one (text is trimmed).
        check_stop=False (before min_tokens) decodes without looking for stop strings."""
        if token < self.vocab_len:
            self.ids.append(token)
        if self.lazy:
            return None
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return None
        before = len(self.text)
        self.text += full[len(prefix) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return self._check_stop(before) if check_stop else None

    def _check_stop(self, before: int) -> str | None:
        """The stop string that occurs first in text that ends after `before` (trimmed there)."""
        best = None
        for s in self.stop:
            i = self.text.find(s, max(0, before - len(s) + 1))
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return None
        i, s = best
        self.text = self.text[: i + len(s)] if self.include_stop else self.text[:i]
        return s

    def flush(self) -> None:
        """At the end: emit what is pending except an incomplete character at the very end (its
        bytes never became a character; vLLM's text leaves them out too), so the final text is the
        streamed deltas' and never ends in U+FFFD that the model did not write."""
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) > len(prefix):
            self.text += full[len(prefix) :].rstrip("\ufffd")
        self.prefix_offset = self.read_offset = len(self.ids)

    def _catch_up(self) -> None:
        """Lazy mode: decode the tokens collected since the last call, giving what add_token would
        have: one window when that ends on a whole character, else token by token."""
        if not self.lazy or self.read_offset >= len(self.ids):
            return
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.text += full[len(prefix) :]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return
        pending = self.ids[self.read_offset :]
        del self.ids[self.read_offset :]
        self.lazy = False
        for t in pending:
            self.add_token(t, check_stop=False)
        self.lazy = True

    def delta(self, finished: bool) -> str:
        """New text since the last call, holding back a possible partial stop string."""
        self._catch_up()
        end = len(self.text) if finished else max(self.sent, len(self.text) - self.holdback)
        out = self.text[self.sent : end]
        self.sent = end
        return out

    def visible_text(self, finished: bool) -> str:
        self._catch_up()
        end = len(self.text) if finished else max(self.sent, len(self.text) - self.holdback)
        return self.text[:end]
