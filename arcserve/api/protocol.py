"""Request bodies of the OpenAI API (plus vLLM's extra sampling fields), as pydantic models.

Unknown fields are accepted and ignored (clients send vendor extras); wrong types and out-of-range
values are 400s, and so are known fields asking for what arcserve cannot do (tool calls, suffix...:
unsupported()), rather than being answered as if they were not there.
to_sampling_params() fills unset fields from the model's generation_config defaults.
Limits: n <= MAX_N; at most MAX_STOP stop strings (and bad_words) of at most MAX_STOP_LEN characters;
at most MAX_PROMPTS prompts and MAX_CHOICES choices (prompts x n) per request; seed + n - 1 fits in
int64; prompts, messages, stop strings and bad_words must be valid Unicode (JSON can carry lone
surrogates such as "\\ud800", which tokenizers and UTF-8 refuse).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError, field_validator

from arcserve.api import tools
from arcserve.engine.chat_content import join_texts, text_of_part
from arcserve.sampling_params import (
    TRUNCATION_RANGE,
    BeamSearchParams,
    SamplingParams,
    StructuredOutputsParams,
    valid_truncation,
)

MAX_N = 128
MAX_STOP = 16
MAX_STOP_LEN = 256
MAX_PROMPTS = 1024
MAX_CHOICES = 1024  # prompts x n: each choice is a sequence in the engine
MAX_SEED = 2**63 - 1  # the engine samples choice i with seed + i, a signed 64-bit integer


def _valid_unicode(value, name: str):
    """value (a str, or a list of str, text parts and other items) unchanged, or ValueError naming `name`
    when a string holds a lone surrogate (valid JSON, not valid Unicode: tokenizers and UTF-8 refuse it)."""
    if isinstance(value, list) and value and not isinstance(value[0], (str, ContentPart)):
        return value  # token ids (the lists are of one kind)
    for s in [value] if isinstance(value, str) else value if isinstance(value, list) else ():
        s = s.text if isinstance(s, ContentPart) else s
        if isinstance(s, str) and not s.isascii():
            try:
                s.encode("utf-8")
            except UnicodeEncodeError as e:
                raise ValueError(
                    f"{name} must be valid Unicode text; got a lone surrogate {s[e.start]!r} at character {e.start}"
                ) from None
    return value


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: with include_usage, usage so far in every chunk too


class JsonSchemaFormat(BaseModel):
    """OpenAI's response_format json_schema: the schema (under "schema") and fields arcserve does not use."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="allow")  # other types' fields: such types are refused
    type: str
    json_schema: JsonSchemaFormat | None = None




class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM extras
    top_k: int | None = None
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0)
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: list[StrictInt] | None = None
    allowed_token_ids: list[StrictInt] | None = None
    prompt_logprobs: int | None = Field(None, ge=-1)  # not with stream (as in vLLM); -1 and the limit as logprobs
    bad_words: list[str] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: int = 0
    return_token_ids: bool = False  # vLLM's: the prompt's and the answer's token ids in the response
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs and its older guided_*
    # fields (api/constraints.py; engine/structured.py). guided_decoding_backend is ignored (one backend).
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    # vLLM's beam search: n is the beam width (arcserve/beam_search.py)
    use_beam_search: bool | None = None
    length_penalty: float = Field(1.0, allow_inf_nan=False)
    # a vLLM sampling extra arcserve does not implement: refused when it asks for something
    logits_processors: list[Any] | None = None
    return_tokens_as_token_ids: bool | None = None  # logprobs name tokens "token_id:<id>" (vLLM's)
    truncate_prompt_tokens: int | None = None  # keep the prompt's last k tokens; -1: room for max_tokens

    @field_validator("n", "presence_penalty", "frequency_penalty", "stream", "min_tokens", "ignore_eos",
                     "skip_special_tokens", "include_stop_str_in_output", "priority", "return_token_ids", "echo", "logprobs",
                     "add_special_tokens", mode="before", check_fields=False)  # fmt: skip  (the last three: subclasses')
    @classmethod
    def _null_is_default(cls, v, info):  # OpenAI's spec lets clients send null for "the default"
        return cls.model_fields[info.field_name].default if v is None else v

    @field_validator("model", mode="before")
    @classmethod
    def _empty_model(cls, v):  # "" names no model: the served one (as vLLM)
        return None if v == "" else v

    def unsupported(self) -> tuple[str, str] | None:
        """(parameter, message) of the first field set to something arcserve cannot honour, if any."""
        if self.stream_options is not None and not self.stream:
            return "stream_options", "stream_options needs stream=true (as in vLLM)"
        if self.prompt_logprobs is not None and self.stream:
            return "prompt_logprobs", "prompt_logprobs are not available with stream=true (as in vLLM)"
        if self.logits_processors:
            return "logits_processors", "logits_processors is not supported by arcserve; leave it out"
        if self.use_beam_search:
            got = self._beam_search_unsupported()
            if got is not None:
                return got
        if self.guided_whitespace_pattern is not None:
            return "guided_whitespace_pattern", ("guided_whitespace_pattern is not supported (arcserve's grammar engine "
                                                 "allows JSON's own whitespace, or none with disable_any_whitespace)")  # fmt: skip
        rf = self.response_format
        if rf is not None and rf.type not in ("text", "json_object", "json_schema"):
            return "response_format", (
                f"response_format {{'type': {rf.type!r}}} is not supported; use 'text', 'json_object' or 'json_schema'"
            )
        return None

    def _beam_search_unsupported(self) -> tuple[str, str] | None:
        """use_beam_search scores the model's own logprobs: fields that would change or filter them are
        refused rather than ignored (vLLM ignores them); seed is accepted and unused."""
        if self.prompt_logprobs is not None:
            return "prompt_logprobs", "use_beam_search computes no prompt logprobs; leave prompt_logprobs out"
        filters = {"stop": self.stop, "stop_token_ids": self.stop_token_ids, "logit_bias": self.logit_bias,
                   "allowed_token_ids": self.allowed_token_ids, "bad_words": self.bad_words, "min_tokens": self.min_tokens,
                   "top_p": self.top_p not in (None, 1), "top_k": self.top_k not in (None, 0, -1),
                   "min_p": self.min_p not in (None, 0), "presence_penalty": self.presence_penalty,
                   "frequency_penalty": self.frequency_penalty,
                   "repetition_penalty": self.repetition_penalty not in (None, 1)}  # fmt: skip
        for name, v in filters.items():
            if v:
                return name, (f"{name} does not apply to use_beam_search: beams are scored by the model's logprobs, "
                              "with n, max_tokens, temperature, length_penalty, ignore_eos, include_stop_str_in_output "
                              f"and skip_special_tokens; leave {name} out")  # fmt: skip
        if self.stream:
            return "stream", "use_beam_search does not stream (as vLLM's completions); send stream=false"
        return None

    def to_beam_search_params(self, defaults: dict, max_tokens: int) -> BeamSearchParams:
        """vLLM's reading: n is the beam width; temperature as for sampling (the generation config's, else 1.0)."""
        temperature = self.temperature if self.temperature is not None else defaults.get("temperature", 1.0)
        return BeamSearchParams(beam_width=self.n, max_tokens=max_tokens, ignore_eos=self.ignore_eos,
                                temperature=temperature, length_penalty=self.length_penalty,
                                include_stop_str_in_output=self.include_stop_str_in_output,
                                skip_special_tokens=self.skip_special_tokens)  # fmt: skip

    # Wrong types get one clear message each (pydantic's names a member of the union: "stop.str").
    @field_validator("stop", mode="wrap")
    @classmethod
    def _stop_shape(cls, v, handler):
        try:
            return handler(v)
        except ValidationError:
            raise ValueError("stop must be a string or a list of strings") from None

    @field_validator("stop")
    @classmethod
    def _unicode_stop(cls, v):
        return _valid_unicode(v, "stop")

    @field_validator("bad_words")
    @classmethod
    def _bad_words(cls, v):
        if v is not None and (len(v) > MAX_STOP or any(len(w) > MAX_STOP_LEN for w in v)):
            raise ValueError(f"bad_words must hold at most {MAX_STOP} words of at most {MAX_STOP_LEN} characters each")
        return _valid_unicode(v, "bad_words")

    @field_validator("truncate_prompt_tokens")  # checked here: the server truncates before SamplingParams exist
    @classmethod
    def _truncation(cls, v):
        if not valid_truncation(v):
            raise ValueError(f"truncate_prompt_tokens must be {TRUNCATION_RANGE}")
        return v

    def _stop_list(self) -> list[str]:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        longest = max(map(len, stop), default=0)
        if len(stop) > MAX_STOP or longest > MAX_STOP_LEN:
            raise ValueError(
                f"stop must hold at most {MAX_STOP} strings of at most {MAX_STOP_LEN} characters each; got "
                f"{len(stop)} string(s), the longest of {longest} characters"
            )
        return stop

    def _check_seed(self) -> None:
        if self.seed is not None and self.seed + self.n - 1 > MAX_SEED:
            raise ValueError(
                f"seed must be at most 2**63 - n = {MAX_SEED + 1 - self.n} with n={self.n} (choice i samples with "
                f"seed + i, a signed 64-bit integer); got {self.seed}"
            )

    def to_sampling_params(self, defaults: dict, max_tokens: int | None, logprobs: int | None,
                           prompt_logprobs: int | None = None,
                           structured: StructuredOutputsParams | None = None) -> SamplingParams:  # fmt: skip
        def pick(name: str, fallback):
            v = getattr(self, name)
            return v if v is not None else defaults.get(name, fallback)

        bias = None
        if self.logit_bias:
            try:
                bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            except ValueError as e:
                raise ValueError("logit_bias keys must be token ids (integers as strings)") from e
        top_k = pick("top_k", -1)
        self._check_seed()
        return SamplingParams(
            n=self.n, temperature=pick("temperature", 1.0), top_p=pick("top_p", 1.0),
            top_k=-1 if top_k == 0 else top_k, min_p=pick("min_p", 0.0),
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=pick("repetition_penalty", 1.0), seed=self.seed, max_tokens=max_tokens,
            min_tokens=self.min_tokens, stop=self._stop_list(), stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos, include_stop_str_in_output=self.include_stop_str_in_output,
            logprobs=logprobs, prompt_logprobs=prompt_logprobs, logit_bias=bias, allowed_token_ids=self.allowed_token_ids,
            truncate_prompt_tokens=self.truncate_prompt_tokens, bad_words=self.bad_words,
            skip_special_tokens=self.skip_special_tokens, structured_outputs=structured,
        )  # fmt: skip


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]]  # strict: true/false are no token ids
    echo: bool = False  # (before max_tokens: its check reads echo)
    max_tokens: int = Field(16, ge=0)  # 0 only with echo: the prompt scored, nothing generated (vLLM); null: 16
    logprobs: int | None = Field(None, ge=-1)  # -1: the whole vocabulary; at most --max-logprobs
    suffix: str | None = None
    best_of: int | None = None
    add_special_tokens: bool = True  # vLLM's: the tokenizer's BOS (and the like) in front of text prompts

    @field_validator("max_tokens", mode="before")
    @classmethod
    def _null_max_tokens_is_the_default(cls, v):
        return 16 if v is None else v  # (vLLM's server: null is the default, not "no limit")

    @field_validator("max_tokens")
    @classmethod
    def _max_tokens_zero_needs_echo(cls, v, info):
        if v == 0 and not info.data.get("echo"):
            raise ValueError("max_tokens must be at least 1 (0 only with echo=true: the prompt alone, scored)")
        return v

    @property
    def echo_only(self) -> bool:
        """echo with max_tokens 0: the engine makes one token, which the response leaves out."""
        return self.echo and self.max_tokens == 0

    def unsupported(self) -> tuple[str, str] | None:
        if self.suffix is not None:
            return "suffix", "suffix is not supported"
        if self.use_beam_search and self.echo and self.logprobs is not None:  # (vLLM's rule)
            return "echo", "echo with logprobs needs the prompt's logprobs, which use_beam_search does not compute"
        return super().unsupported()

    @field_validator("prompt", mode="wrap")
    @classmethod
    def _prompt_shape(cls, v, handler):  # one clear message, as for stop
        try:
            return handler(v)
        except ValidationError:
            raise ValueError(
                "prompt must be a string, a list of strings, a list of token ids (integers) or a list of such lists"
            ) from None

    @field_validator("prompt")
    @classmethod
    def _unicode_prompt(cls, v):
        return _valid_unicode(v, "prompt")

    def prompts(self) -> list:
        """The prompt(s) as a list of str or {"prompt_token_ids": [...]}."""
        p = self.prompt
        if isinstance(p, str):
            out = [p]
        elif p and all(isinstance(x, int) for x in p):
            out = [{"prompt_token_ids": p}]
        elif p and all(isinstance(x, list) for x in p):
            out = [{"prompt_token_ids": x} for x in p]
        else:
            out = list(p)
        if not out:
            raise ValueError("prompt must not be empty")
        if len(out) > MAX_PROMPTS:
            raise ValueError(f"prompt must hold at most {MAX_PROMPTS} prompts per request, got {len(out)}")
        if len(out) * self.n > MAX_CHOICES:
            raise ValueError(
                f"n must be at most {MAX_CHOICES // len(out)} with {len(out)} prompts (at most {MAX_CHOICES} "
                f"choices, prompts x n, per request); got n={self.n}"
            )
        return out


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: str = Field(..., min_length=1)  # OpenAI's roles, or any other the template knows (vLLM's custom roles)
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls (history for the template)
    tool_call_id: str | None = None  # a tool message's answer to one
    reasoning: str | None = None  # an assistant's earlier thinking (templates of reasoning models render it)
    reasoning_content: str | None = None  # (its older name)

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts(cls, v):  # (checked here: an error inside a union member reads "should be a valid string")
        return [{"type": "text", "text": text_of_part(p)} for p in v] if isinstance(v, list) else v

    @field_validator("content", "name")
    @classmethod
    def _unicode(cls, v, info):
        return _valid_unicode(v, info.field_name)

    @property
    def text(self) -> str:
        """The content as text, text parts joined as the "string" content format joins them."""
        content = self.content
        return join_texts(p.text for p in content) if isinstance(content, list) else content or ""

    def as_template_dict(self) -> dict[str, Any]:
        """The message as given, for apply_chat_template to shape as the template reads it (text or
        parts: engine/chat_content.py)."""
        content = self.content
        if isinstance(content, list):
            content = [{"type": "text", "text": p.text} for p in content]
        d: dict[str, Any] = {"role": self.role, "content": content}
        if self.name:
            d["name"] = self.name
        if self.tool_call_id is not None:
            d["tool_call_id"] = self.tool_call_id
        if self.tool_calls:  # (their JSON arguments are parsed for the template in engine/chat_content.py)
            d["tool_calls"] = self.tool_calls
        thinking = self.reasoning if self.reasoning is not None else self.reasoning_content
        if thinking is not None:  # under both names, as vLLM hands it to templates
            d["reasoning"] = d["reasoning_content"] = thinking
        return d


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=-1)  # -1: the whole vocabulary; at most --max-logprobs
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False  # vLLM's: the template puts BOS in; True adds the tokenizer's too
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: str | None = None  # a template variable; "none" turns thinking off (enable_thinking), as vLLM
    chat_template: str | None = None  # used only when the server trusts request templates (vLLM's rule)
    echo: bool = False  # the last message's content in front of the answer, when it is the answer's role
    # Tools reach the chat template. A call the request forces (tool_choice "required" or a function
    # named) is generated under a JSON schema and answered as tool_calls (api/tools.py); "auto" (the
    # default with tools) needs a parser of free text and is refused, as are the legacy functions.
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None

    def unsupported(self) -> tuple[str, str] | None:
        if self.functions:
            return "functions", "functions (the legacy form of tools) are not supported; send tools"
        if self.function_call is not None and self.function_call not in ("none", "auto"):
            return "function_call", f"function_call {self.function_call!r} is not supported; send tool_choice"
        if self.tools and self.tool_choice in (None, "auto"):
            return "tool_choice", (
                "tool_choice 'auto' (the default with tools) is not supported: it needs a model-specific parser of tool "
                "calls in free text, which arcserve does not have; send tool_choice 'required', name a function "
                "({'type': 'function', 'function': {'name': ...}}), or 'none' to have the tools only shown to the model"
            )  # fmt: skip
        return super().unsupported()

    @property
    def forced_call(self) -> str | None:
        """The function tool_choice names, "required", or None (FieldError for a choice that cannot be met)."""
        return tools.forced(self.tool_choice, self.tools)


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # the tokenizer's own special tokens: prompt True, messages False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None  # with messages, as in a chat request
    reasoning_effort: str | None = None  # (as a chat request's: so the counts match)
    tools: list[dict[str, Any]] | None = None  # rendered by the template, as in a chat request
    chat_template: str | None = None  # only where the server trusts request templates

    @field_validator("prompt")
    @classmethod
    def _unicode_prompt(cls, v):
        return _valid_unicode(v, "prompt")


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    tokens: list[StrictInt]
