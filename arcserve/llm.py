"""LLM: the offline Python API (vLLM's names): generate() and chat() over an LLMEngine."""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Sequence

from tqdm.auto import tqdm

from arcserve.config import EngineArgs
from arcserve.engine.engine import LLMEngine
from arcserve.outputs import RequestOutput
from arcserve.sampling_params import RequestOutputKind, SamplingParams


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
        self.llm_engine = LLMEngine(EngineArgs(model=model, **kwargs))
        self._ids = itertools.count()

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

    def generate(
        self,
        prompts,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: list[int] | None = None,
    ) -> list[RequestOutput]:
        """prompts: a string, a list of strings, or {"prompt_token_ids": [...]} dicts (or a list of
        them). sampling_params: one for all prompts or one per prompt. Results come in input order."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(
                    f"Got {len(params)} sampling_params for {len(prompts)} prompts; pass one or one per prompt"
                )
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"Got {len(priority)} priorities for {len(prompts)} prompts")
        return self._run(prompts, params, priority or [0] * len(prompts), use_tqdm)

    def chat(
        self,
        messages,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict | None = None,
        continue_final_message: bool = False,
    ) -> list[RequestOutput]:
        """messages: one conversation (a list of {"role", "content"} dicts) or a list of them.
        continue_final_message=True (with add_generation_prompt=False) continues the last message."""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [
            {"prompt_token_ids": ids, "prompt": text}
            for text, ids in (
                self.llm_engine.apply_chat_template(c, chat_template, add_generation_prompt, chat_template_kwargs,
                                                    continue_final_message)  # fmt: skip
                for c in convs
            )
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _run(self, prompts: list, params: list[SamplingParams], priority: list[int], use_tqdm: bool):
        engine = self.llm_engine
        ids = []
        try:
            for prompt, p, prio in zip(prompts, params, priority):
                rid = str(next(self._ids))
                engine.add_request(rid, prompt, p, priority=prio, output_kind=RequestOutputKind.FINAL_ONLY)
                ids.append(rid)
        except Exception:
            engine.abort_request(ids)  # leave nothing half-started
            raise
        results: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Processed prompts", dynamic_ncols=True, disable=not use_tqdm)
        start = time.perf_counter()
        in_tok = out_tok = 0
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        results[out.request_id] = out
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
            bar.close()
        return [results[i] for i in ids]
