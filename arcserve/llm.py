"""LLM: the offline Python API (vLLM's names): generate() and chat() over an LLMEngine."""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable, Sequence

from tqdm.auto import tqdm

from arcserve.beam_search import BeamSearchOutput, beam_search
from arcserve.config import EngineArgs
from arcserve.engine.engine import LLMEngine
from arcserve.engine.inputs import add_special_tokens as _add_special_tokens
from arcserve.engine.inputs import refuse_lora
from arcserve.engine.stat_logger import StatLogger, device_label
from arcserve.outputs import RequestOutput
from arcserve.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams


class LLM:
    """Offline inference.

    >>> llm = LLM(model="path/to/hf-folder", dtype="bfloat16")
    >>> out = llm.generate(["Hello"], SamplingParams(max_tokens=32))
    >>> print(out[0].outputs[0].text)
    """

    def __init__(self, model: str | None = None, **kwargs) -> None:
        unknown = set(kwargs) - EngineArgs.field_names()
        if unknown:
            raise TypeError(
                f"LLM() got unknown arguments {sorted(unknown)}; known: {sorted(EngineArgs.field_names())}"
            )
        kwargs.setdefault("disable_log_stats", True)  # vLLM's LLM default: the progress bar says enough
        self.llm_engine = LLMEngine(EngineArgs(model=model, **kwargs))
        self._ids = itertools.count()
        self._stats = None
        if not self.llm_engine.args.disable_log_stats:
            self._stats = StatLogger(self.get_metrics, device_label(self.llm_engine.device))

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLM:
        fields = {f.name: getattr(args, f.name) for f in dataclasses.fields(args)}  # shallow: a policy object stays
        return cls(**fields)

    def get_metrics(self) -> dict:
        """The engine's figures by their Prometheus names (the same ones /metrics serves)."""
        return self.llm_engine.get_metrics()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        return self.llm_engine.default_sampling_params()

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        """Forget every cached prefix (vLLM's name and arguments); False, changing nothing, while a
        request holds KV blocks, unless reset_running_requests (then their blocks are forgotten too:
        later requests do not reuse them). reset_connector: arcserve has no KV connector, so there is
        nothing else to reset."""
        return self.llm_engine.reset_prefix_cache(reset_running_requests)

    def generate(
        self,
        prompts,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool | Callable[..., tqdm] = True,
        lora_request=None,
        priority: int | Sequence[int] | None = None,
        tokenization_kwargs: dict | None = None,
    ) -> list[RequestOutput]:
        """prompts: a string, a list of strings, or {"prompt_token_ids": [...]} dicts (or a list of
        them); a list of token ids is one prompt, as in vLLM. sampling_params and priority: one for
        all prompts or one per prompt. use_tqdm: a bool, or a callable making the progress bar
        (vLLM's). tokenization_kwargs: {"add_special_tokens": False} encodes text prompts without
        the tokenizer's BOS. Results come in input order."""
        refuse_lora(lora_request)
        if isinstance(prompts, (str, dict)) or _token_ids(prompts):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = _per_prompt(sampling_params, len(prompts), "sampling_params")
        prios = _per_prompt(0 if priority is None else priority, len(prompts), "priority")
        return self._run(prompts, params, prios, use_tqdm, tokenization_kwargs)

    def beam_search(self, prompts, params: BeamSearchParams, lora_request=None, use_tqdm: bool = False,
                    concurrency_limit: int | None = None) -> list[BeamSearchOutput]:  # fmt: skip
        """vLLM's beam search (arcserve/beam_search.py): for each prompt (forms as in generate), the
        params.beam_width best sequences, best first; each sequence's tokens and text hold the
        prompt too, as vLLM's. concurrency_limit: how many prompts search at once (all by default)."""
        refuse_lora(lora_request)
        if isinstance(prompts, (str, dict)) or _token_ids(prompts):
            prompts = [prompts]
        def run(batch: list[dict], sp: SamplingParams) -> list[RequestOutput]:
            return self._run(batch, [sp] * len(batch), [0] * len(batch), False)

        return beam_search(self.llm_engine, run, list(prompts), params, use_tqdm, concurrency_limit)

    def chat(
        self,
        messages,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., tqdm] = True,
        lora_request=None,
        priority: int | Sequence[int] | None = None,
        chat_template: str | None = None,
        chat_template_content_format: str = "auto",
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict] | None = None,
        chat_template_kwargs: dict | None = None,
        tokenization_kwargs: dict | None = None,
    ) -> list[RequestOutput]:
        """messages: one conversation (a list of {"role", "content"} dicts; content a string or
        OpenAI text parts) or a list of them; vLLM's parameters, in its order.
        continue_final_message=True (with add_generation_prompt=False) continues the last message;
        tools: definitions the template renders into the prompt (no tool-call parsing);
        tokenization_kwargs: {"add_special_tokens": True} adds the tokenizer's own BOS too."""
        refuse_lora(lora_request)
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        special = _add_special_tokens(tokenization_kwargs, default=False)
        prompts = [
            {"prompt_token_ids": ids, "prompt": text}
            for text, ids in (
                self.llm_engine.apply_chat_template(c, chat_template, add_generation_prompt, chat_template_kwargs,
                                                    continue_final_message, special, tools,
                                                    chat_template_content_format)  # fmt: skip
                for c in convs
            )
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, priority=priority)

    def _run(self, prompts: list, params: list[SamplingParams], priority: list[int], use_tqdm,
             tokenization_kwargs: dict | None = None):  # fmt: skip
        engine = self.llm_engine
        ids = []
        try:
            for prompt, p, prio in zip(prompts, params, priority):
                rid = str(next(self._ids))
                engine.add_request(rid, prompt, p, priority=prio, output_kind=RequestOutputKind.FINAL_ONLY,
                                   tokenization_kwargs=tokenization_kwargs)  # fmt: skip
                ids.append(rid)
        except Exception:
            engine.abort_request(ids)  # leave nothing half-started
            raise
        results: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:  # a factory (vLLM's callable use_tqdm) gets tqdm's arguments but `disable`
            bar = (use_tqdm if callable(use_tqdm) else tqdm)(total=len(ids), desc="Processed prompts",
                                                              dynamic_ncols=True)  # fmt: skip
        start = time.perf_counter()
        in_tok = out_tok = 0
        try:
            while engine.has_unfinished_requests():
                outs = engine.step()
                if self._stats is not None:
                    self._stats.maybe_log()
                for out in outs:
                    if out.finished:
                        results[out.request_id] = out
                        if bar is None:
                            continue
                        in_tok += len(out.prompt_token_ids)
                        out_tok += sum(len(o.token_ids) for o in out.outputs)
                        elapsed = time.perf_counter() - start
                        bar.set_postfix_str(
                            f"est. speed input: {in_tok / elapsed:.2f} toks/s, output: {out_tok / elapsed:.2f} toks/s"
                        )
                        bar.update(1)
        except BaseException:
            engine.abort_request(ids)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [results[i] for i in ids]


def _token_ids(prompts) -> bool:
    """Whether prompts is one prompt's token ids (a non-empty list or tuple of ints)."""
    return (isinstance(prompts, (list, tuple)) and len(prompts) > 0
            and all(isinstance(t, int) and not isinstance(t, bool) for t in prompts))  # fmt: skip




def _per_prompt(value, n: int, name: str) -> list:
    """A sequence: one value per prompt; anything else: the value for every prompt (vLLM's rule)."""
    if not isinstance(value, Sequence) or isinstance(value, str):
        return [value] * n
    values = list(value)
    if len(values) != n:
        raise ValueError(f"Got {len(values)} {name} for {n} prompts; pass one or one per prompt")
    return values
