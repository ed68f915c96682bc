"""Sampler: logits of the sequences that sample this step -> next token ids (+ logprobs).

The whole batch is processed with tensor ops; the only per-request work is building small parameter
tensors and, for seeded requests, drawing their noise from their own generator (so a seeded request
samples the same tokens whatever else is in the batch).

Order of processing, as in vLLM: logprobs are taken from the raw logits; then logit_bias, min_tokens
(stop tokens masked), repetition/frequency/presence penalties; greedy rows take the argmax; the other
rows apply temperature, top-k, top-p and min-p and sample by inverse CDF: one uniform number per row
(from the request's own generator when it has a seed) located in the row's cumulative distribution.
That needs one random number per row instead of one per vocabulary entry.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from arcserve.engine.request import Request


@dataclass
class SamplerOutput:
    tokens: torch.Tensor  # [B] int64
    # For rows that asked for logprobs (all on the device until the step's single sync):
    logprob_rows: list[int]
    topk_ids: torch.Tensor | None = None  # [R, K]
    topk_logprobs: torch.Tensor | None = None  # [R, K]
    token_logprob: torch.Tensor | None = None  # [R]
    token_rank: torch.Tensor | None = None  # [R]


def _stop_ids(req: Request) -> list[int]:
    p = req.params
    ids = set(p.stop_token_ids)
    if not p.ignore_eos:
        ids |= p._eos_token_ids
    return sorted(ids)


def apply_penalties(logits: torch.Tensor, reqs: list[Request], rows: list[int]) -> None:
    """In place, for `rows`: repetition penalty over prompt and output tokens (divide positive
    logits, multiply negative ones); frequency and presence penalties over output tokens."""
    V = logits.shape[1]
    dev = logits.device
    counts = torch.zeros(len(rows), V, device=dev)
    seen = torch.zeros(len(rows), V, dtype=torch.bool, device=dev)
    for j, i in enumerate(rows):
        req = reqs[i]
        out = torch.tensor(req.output_token_ids, dtype=torch.long, device=dev)
        out = out[out < V]
        counts[j].index_add_(0, out, torch.ones(out.shape[0], device=dev))
        prompt = torch.tensor(req.prompt_token_ids, dtype=torch.long, device=dev)
        seen[j, prompt[prompt < V]] = True
    seen |= counts > 0
    params = [reqs[i].params for i in rows]
    rep = torch.tensor([p.repetition_penalty for p in params], device=dev)[:, None]
    freq = torch.tensor([p.frequency_penalty for p in params], device=dev)[:, None]
    pres = torch.tensor([p.presence_penalty for p in params], device=dev)[:, None]
    idx = torch.tensor(rows, device=dev)
    sub = logits[idx]
    sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
    sub = sub - freq * counts - pres * (counts > 0).float()
    logits[idx] = sub


def apply_top_k_top_p_min_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None, min_p: torch.Tensor | None
) -> torch.Tensor:
    """Mask (to -inf) what falls outside each row's top-k, nucleus top-p and min-p sets."""
    if top_k is not None or top_p is not None:
        srt, order = logits.sort(dim=-1, descending=False)
        V = logits.shape[1]
        if top_k is not None:  # keep values >= the k-th largest (ties kept)
            kth = srt.gather(1, (V - top_k).clamp(min=0)[:, None])
            srt = srt.masked_fill(srt < kth, float("-inf"))
        if top_p is not None:  # drop the least likely tokens whose total mass is <= 1 - p
            cum = srt.softmax(dim=-1).cumsum(dim=-1)
            drop = cum <= (1 - top_p)[:, None]
            drop[:, -1] = False
            srt = srt.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(1, order, srt)
    if min_p is not None:
        probs = logits.softmax(dim=-1)
        thresh = min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(probs < thresh, float("-inf"))
    return logits


class Sampler:
    def __init__(self, device: torch.device, seed: int) -> None:
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def __call__(self, logits: torch.Tensor, reqs: list[Request]) -> SamplerOutput:
        B, V = logits.shape
        dev = logits.device
        params = [r.params for r in reqs]
        lp_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        raw_logprobs = logits.log_softmax(dim=-1) if lp_rows else None

        if any(p.logit_bias for p in params) or any(p.needs_penalties for p in params) or any(
            r.num_output_tokens < r.params.min_tokens for r in reqs
        ):
            logits = logits.clone()
        for i, (r, p) in enumerate(zip(reqs, params)):
            if p.logit_bias:
                ids = torch.tensor([t for t in p.logit_bias if t < V], dtype=torch.long, device=dev)
                vals = torch.tensor([b for t, b in p.logit_bias.items() if t < V], device=dev)
                logits[i].index_add_(0, ids, vals)
            if r.num_output_tokens < p.min_tokens:
                stop = [t for t in _stop_ids(r) if t < V]
                if stop:
                    logits[i, stop] = float("-inf")
        pen_rows = [i for i, p in enumerate(params) if p.needs_penalties]
        if pen_rows:
            apply_penalties(logits, reqs, pen_rows)

        rand = [i for i, p in enumerate(params) if not p.greedy]
        if len(rand) == B:
            tokens = self._sample(logits, reqs, rand)
        else:
            tokens = logits.argmax(dim=-1)
            if rand:
                tokens[rand] = self._sample(logits, reqs, rand)

        out = SamplerOutput(tokens=tokens, logprob_rows=lp_rows)
        if lp_rows:
            rows = torch.tensor(lp_rows, device=dev)
            lp = raw_logprobs[rows]
            k = max(params[i].logprobs for i in lp_rows)
            if k > 0:
                out.topk_logprobs, out.topk_ids = lp.topk(k, dim=-1)
            chosen = lp.gather(1, tokens[rows][:, None])
            out.token_logprob = chosen[:, 0]
            out.token_rank = (lp > chosen).sum(dim=-1) + 1
        return out

    def _sample(self, logits: torch.Tensor, reqs: list[Request], rows: list[int]) -> torch.Tensor:
        dev = logits.device
        params = [reqs[i].params for i in rows]
        temp = torch.tensor([p.temperature for p in params], device=dev)
        sub = logits if len(rows) == logits.shape[0] else logits[torch.tensor(rows, device=dev)]
        x = sub / temp[:, None]
        V = x.shape[1]
        top_k = top_p = min_p = None
        if any(0 < p.top_k < V for p in params):
            top_k = torch.tensor([p.top_k if p.top_k > 0 else V for p in params], device=dev).clamp(max=V)
        if any(p.top_p < 1.0 for p in params):
            top_p = torch.tensor([p.top_p for p in params], device=dev)
        if any(p.min_p > 0.0 for p in params):
            min_p = torch.tensor([p.min_p for p in params], device=dev)
        x = apply_top_k_top_p_min_p(x, top_k, top_p, min_p)
        cdf = x.softmax(dim=-1).cumsum(dim=-1)
        gens = [reqs[i].generator for i in rows]
        if all(g is None for g in gens):
            u = torch.rand(len(rows), 1, device=dev, generator=self.generator)
        else:
            u = torch.cat([torch.rand(1, device=dev, generator=g or self.generator) for g in gens])[:, None]
        # right=True: the first index whose cumulative mass exceeds u, so zero-probability tokens
        # (flat steps of the cdf) are never picked. u is scaled by the row total (float rounding).
        picked = torch.searchsorted(cdf, u * cdf[:, -1:], right=True)[:, 0]
        return picked.clamp_(max=V - 1)
