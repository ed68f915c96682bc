"""Beam search over the offline API (LLM.beam_search; vLLM's names, algorithm and scores).

Each step is one batch of ordinary one-token requests, one per live beam, asking for 2 x beam_width
logprobs; the beam's whole token list is its prompt, so prefix caching leaves each step only the
tokens past the beam's last full block to compute. Candidates are scored as vLLM scores them (its
port of transformers' length penalty): cumulative logprob / length ** length_penalty, the length
counting the prompt, less a final EOS.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from tqdm.auto import tqdm

from arcserve.outputs import Logprob, RequestOutput
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
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    """The best sequences of one prompt, best first (at most beam_width of them)."""

    sequences: list[BeamSearchSequence]


def score(seq: BeamSearchSequence, eos_ids: frozenset[int] | set[int], length_penalty: float) -> float:
    n = len(seq.tokens) - (seq.tokens[-1] in eos_ids)
    return seq.cum_logprob / (max(n, 1) ** length_penalty)


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
    try:
        engine.logprobs_count("logprobs", 2 * params.beam_width)
    except ValueError:
        cap = engine.args.max_logprobs
        raise ValueError(f"beam_width must be at most {cap // 2}: each step asks for 2 x beam_width logprobs and "
                         f"this engine's max_logprobs is {cap} (raise max_logprobs, -1 for no limit)") from None  # fmt: skip
    if concurrency_limit is not None and (not isinstance(concurrency_limit, int) or concurrency_limit < 1):
        raise ValueError(f"concurrency_limit must be an integer >= 1 or None, got {concurrency_limit!r}")
    starts = []
    for p in prompts:
        _, ids = engine.prompt_tokens(p, None, params.max_tokens)
        engine.validate_prompt(ids)
        starts.append(ids)
    step = SamplingParams(max_tokens=1, temperature=params.temperature, logprobs=2 * params.beam_width,
                          ignore_eos=True, detokenize=False)  # fmt: skip
    # Beams ending in an EOS id finish (not under ignore_eos); the score drops a final EOS id always (vLLM's)
    finish = frozenset() if params.ignore_eos else engine.eos_token_ids
    limit = concurrency_limit or max(1, len(starts))
    results = []
    for first in range(0, len(starts), limit):
        batch = starts[first : first + limit]
        results += _search(run, batch, engine.max_model_len, params, step, finish, engine.eos_token_ids, use_tqdm)
    for out in results:
        for seq in out.sequences:
            seq.text = engine.tokenizer.decode(seq.tokens, skip_special_tokens=params.skip_special_tokens)
    return results


def _search(run, starts: list[list[int]], max_len: int, params: BeamSearchParams, step: SamplingParams,
            finish: frozenset[int], eos: frozenset[int], use_tqdm: bool) -> list[BeamSearchOutput]:  # fmt: skip
    """The search for a batch of prompts (token ids), all prompts' beams in one engine batch a step."""
    width, penalty = params.beam_width, params.length_penalty
    beams = [[BeamSearchSequence(list(ids))] for ids in starts]
    done: list[list[BeamSearchSequence]] = [[] for _ in starts]
    steps = range(params.max_tokens)
    for _ in tqdm(steps, desc="Beam search", unit="token") if use_tqdm else steps:
        live = [b for bs in beams for b in bs]
        if not live:
            break
        outs = iter(run([{"prompt_token_ids": b.tokens} for b in live], step))
        for i, bs in enumerate(beams):
            grown = []
            for beam in bs:
                entries = next(outs).outputs[0].logprobs[0]
                for tok, lp in entries.items():
                    seq = BeamSearchSequence(beam.tokens + [tok], beam.logprobs + [entries], beam.cum_logprob + lp.logprob)
                    if tok in finish:
                        seq.finish_reason = "stop"
                        done[i].append(seq)
                    else:
                        grown.append(seq)
            grown.sort(key=lambda s: score(s, eos, penalty), reverse=True)
            beams[i] = []
            for seq in grown[:width]:  # a beam that fills the context can grow no more
                if len(seq.tokens) >= max_len:
                    seq.finish_reason = "length"
                    done[i].append(seq)
                else:
                    beams[i].append(seq)
    outputs = []
    for bs, finished in zip(beams, done):
        for seq in bs:  # (max_tokens reached)
            seq.finish_reason = "length"
        outputs.append(BeamSearchOutput(sorted(finished + bs, key=lambda s: score(s, eos, penalty), reverse=True)[:width]))
    return outputs
