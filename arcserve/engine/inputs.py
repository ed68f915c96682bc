"""InputProcessor: tokenizer, configs and request validation, without the model.

LLMEngine builds on it; a server front end whose engine runs elsewhere (another process) uses it
alone to tokenize and validate requests before handing them over.
"""

from __future__ import annotations

import logging
import operator
import os
import time

import numpy as np

from arcserve.config import EngineArgs
from arcserve.engine.chat_content import template_messages
from arcserve.engine.output_processor import RequestGroup
from arcserve.engine.policy import FCFSPolicy, make_policy
from arcserve.engine.request import Request
from arcserve.engine.structured import Grammars
from arcserve.models.config import ModelConfig
from arcserve.models.hf_files import load_generation_defaults, load_tokenizer
from arcserve.sampling_params import RequestOutputKind, SamplingParams

log = logging.getLogger("arcserve")
ALLOW_LONG_ENV = "ARCSERVE_ALLOW_LONG_MAX_MODEL_LEN"


def check_max_model_len(max_model_len: int, cfg: ModelConfig, which: str = "this model") -> None:
    """A max_model_len past the positions the model (`which`: the target, or a draft model) was
    trained for is refused (as vLLM does): RoPE there is extrapolated and the outputs silently
    degrade. ARCSERVE_ALLOW_LONG_MAX_MODEL_LEN=1 lets it through with a warning (vLLM's
    VLLM_ALLOW_LONG_MAX_MODEL_LEN). A config.json without max_position_embeddings states no limit."""
    trained = cfg.trained_positions
    if trained is None or max_model_len <= trained:
        return
    what = (f"max_model_len {max_model_len} is longer than the {trained} positions {which} was trained for "
            "(config.json: max_position_embeddings, and the factor of linear RoPE scaling)")  # fmt: skip
    if os.environ.get(ALLOW_LONG_ENV) != "1":
        raise ValueError(f"{what}; outputs past {trained} positions would be unreliable. Lower max_model_len, or "
                         f"set {ALLOW_LONG_ENV}=1 to allow it anyway")  # fmt: skip
    log.warning("%s; allowed by %s=1, outputs past %d positions may be wrong", what, ALLOW_LONG_ENV, trained)


def refuse_lora(lora_request) -> None:
    if lora_request is not None:
        raise ValueError("LoRA adapters are not supported by arcserve (lora_request must be None)")


class InputProcessor:
    def __init__(self, args: EngineArgs) -> None:
        if args.model is None:
            from arcserve.models.demo import demo_model_dir

            args.model = str(demo_model_dir())
        self.args = args
        self.policy = make_policy(args.scheduling_policy)  # (a policy file's errors before the model loads)
        self.model_config = cfg = ModelConfig.from_dir(args.model)
        self.tokenizer = load_tokenizer(args.tokenizer or args.model, args.trust_remote_code)
        self.generation_defaults = load_generation_defaults(args.generation_config, args.model,
                                                            args.override_generation_config)  # fmt: skip
        try:  # (values that no request could use: refused at startup, not at every request)
            self.default_sampling_params()
        except (TypeError, ValueError) as e:
            raise ValueError(f"the generation config's sampling defaults are invalid: {e}") from e
        # EOS: the tokenizer's, and generation_config.json's, or where there is none config.json's (as
        # transformers and vLLM: a generation_config.json replaces config.json's generation keys)
        gen = self.generation_defaults
        eos = set(gen.eos_token_ids if gen.found else cfg.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)
        self.grammars = Grammars(self.tokenizer, cfg.vocab_size, self.eos_token_ids)  # (its tokenizer: when first used)
        self.chat_template: str | None = None  # overrides the tokenizer's (server --chat-template)
        self.max_model_len = args.max_model_len or cfg.max_position_embeddings
        check_max_model_len(self.max_model_len, cfg)

    def logprobs_count(self, name: str, k: int | None) -> int | None:
        """A request's number of logprobs per token (`name` is its parameter): -1 is the whole vocabulary
        (vLLM's); more than max_logprobs is refused (max_logprobs -1: no limit); more than the
        vocabulary gives the whole vocabulary."""
        if k is None:  # (k is an integer >= -1: SamplingParams and the API's models check that)
            return None
        vocab, cap = self.model_config.vocab_size, self.args.max_logprobs
        n = vocab if k == -1 else k
        if cap != -1 and n > cap:
            whole = f" (-1: the whole vocabulary, {n} tokens)" if k == -1 else ""
            raise ValueError(f"{name} must be at most {cap}, this engine's max_logprobs (the server's --max-logprobs); "
                             f"got {k}{whole}")  # fmt: skip
        return min(n, vocab)

    def default_sampling_params(self) -> SamplingParams:
        return SamplingParams(**self.generation_defaults.sampling)

    def tokenize_prompt(self, prompt, add_special_tokens: bool = True) -> tuple[str | None, list[int]]:
        """(text, token ids) of a prompt; text is encoded with the tokenizer's special tokens (a BOS)
        unless add_special_tokens=False."""
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), _int_list(prompt["prompt_token_ids"])
            if isinstance(prompt.get("prompt"), str):
                return prompt["prompt"], self.tokenizer.encode(prompt["prompt"], add_special_tokens=add_special_tokens)
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise ValueError(
            "prompt must be a string, a list of token ids, or a dict with 'prompt' or 'prompt_token_ids'"
        )

    def apply_chat_template(
        self,
        messages: list[dict],
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict | None = None,
        continue_final_message: bool = False,
        add_special_tokens: bool = False,
        tools: list[dict] | None = None,
        content_format: str = "auto",
    ) -> tuple[str, list[int]]:
        """Render a conversation with the tokenizer's (or the given) chat template; returns
        (text, token ids). The template supplies any BOS token itself (add_special_tokens=True: the
        tokenizer adds its own as well, vLLM's request field). continue_final_message: the
        last message (an assistant's, typically) stays open, so generation continues its text
        instead of starting a new turn (then add_generation_prompt must be False, as in vLLM).
        tools: tool definitions for the template to render (no tool-call parsing). content_format
        (vLLM's chat_template_content_format): how messages' content reaches the template, as text
        or as OpenAI parts (chat_content.py)."""
        template = chat_template or self.chat_template
        if template is None and getattr(self.tokenizer, "chat_template", None) is None:
            raise ValueError(
                "This model's tokenizer has no chat template; pass one (chat_template=, --chat-template)"
            )
        messages = template_messages(messages, content_format, template or self.tokenizer.chat_template)
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message must come with add_generation_prompt=false (the last message is "
                             "continued, no new turn is started)")  # fmt: skip
        kwargs = dict(chat_template_kwargs or {})
        reserved = sorted(set(kwargs) & _RESERVED_TEMPLATE_KWARGS)
        if reserved:  # template variables only: no switching the template or the tokenizer's output
            raise ValueError(f"chat_template_kwargs must not set {', '.join(reserved)}")
        try:  # the template runs in transformers' Jinja sandbox, which has no file loader
            text = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt, chat_template=template,
                continue_final_message=continue_final_message, tools=tools, **kwargs,
            )  # fmt: skip
        except Exception as e:  # a template that refuses the conversation, or breaks on it: the request's fault
            raise ValueError(f"could not apply the chat template: {type(e).__name__}: {e}") from e
        if not isinstance(text, str):
            raise ValueError("the chat template did not render to text")
        return text, self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def prompt_tokens(self, prompt, truncate: int | None, max_tokens: int | None,
                      add_special_tokens: bool = True) -> tuple[str | None, list[int]]:  # fmt: skip
        """(text, token ids) of a prompt (tokenize_prompt), cut to its last `truncate` tokens when asked
        (truncate_prompt: a BOS the tokenizer put in front of a text prompt stays there)."""
        from_text = isinstance(prompt, str) or (isinstance(prompt, dict) and "prompt_token_ids" not in prompt)
        return self.truncate_prompt(*self.tokenize_prompt(prompt, add_special_tokens), truncate, max_tokens,
                                    from_text and add_special_tokens)  # fmt: skip

    def truncate_prompt(self, text: str | None, ids: list[int], k: int | None, max_tokens: int | None = None,
                        from_text: bool = False) -> tuple[str | None, list[int]]:  # fmt: skip
        """The prompt's last k tokens (SamplingParams.truncate_prompt_tokens; -1: as many as leave room
        for max_tokens, or for one token), with the text decoded from them when that cut anything;
        unchanged when k is None or the prompt is short enough. from_text: ids are `text` tokenized
        with the tokenizer's special tokens, and the ones it put in front (a BOS) stay in front, as
        the tokenizer's own left truncation keeps them (vLLM's behaviour)."""
        if k is None:
            return text, ids
        if k == -1:
            k = max(1, self.max_model_len - max(1, max_tokens or 1))
        if len(ids) <= k:
            return text, ids
        prefix: list[int] = []
        if from_text and text is not None:
            plain = self.tokenizer.encode(text, add_special_tokens=False)
            n = len(ids) - len(plain)
            if 0 < n < k and ids[n:] == plain:
                prefix = ids[:n]
        body = ids[len(prefix) :][-(k - len(prefix)) :]
        return self.tokenizer.decode(body), prefix + body

    def bad_words_token_ids(self, words: list[str]) -> list[list[int]]:
        """Token sequences of each word as text starts with it and, when that tokenizes to other
        tokens of the same count, after a space (so that the word is banned at the start of the text
        and mid-text alike): vLLM's rule."""
        seqs: list[list[int]] = []
        for word in words:
            bare = self.tokenizer.encode(word.lstrip(), add_special_tokens=False)
            spaced = self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            seqs.append(bare)
            if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
                seqs.append(spaced)
        vocab = self.model_config.vocab_size
        bad = sorted({t for seq in seqs for t in seq if not 0 <= t < vocab})
        if bad:
            raise ValueError(f"bad_words must tokenize to ids in [0, {vocab}); got {bad[:5]}")
        return seqs

    def prepare_request(
        self,
        request_id: str,
        prompt,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        output_kind: RequestOutputKind | None = None,
        tokenization_kwargs: dict | None = None,
    ) -> tuple[RequestGroup, list[Request]]:
        """Tokenize and validate a request without touching engine state (safe from any thread).
        The request gets its own copy of params (with output_kind, when given). tokenization_kwargs
        (vLLM's name): {"add_special_tokens": False} encodes a text prompt without the tokenizer's
        BOS. Raises ValueError naming what is wrong."""
        try:  # (numpy's integers too; one type for every key: keys of mixed types do not compare)
            if isinstance(priority, bool):
                raise TypeError
            priority = operator.index(priority)
        except TypeError:
            raise ValueError(f"priority must be an integer, got {priority!r}") from None
        if priority != 0 and isinstance(self.policy, FCFSPolicy):  # (as vLLM documents; 0.32 ignores it)
            raise ValueError(f"priority {priority} needs a policy that reads it, e.g. scheduling_policy='priority' "
                             "(--scheduling-policy priority); this engine runs 'fcfs'")  # fmt: skip
        params = params or self.default_sampling_params()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        if output_kind is not None and not isinstance(output_kind, RequestOutputKind):
            raise ValueError(f"output_kind must be a RequestOutputKind, got {output_kind!r}")
        if arrival_time is not None and (not isinstance(arrival_time, (int, float)) or isinstance(arrival_time, bool)):
            raise ValueError(f"arrival_time must be a time.time() number, got {arrival_time!r}")
        text, ids = self.prompt_tokens(prompt, params.truncate_prompt_tokens, params.max_tokens,
                                       add_special_tokens(tokenization_kwargs))  # fmt: skip
        params = params.clone()
        params.logprobs = self.logprobs_count("logprobs", params.logprobs)
        params.prompt_logprobs = self.logprobs_count("prompt_logprobs", params.prompt_logprobs)
        params._eos_token_ids, params._eos_token_id = self.eos_token_ids, self.tokenizer.eos_token_id
        if params.bad_words:
            params._bad_words_token_ids = self.bad_words_token_ids(params.bad_words)
        self._validate(ids, params)
        if params.structured_outputs is not None:
            params._grammar = self.grammars.check(params.structured_outputs)
        if output_kind is not None:
            params.output_kind = output_kind
        max_tokens = self.max_model_len - len(ids)
        if params.max_tokens is not None:
            max_tokens = min(max_tokens, params.max_tokens)
        group = RequestGroup(request_id, text, ids, params)
        arrival = time.time() if arrival_time is None else float(arrival_time)
        children = []
        for i in range(params.n):
            child_id = request_id if params.n == 1 else f"{i}_{request_id}"
            req = Request(child_id, ids, params, max_tokens, arrival, priority)
            req.seed = None if params.seed is None else params.seed + i  # the sampler hashes it with the position
            if i > 0:
                req.prompt_logprobs = None  # the prompt is the same for every child: compute once
            children.append(req)
        return group, children

    def validate_prompt(self, ids: list[int]) -> None:
        """A prompt's token ids: at least one, fewer than max_model_len, all in the vocabulary."""
        if not ids:
            raise ValueError("The prompt is empty; give at least one token")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"The prompt has {len(ids)} tokens but max_model_len is {self.max_model_len} "
                f"(the prompt plus at least one generated token must fit)"
            )
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab] if min(ids) < 0 or max(ids) >= vocab else []
        if bad:
            raise ValueError(f"Token ids must be in [0, {vocab}); got {bad[:5]}")

    def _validate(self, ids: list[int], params: SamplingParams) -> None:
        self.validate_prompt(ids)
        vocab = self.model_config.vocab_size
        for t in list(params.logit_bias or {}) + params.stop_token_ids:
            if t >= vocab:
                raise ValueError(f"Token id {t} in logit_bias/stop_token_ids is outside [0, {vocab})")
        allowed = params.allowed_token_ids
        if allowed and allowed[-1] >= vocab:  # sorted
            raise ValueError(f"allowed_token_ids must hold token ids in [0, {vocab}); got {allowed[-1]}")
        if allowed:  # every allowed token masked would leave nothing to sample
            banned = {seq[0] for seq in params._bad_words_token_ids if len(seq) == 1}
            if params.min_tokens > 0:
                banned |= set(params.stop_token_ids) | self.eos_token_ids
            if banned.issuperset(allowed):
                raise ValueError(
                    "allowed_token_ids must hold a token that neither bad_words nor (until min_tokens) EOS and "
                    f"stop_token_ids mask; all of {allowed[:5]} are masked"
                )


def _int_list(ids) -> list[int]:
    """Token ids as a list of Python ints: integer arrays and lists convert in one numpy pass (a
    4,096-token prompt in ~0.1 ms instead of ~0.8 ms), anything else through int() as given."""
    arr = np.asarray(ids) if isinstance(ids, (list, tuple, np.ndarray)) else None
    if arr is not None and arr.ndim == 1 and arr.dtype.kind in "iu":
        return arr.tolist()
    try:  # operator.index: integers only (a float id is a caller's mistake, not an id to round)
        return [operator.index(t) for t in ids]
    except TypeError:
        raise ValueError(f"prompt_token_ids must be a list of integer token ids, got {str(ids)[:80]}") from None


def add_special_tokens(tokenization_kwargs: dict | None, default: bool = True) -> bool:
    """add_special_tokens of vLLM's tokenization_kwargs (`default` when absent: True for text
    prompts, False for chat templates, which put their own in); other keys are refused."""
    kw = dict(tokenization_kwargs or {})
    special = kw.pop("add_special_tokens", default)
    if kw or not isinstance(special, bool):
        raise ValueError(f"tokenization_kwargs takes add_special_tokens (a bool) only; got {tokenization_kwargs!r}")
    return special


# apply_chat_template's own parameters: a request's chat_template_kwargs may not set them
_RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "chat_template", "tokenize", "add_generation_prompt", "continue_final_message", "padding",
    "truncation", "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
    "tools", "documents",
})  # fmt: skip
