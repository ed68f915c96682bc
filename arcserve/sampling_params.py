"""SamplingParams: per-request decoding settings, with vLLM's names and defaults."""

from __future__ import annotations

import copy
import enum
import math
import operator
from dataclasses import dataclass, field

# Below this temperature sampling is greedy (argmax), as in vLLM.
GREEDY_EPS = 1e-5


TRUNCATION_RANGE = "an integer >= 1, or -1 (as many as leave room for max_tokens), or None"


def valid_truncation(k) -> bool:
    """truncate_prompt_tokens: None, -1 or an integer >= 1 (not a bool)."""
    return k is None or (isinstance(k, int) and not isinstance(k, bool) and (k >= 1 or k == -1))


CONSTRAINT_KINDS = ("json", "regex", "choice", "grammar", "json_object")  # StructuredOutputsParams' constraints


@dataclass
class StructuredOutputsParams:
    """A constraint on what a request may generate (vLLM's class and fields; exactly one of json,
    regex, choice, grammar and json_object): the output is held to a JSON schema (json: a schema as
    a dict or its JSON text), a regular expression, one of the choice strings, a grammar (GBNF as
    vLLM's default backend reads it, or Lark), or any JSON object. disable_any_whitespace: JSON with
    no whitespace between its tokens; disable_additional_properties: a schema's objects take only
    the properties it names (where it does not say). Enforced by masking, at every step, the tokens
    that could not continue a valid output (engine/structured.py)."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    # vLLM's, not available here: refused when set (see __post_init__)
    whitespace_pattern: str | None = None
    structural_tag: str | None = None

    def __post_init__(self) -> None:
        if self.whitespace_pattern is not None:
            raise ValueError("structured_outputs.whitespace_pattern is not supported (arcserve's grammar engine "
                             "allows JSON's own whitespace, or none with disable_any_whitespace)")  # fmt: skip
        if self.structural_tag is not None:
            raise ValueError("structured_outputs.structural_tag is not supported; use json, regex, choice, grammar "
                             "or json_object")  # fmt: skip
        kinds = [k for k in CONSTRAINT_KINDS if getattr(self, k) is not None]
        if len(kinds) != 1:
            raise ValueError("structured_outputs must set exactly one of json, regex, choice, grammar and "
                             f"json_object; got {kinds or 'none'}")  # fmt: skip
        kind, v = kinds[0], getattr(self, kinds[0])
        ok = {
            "json": isinstance(v, (str, dict)) and v != "",
            "regex": isinstance(v, str) and v != "",
            "choice": isinstance(v, (list, tuple)) and bool(v) and all(isinstance(c, str) and c for c in v),
            "grammar": isinstance(v, str) and v.strip() != "",
            "json_object": v is True,
        }[kind]
        if not ok:
            want = {"json": "a JSON schema (a dict or its JSON text)", "regex": "a non-empty regular expression",
                    "choice": "a non-empty list of non-empty strings", "grammar": "a non-empty grammar text",
                    "json_object": "true"}[kind]  # fmt: skip
            raise ValueError(f"structured_outputs.{kind} must be {want}, got {v!r}")
        if kind == "choice":
            self.choice = list(v)
        for name in ("disable_any_whitespace", "disable_additional_properties"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"structured_outputs.{name} must be a bool, got {getattr(self, name)!r}")

    @property
    def kind(self) -> str:
        """Which constraint is set: json, regex, choice, grammar or json_object."""
        return next(k for k in CONSTRAINT_KINDS if getattr(self, k) is not None)


class RequestOutputKind(enum.Enum):
    CUMULATIVE = 0  # every output holds everything generated so far
    DELTA = 1  # every output holds only what is new since the last one
    FINAL_ONLY = 2  # one output, when the request finishes


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop. Invalid values raise ValueError at construction."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # top-k logprobs of each sampled token; -1: the whole vocabulary
    prompt_logprobs: int | None = None  # top-k logprobs of every prompt token (after the first); -1 as above
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None  # only these may be sampled (vLLM's name)
    # Keep only the prompt's last k tokens (left truncation; a text prompt's BOS stays in front);
    # -1: as many as leave room for max_tokens (or one token). None: no truncation (a too-long
    # prompt is an error).
    truncate_prompt_tokens: int | None = None
    # Words never to generate (vLLM's semantics): each word, and its form after a space, as token
    # sequences; a sequence's last token is banned wherever the output so far ends with the rest.
    bad_words: list[str] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    detokenize: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # Hold the output to a JSON schema, regex, choice or grammar (vLLM's field; None: unconstrained).
    structured_outputs: StructuredOutputsParams | None = None
    # Filled by the engine: the grammar engine's form of structured_outputs, checked against the tokenizer.
    _grammar: str | None = field(default=None, repr=False)
    # Filled by the engine: the model's EOS ids (config, generation_config and tokenizer).
    _eos_token_ids: frozenset[int] = field(default=frozenset(), repr=False)
    # The tokenizer's EOS; a sequence stopped by another of _eos_token_ids (generation_config's
    # extra ids) reports that id as its stop_reason, as vLLM's stop_token_ids from generation_config.
    _eos_token_id: int | None = field(default=None, repr=False)
    # Filled by the engine from bad_words and the tokenizer.
    _bad_words_token_ids: list[list[int]] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, (list, tuple, type(None))):
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
        self.stop = list(self.stop or [])
        ids = self.stop_token_ids
        if not isinstance(ids, (list, tuple, type(None))) or any(isinstance(t, (bool, float, str)) for t in ids or ()):
            raise ValueError(f"stop_token_ids must be a list of token ids, got {ids!r}")
        self.stop_token_ids = [int(t) for t in (ids or [])]
        if not isinstance(self.output_kind, RequestOutputKind):
            raise ValueError(f"output_kind must be a RequestOutputKind (CUMULATIVE, DELTA, FINAL_ONLY), "
                             f"got {self.output_kind!r}")  # fmt: skip
        # vLLM's readings: logprobs=True is one top logprob (False none); seed -1 is no seed
        self.logprobs, self.prompt_logprobs = (_count(v) for v in (self.logprobs, self.prompt_logprobs))
        if self.seed == -1:
            self.seed = None
        if self.top_k == 0:
            raise ValueError("top_k must be -1 (disabled) or at least 1, got 0")
        self._validate()

    def _validate(self) -> None:
        def bad(name: str, allowed: str) -> ValueError:
            return ValueError(f"{name} must be {allowed}, got {getattr(self, name)!r}")

        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", "an integer >= 1")
        if not 0 <= self.temperature < math.inf:
            raise bad("temperature", "a finite number >= 0")
        if not 0 < self.top_p <= 1:
            raise bad("top_p", "in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < -1 or self.top_k == 0:
            raise bad("top_k", "-1 (disabled) or at least 1")
        if not 0 <= self.min_p <= 1:
            raise bad("min_p", "in [0, 1]")
        if not -2 <= self.presence_penalty <= 2:
            raise bad("presence_penalty", "in [-2, 2]")
        if not -2 <= self.frequency_penalty <= 2:
            raise bad("frequency_penalty", "in [-2, 2]")
        if not 0 < self.repetition_penalty < math.inf:
            raise bad("repetition_penalty", "a finite number > 0")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise bad("max_tokens", "an integer >= 1 (or None for up to max_model_len)")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", "an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens, got min_tokens={self.min_tokens}, "
                f"max_tokens={self.max_tokens}"
            )
        # (how many the engine returns at most is its max_logprobs, checked when a request is added)
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            try:
                k = None if k is None else operator.index(k)
            except TypeError:
                k = -2
            if k is not None and k < -1:
                raise bad(name, "an integer >= 0, or -1 (the whole vocabulary)")
            setattr(self, name, k)
        # Sequence i of the request samples with seed + i, which must stay a 64-bit integer.
        if self.seed is not None and (not isinstance(self.seed, int) or not -(2**63) <= self.seed <= 2**63 - self.n):
            raise bad("seed", f"an integer in [-2**63, 2**63 - n] (n = {self.n})")
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            raise ValueError(f"stop must hold non-empty strings, got {self.stop!r}")
        if self.stop and not self.detokenize:
            raise ValueError("stop strings need detokenize=True (the text is what they are looked for in)")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be >= 0, got {self.stop_token_ids!r}")
        if self.logit_bias:
            for tok, bias in self.logit_bias.items():
                if int(tok) < 0 or not -100 <= float(bias) <= 100:
                    raise ValueError(
                        f"logit_bias maps token ids >= 0 to values in [-100, 100], got {tok}: {bias}"
                    )
            self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
        if not valid_truncation(self.truncate_prompt_tokens):
            raise bad("truncate_prompt_tokens", TRUNCATION_RANGE)
        if self.bad_words is not None:
            if isinstance(self.bad_words, str) or any(not isinstance(w, str) or not w.strip() for w in self.bad_words):
                raise bad("bad_words", "a list of words that are not empty or blank (or None)")
            self.bad_words = list(self.bad_words)
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            try:  # operator.index: ints (numpy's too), not floats or None; bools are refused apart
                if not isinstance(ids, (list, tuple)) or not ids or any(isinstance(t, bool) for t in ids):
                    raise TypeError
                clean = sorted({operator.index(t) for t in ids})
            except TypeError:
                clean = [-1]
            if clean[0] < 0:
                raise bad("allowed_token_ids", "a non-empty list of token ids >= 0 (or None)")
            self.allowed_token_ids = clean
        so = self.structured_outputs
        if isinstance(so, dict):  # (vLLM takes the dataclass; a dict of its fields is read as one)
            try:
                so = self.structured_outputs = StructuredOutputsParams(**so)
            except TypeError as e:
                raise ValueError(f"structured_outputs: {e}") from None
        if so is not None and not isinstance(so, StructuredOutputsParams):
            raise bad("structured_outputs", "a StructuredOutputsParams (or None)")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    @property
    def needs_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    def clone(self) -> SamplingParams:
        """A copy whose containers are the copy's own (their items are immutable): one per request,
        so it must be cheap (a deepcopy took ~0.2 ms)."""
        c = copy.copy(self)
        c.stop, c.stop_token_ids = list(self.stop), list(self.stop_token_ids)  # lists after __post_init__
        if self.logit_bias is not None:
            c.logit_bias = dict(self.logit_bias)
        if self.allowed_token_ids is not None:
            c.allowed_token_ids = list(self.allowed_token_ids)
        if self.bad_words is not None:
            c.bad_words = list(self.bad_words)
        return c


def _count(v):
    """A logprobs count as given, True as 1 and False as None (no logprobs)."""
    if v is True:
        return 1
    return None if v is False else v


@dataclass
class BeamSearchParams:
    """LLM.beam_search's settings (vLLM's names and defaults). Every step extends each of the
    beam_width best sequences by each of its 2 x beam_width most likely tokens (and the one sampled
    at `temperature`, which 0 makes the most likely), and keeps the beam_width best by
    cumulative logprob / length ** length_penalty (length: prompt and output tokens, less a final
    EOS). include_stop_str_in_output: vLLM's field; LLM.beam_search's sequences hold every token
    anyway, and the server's answers keep an ending EOS token with it."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        for name in ("beam_width", "max_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        if not (isinstance(self.temperature, (int, float)) and 0 <= self.temperature < math.inf):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not (isinstance(self.length_penalty, (int, float)) and math.isfinite(self.length_penalty)):
            raise ValueError(f"length_penalty must be a finite number, got {self.length_penalty!r}")
