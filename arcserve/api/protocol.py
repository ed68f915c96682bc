"""Request bodies of the OpenAI API (plus vLLM's extra sampling fields), as pydantic models.

Unknown fields are accepted and ignored (clients send vendor extras); wrong types and out-of-range
values are 400s. to_sampling_params() fills unset fields from the model's generation_config defaults.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from arcserve.sampling_params import MAX_LOGPROBS, SamplingParams

MAX_N = 128
MAX_STOP = 16
MAX_STOP_LEN = 256
MAX_PROMPTS = 1024


class StreamOptions(BaseModel):
    include_usage: bool = False


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
    repetition_penalty: float | None = Field(None, gt=0, le=2)
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: int = 0

    def _stop_list(self) -> list[str]:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stop) > MAX_STOP or any(len(s) > MAX_STOP_LEN for s in stop):
            raise ValueError(f"stop takes at most {MAX_STOP} strings of at most {MAX_STOP_LEN} characters")
        return stop

    def to_sampling_params(self, defaults: dict, max_tokens: int | None, logprobs: int | None,
                           prompt_logprobs: int | None = None) -> SamplingParams:  # fmt: skip
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
        return SamplingParams(
            n=self.n, temperature=pick("temperature", 1.0), top_p=pick("top_p", 1.0),
            top_k=-1 if top_k == 0 else top_k, min_p=pick("min_p", 0.0),
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=pick("repetition_penalty", 1.0), seed=self.seed, max_tokens=max_tokens,
            min_tokens=self.min_tokens, stop=self._stop_list(), stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos, include_stop_str_in_output=self.include_stop_str_in_output,
            logprobs=logprobs, prompt_logprobs=prompt_logprobs, logit_bias=bias,
            skip_special_tokens=self.skip_special_tokens,
        )  # fmt: skip


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

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
            raise ValueError(f"at most {MAX_PROMPTS} prompts per request, got {len(out)}")
        return out


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def as_template_dict(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            content = "".join(p.text for p in content)
        d: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.name:
            d["name"] = self.name
        return d


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    tokens: list[int]
