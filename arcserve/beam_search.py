"""Beam search over the offline API (LLM.beam_search; vLLM's names, algorithm and scores).

Each step is one batch of ordinary one-token requests, one per live beam, asking for 2 x beam_width
logprobs; the beam's whole token list is its prompt, so prefix caching leaves each step only the
tokens past the beam's last full block to compute. Candidates are scored as vLLM scores them (its
port of transformers' length penalty): cumulative logprob / length ** length_penalty, the length
counting the prompt, less a final EOS.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from tqdm.auto import tqdm

from arcserve.outputs import CompletionOutput, Logprob, RequestOutput
from arcserve.sampling_params import BeamSearchParams, SamplingParams


@dataclass
class BeamSearchSequence:
    """One sequence of a beam search: tokens holds the prompt's and the generated ones, text (filled
    when the search ends) decodes all of them, logprobs has one dict per generated token (its
    candidates: the top 2 x beam_width and the sampled one)."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None  # "stop" (an EOS id) or "length" (max_tokens or max_model_len)
    stop_reason: int | None = None  # the EOS id that finished it


@dataclass
class BeamSearchOutput:
    """The best sequences of one prompt, best first (at most beam_width of them)."""

    sequences: list[BeamSearchSequence]


def score(seq: BeamSearchSequence, eos_ids: frozenset[int] | set[int], length_penalty: float) -> float:
    n = len(seq.tokens) - (seq.tokens[-1] in eos_ids)
    return seq.cum_logprob / (max(n, 1) ** length_penalty)


def check_width(engine, width: int, name: str = "beam_width") -> None:
    """A step asks for 2 x width logprobs: refused, naming the width's parameter, where the engine's
    max_logprobs is lower."""
    try:
        engine.logprobs_count("logprobs", 2 * width)
    except ValueError:
        cap = engine.args.max_logprobs
        raise ValueError(f"{name} must be at most {cap // 2}: each beam-search step asks for 2 x {name} logprobs, "
                         f"and this engine's max_logprobs (the server's --max-logprobs) is {cap}; -1 lifts the "
                         "limit") from None  # fmt: skip


def beam_search(engine, run: Callable[[list[dict], SamplingParams], list[RequestOutput]], prompts: Sequence,
                params: BeamSearchParams, use_tqdm: bool = False,
                concurrency_limit: int | None = None) -> list[BeamSearchOutput]:  # fmt: skip
    """The search for every prompt (each a string, or a {"prompt_token_ids": [...]} or {"prompt": ...}
    dict) on `engine` (an LLMEngine); run(prompts, params) runs requests to their end, outputs in
    order (LLM.beam_search passes its own loop). concurrency_limit: how many prompts search at once
    (all by default). Raises ValueError before any work for a beam_width whose 2 x beam_width
    logprobs per step the engine's max_logprobs refuses, and for a prompt the engine refuses."""
    if not isinstance(params, BeamSearchParams):
        raise ValueError(f"params must be a BeamSearchParams, got {type(params).__name__}")
    check_width(engine, params.beam_width)
    if concurrency_limit is not None and (not isinstance(concurrency_limit, int) or concurrency_limit < 1):
        raise ValueError(f"concurrency_limit must be an integer >= 1 or None, got {concurrency_limit!r}")
    starts = []
    for p in prompts:
        _, ids = engine.prompt_tokens(p, None, params.max_tokens)
        engine.validate_prompt(ids)
        starts.append(ids)
    limit = concurrency_limit or max(1, len(starts))
    results = []
    for first in range(0, len(starts), limit):
        search = Search(engine, starts[first : first + limit], params)
        bar = tqdm(total=params.max_tokens, desc="Beam search", unit="token") if use_tqdm else None
        while prompts_now := search.requests():
            search.advance(run(prompts_now, search.step))
            if bar is not None:
                bar.update(1)
        if bar is not None:
            bar.close()
        results += search.outputs()
    for out in results:
        for seq in out.sequences:
            seq.text = engine.tokenizer.decode(seq.tokens, skip_special_tokens=params.skip_special_tokens)
    return results


async def search_each(engine, searches: list[tuple[list[int], BeamSearchParams]],
                      run: Callable[[list[dict], SamplingParams], Awaitable[list[RequestOutput]]]) -> list[BeamSearchOutput]:  # fmt: skip
    """One search a prompt (token ids, each with its own params), side by side, for an async caller
    (the server): await run(prompts, params) runs a step's requests. One search failing ends the
    others (cancelled, and awaited, before the error goes on)."""

    async def one(ids: list[int], params: BeamSearchParams) -> BeamSearchOutput:
        search = Search(engine, [ids], params)
        while prompts := search.requests():
            search.advance(await run(prompts, search.step))
        return search.outputs()[0]

    tasks = [asyncio.ensure_future(one(ids, params)) for ids, params in searches]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class Search:
    """The search over a batch of prompts (token ids), all prompts' beams in one batch of requests a
    step: requests() gives the step's prompts (None when the search is over), advance() takes their
    outputs in order, outputs() the best sequences at the end. A driver runs the requests (LLM's
    loop, or the server's engine client)."""

    def __init__(self, engine, starts: list[list[int]], params: BeamSearchParams) -> None:
        self.params, self.max_len, self.eos = params, engine.max_model_len, engine.eos_token_ids
        # Beams ending in an EOS id finish (not under ignore_eos); the score drops a final EOS id always (vLLM's)
        self.finish = frozenset() if params.ignore_eos else self.eos
        self.step = SamplingParams(max_tokens=1, temperature=params.temperature, logprobs=2 * params.beam_width,
                                   ignore_eos=True, detokenize=False)  # fmt: skip
        self.beams = [[BeamSearchSequence(list(ids))] for ids in starts]
        self.done: list[list[BeamSearchSequence]] = [[] for _ in starts]
        self.steps = 0

    def key(self, seq: BeamSearchSequence) -> float:
        return score(seq, self.eos, self.params.length_penalty)

    def requests(self) -> list[dict] | None:
        if self.steps >= self.params.max_tokens:
            return None
        live = [{"prompt_token_ids": b.tokens} for bs in self.beams for b in bs]
        return live or None

    def advance(self, outs: list[RequestOutput]) -> None:
        self.steps += 1
        outs = iter(outs)
        for i, bs in enumerate(self.beams):
            grown = []
            for beam in bs:
                entries = next(outs).outputs[0].logprobs[0]
                for tok, lp in entries.items():
                    seq = BeamSearchSequence(beam.tokens + [tok], beam.logprobs + [entries], beam.cum_logprob + lp.logprob)
                    if tok in self.finish:
                        seq.finish_reason, seq.stop_reason = "stop", tok
                        self.done[i].append(seq)
                    else:
                        grown.append(seq)
            grown.sort(key=self.key, reverse=True)
            self.beams[i] = []
            for seq in grown[: self.params.beam_width]:  # a beam that fills the context can grow no more
                if len(seq.tokens) >= self.max_len:
                    seq.finish_reason = "length"
                    self.done[i].append(seq)
                else:
                    self.beams[i].append(seq)

    def outputs(self) -> list[BeamSearchOutput]:
        outputs = []
        for bs, finished in zip(self.beams, self.done):
            for seq in bs:  # (max_tokens reached)
                seq.finish_reason = "length"
            best = sorted(finished + bs, key=self.key, reverse=True)[: self.params.beam_width]
            outputs.append(BeamSearchOutput(best))
        return outputs


def request_output(out: BeamSearchOutput, prompt_ids: list[int], prompt: str | None, params: BeamSearchParams,
                   tokenizer, logprobs: bool = True) -> RequestOutput:  # fmt: skip
    """One prompt's search as the server answers it (vLLM's online form): a choice per sequence, best
    first, with the generated tokens only (and their logprobs, when asked for); an ending EOS id
    stays out of the tokens and the text unless include_stop_str_in_output, and is the choice's
    stop_reason. The text is decoded after the prompt's last tokens, so that a tokenizer that drops
    a text's leading space (SentencePiece) keeps it, as the engine's own outputs do."""
    choices = []
    for i, seq in enumerate(out.sequences):
        gen = seq.tokens[len(prompt_ids) :]
        shown = gen if seq.stop_reason is None or params.include_stop_str_in_output else gen[:-1]
        choices.append(CompletionOutput(i, _text_after(tokenizer, prompt_ids, shown, params.skip_special_tokens), shown,
                                        seq.cum_logprob, seq.logprobs[: len(shown)] if logprobs else None,
                                        seq.finish_reason, seq.stop_reason))  # fmt: skip
    return RequestOutput("", prompt, prompt_ids, choices, finished=True)


def _text_after(tokenizer, prompt_ids: list[int], ids: list[int], skip_special_tokens: bool) -> str:
    kw = {"skip_special_tokens": skip_special_tokens, "clean_up_tokenization_spaces": False}
    ctx = prompt_ids[-4:]
    head, full = tokenizer.decode(ctx, **kw), tokenizer.decode(ctx + ids, **kw)
    return full[len(head) :] if full.startswith(head) else tokenizer.decode(ids, **kw)
