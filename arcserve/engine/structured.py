"""Structured outputs: outputs held to a JSON schema, regex, choice or grammar (llguidance).

A request's StructuredOutputsParams becomes a grammar in llguidance's form when the request is
prepared (InputProcessor.prepare_request), and is checked there against the tokenizer: a bad schema,
regex or grammar is a ValueError (a 400 from the server) before anything is queued. Each of the
request's sequences gets its own matcher when it joins the engine (matchers cannot be pickled, so
they are made where the engine runs). At every step the sampler asks the matchers of its constrained
rows for the tokens that can continue a valid output (one bit per token, computed on the host by
llguidance's threads for all rows at once), uploads the bits with the step's other arrays and masks
every other token; the engine feeds each sampled token back to its sequence's matcher. Constrained
rows need the previous step's token on the host first (the sampler's _HISTORY): with
overlapped steps such a step is launched up to its LM head, the step before it is read, and then
its sampling is issued (ModelRunner.sample).

Once the output is complete (the grammar can end there) the end-of-sequence ids are allowed; once
it cannot go on, only they are. The model's EOS ids (all of them) are the grammar engine's.
"""

from __future__ import annotations

import copy
import json
import threading
from collections import OrderedDict

import numpy as np
import torch

from arcserve.sampling_params import StructuredOutputsParams

CHECKED_KEPT = 256  # constraints whose checked grammar Grammars keeps

# JSON-schema keywords whose values hold subschemas (by name, or as one schema / a list of them).
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUBSCHEMAS = ("additionalProperties", "unevaluatedProperties", "propertyNames", "contains", "additionalItems",
               "unevaluatedItems", "not", "if", "then", "else", "items", "prefixItems", "allOf", "anyOf", "oneOf")  # fmt: skip


def _no_additional_properties(schema):
    """disable_additional_properties: every object schema that names properties and says nothing of
    others gets additionalProperties false (in place)."""
    if isinstance(schema, list):
        for s in schema:
            _no_additional_properties(s)
    elif isinstance(schema, dict):
        for key in _SCHEMA_MAPS:
            if isinstance(schema.get(key), dict):
                _no_additional_properties(list(schema[key].values()))
        for key in _SUBSCHEMAS:
            if isinstance(schema.get(key), (dict, list)):
                _no_additional_properties(schema[key])
        named = isinstance(schema.get("properties"), dict) or isinstance(schema.get("patternProperties"), dict)
        if named and "additionalProperties" not in schema:
            schema["additionalProperties"] = False
    return schema


def grammar_text(so: StructuredOutputsParams) -> str:
    """The llguidance grammar of a constraint (ValueError naming the field when it is not valid JSON)."""
    import llguidance

    kind = so.kind
    if kind in ("json", "json_object"):
        schema = so.json if kind == "json" else {"type": "object"}
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as e:
                raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
        if not isinstance(schema, dict):
            raise ValueError(f"structured_outputs.json must be a JSON schema object, got {type(schema).__name__}")
        if so.disable_additional_properties:
            schema = _no_additional_properties(copy.deepcopy(schema))
        options = {"whitespace_flexible": not so.disable_any_whitespace}
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)
    if kind == "choice":
        return llguidance.grammar_from("choice", json.dumps(so.choice))
    # "grammar": Lark, or GBNF (llama.cpp's EBNF, which vLLM's default backend reads), told apart by llguidance
    return llguidance.grammar_from("regex" if kind == "regex" else "grammar", getattr(so, kind))


class Grammars:
    """The grammar engine's view of one tokenizer (built at the first structured request, or by warm():
    0.73 s for SmolLM2's 49k-token vocabulary on the 2-core CI VM) and the matchers made over it."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids) -> None:
        self._hf = tokenizer
        self.vocab_size = vocab_size
        self.eos = sorted(eos_token_ids)
        self._tok = None
        self._tok_lock = threading.Lock()  # (the server checks constraints in worker threads)
        self._lock = threading.Lock()
        self._checked: OrderedDict[str, str] = OrderedDict()  # the last CHECKED_KEPT constraints' grammars

    def warm(self) -> None:
        """Build the tokenizer's view in a background thread now (a server, at startup), so that the
        first structured request does not wait for it (or hold up the steps of others)."""
        def build():
            try:
                _ = self.tokenizer
            except ValueError:  # (said again to the first structured request)
                pass

        threading.Thread(target=build, name="arcserve-grammar-tokenizer", daemon=True).start()

    @property
    def tokenizer(self):
        with self._tok_lock:
            if self._tok is None:
                import llguidance.hf

                try:
                    self._tok = llguidance.hf.from_tokenizer(self._hf, n_vocab=max(self.vocab_size, len(self._hf)),
                                                             eos_token=self.eos or None)  # fmt: skip
                except Exception as e:  # (a slow, Python-only tokenizer: llguidance reads fast ones)
                    raise ValueError(f"structured outputs need a fast (tokenizers) tokenizer; this model's could not "
                                     f"be read by the grammar engine: {type(e).__name__}: {e}") from None  # fmt: skip
            return self._tok

    def check(self, so: StructuredOutputsParams) -> str:
        """The constraint's grammar, checked against the tokenizer; ValueError naming what is wrong.
        The grammars of recent constraints are kept (a server checks a request's constraint before it
        queues it, then the engine's request preparation checks it again; clients often repeat one schema)."""
        import llguidance

        try:
            key = json.dumps([so.kind, getattr(so, so.kind), so.disable_any_whitespace,
                              so.disable_additional_properties], sort_keys=True)  # fmt: skip
        except (TypeError, ValueError) as e:
            raise ValueError(f"structured_outputs.{so.kind} must be JSON data: {e}") from None
        with self._lock:
            if key in self._checked:
                self._checked.move_to_end(key)
                return self._checked[key]
        try:
            grammar = grammar_text(so)
        except Exception as e:  # (the grammar engine's own refusals included)
            if isinstance(e, ValueError) and str(e).startswith("structured_outputs"):
                raise
            raise ValueError(f"structured_outputs.{so.kind} is not valid: {e}") from None
        err = llguidance.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if err:
            raise ValueError(f"structured_outputs.{so.kind} is not valid: {err.strip()}")
        with self._lock:
            self._checked[key] = grammar
            if len(self._checked) > CHECKED_KEPT:
                self._checked.popitem(last=False)
        return grammar

    def matchers(self, grammar: str, n: int) -> list[Constraint]:
        """Fresh matchers of a checked grammar, one per sequence: built once (its parser, ~10-20 ms
        for a schema of a dozen fields) and copied for the others."""
        import llguidance

        m = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if m.is_error():
            raise ValueError(f"structured_outputs: {m.get_error()}")
        words = (self.tokenizer.vocab_size + 31) // 32
        return [Constraint(m if i == 0 else m.deep_copy(), words) for i in range(n)]


class Constraint:
    """One sequence's matcher: where its output stands in the grammar."""

    __slots__ = ("matcher", "words")

    def __init__(self, matcher, words: int) -> None:
        self.matcher, self.words = matcher, words

    @property
    def only_eos(self) -> bool:
        """The output cannot go on: complete with nowhere further to go (or the grammar engine failed)."""
        return self.matcher.is_stopped() or self.matcher.is_error()

    def advance(self, token: int) -> str | None:
        """Feed a sampled token (always one the mask allowed) to the matcher; after the grammar's end
        only EOS is allowed, which ends the sequence (under ignore_eos it repeats). Returns the
        grammar engine's error when this token put the matcher in its error state (a limit of its
        own reached: from then on EOS alone is allowed)."""
        if self.only_eos:
            return None
        return None if self.matcher.consume_token(token) else (self.matcher.get_error() or "unknown error")


_executor = None


def fill(constraints: list[Constraint], bits: np.ndarray) -> None:
    """bits [rows, words] int32 (C-contiguous): bit t % 32 of word t // 32 of row i is set where
    constraints[i] allows token t next (llguidance's threads compute the rows side by side)."""
    global _executor
    words = constraints[0].words
    assert bits.shape == (len(constraints), words) and bits.dtype == np.int32 and bits.flags.c_contiguous
    if len(constraints) == 1:
        constraints[0].matcher.unsafe_compute_mask_ptr(bits.ctypes.data, bits.nbytes)
        return
    if _executor is None:
        import llguidance

        _executor = llguidance.LLExecutor()
    _executor.unsafe_compute_mask_ptr([(c.matcher, i) for i, c in enumerate(constraints)], bits.ctypes.data,
                                      words * 4, len(constraints))  # fmt: skip


def banned(bits: torch.Tensor, vocab: int) -> torch.Tensor:
    """[rows, vocab] bool, True where fill's words do not allow the token (on any device; read a byte
    at a time: token t is bit t % 8 of byte t // 8 of the little-endian words)."""
    shifts = torch.arange(8, device=bits.device, dtype=torch.uint8)
    by = bits.view(torch.uint8)
    return ((by[:, :, None] >> shifts) & 1).view(by.shape[0], -1)[:, :vocab] == 0
