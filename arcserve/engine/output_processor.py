"""Turns finished steps into RequestOutputs: detokenizes, applies stop strings, groups the n
sequences of one request, and emits cumulative, delta or final-only outputs."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from arcserve.engine.detokenizer import IncrementalDetokenizer, TokenTexts
from arcserve.engine.request import Request, RequestStatus
from arcserve.outputs import CompletionOutput, RequestMetrics, RequestOutput
from arcserve.sampling_params import RequestOutputKind, SamplingParams


@dataclass
class _Seq:
    req: Request
    detok: IncrementalDetokenizer | None
    sent_tokens: int = 0
    reported_done: bool = False
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class RequestGroup:
    """One user request: its n sequences and what has been reported so far."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[_Seq] = field(default_factory=list)
    finished_time: float | None = None
    sent_prompt_logprobs: bool = False  # DELTA outputs carry them once, in the first (as vLLM's)

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.seqs)


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.token_text = TokenTexts(tokenizer)
        self.groups: dict[str, RequestGroup] = {}
        self.seq_of: dict[str, tuple[RequestGroup, _Seq]] = {}  # child request id -> (group, seq)

    def add(self, group: RequestGroup, children: list[Request]) -> None:
        p = group.params
        for req in children:
            detok = (
                IncrementalDetokenizer(
                    self.tokenizer, req.prompt_token_ids, p.skip_special_tokens, p.stop,
                    p.include_stop_str_in_output, lazy=p.output_kind == RequestOutputKind.FINAL_ONLY,
                )
                if p.detokenize
                else None
            )  # fmt: skip
            seq = _Seq(req, detok)
            group.seqs.append(seq)
            self.seq_of[req.request_id] = (group, seq)
        self.groups[group.request_id] = group

    def remove(self, request_id: str) -> RequestGroup | None:
        group = self.groups.pop(request_id, None)
        if group is not None:
            for s in group.seqs:
                self.seq_of.pop(s.req.request_id, None)
        return group

    def _decode_entries(self, entries: dict) -> None:
        for tid, e in entries.items():
            e.decoded_token = self.token_text(tid)

    def on_prompt_logprobs(self, req: Request, entries: list[dict]) -> None:
        for e in entries:
            self._decode_entries(e)
        req.prompt_logprobs.extend(entries)

    def on_token(self, req: Request, token: int, logprob, num_tokens: int | None = None) -> str | None:
        """Record one new token; returns the stop string if one now ends the sequence. num_tokens:
        the sequence's length up to this token, when later tokens are already appended (speculative
        decoding adds several per step)."""
        group, seq = self.seq_of[req.request_id]
        if logprob is not None:
            lp, entries = logprob
            req.cumulative_logprob += lp
            self._decode_entries(entries)
            req.logprobs.append(entries)
        if seq.detok is None:
            return None
        if (
            req.status is RequestStatus.FINISHED_STOPPED
            and not req.params.include_stop_str_in_output
            and (num_tokens is None or num_tokens == req.num_tokens)
        ):  # as in vLLM, the token that stopped the sequence (EOS, stop_token_ids) stays out of the text
            return None
        # As in vLLM, stop strings (like EOS and stop_token_ids) only end a sequence after min_tokens.
        n_out = (req.num_tokens if num_tokens is None else num_tokens) - req.num_prompt_tokens
        return seq.detok.add_token(token, check_stop=n_out > req.params.min_tokens)

    def on_finish(self, req: Request, reason: str, stop_reason) -> None:
        group, seq = self.seq_of[req.request_id]
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
        if seq.detok is not None and not isinstance(stop_reason, str):
            seq.detok.flush()
        if group.finished:
            group.finished_time = time.time()

    def make_output(self, group: RequestGroup) -> RequestOutput | None:
        kind = group.params.output_kind
        finished = group.finished
        if kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        delta = kind == RequestOutputKind.DELTA
        outs = []
        for i, s in enumerate(group.seqs):
            req = s.req
            n_out = req.num_output_tokens
            done = s.finish_reason is not None
            if delta and s.reported_done:
                continue
            start = s.sent_tokens if delta else 0
            if delta:
                text = s.detok.delta(done) if s.detok else ""
                if start == n_out and not text and not done:
                    continue
            else:
                text = s.detok.visible_text(done) if s.detok else ""
            s.sent_tokens = n_out
            s.reported_done = done
            outs.append(
                CompletionOutput(
                    index=i,
                    text=text,
                    token_ids=req.token_ids[req.num_prompt_tokens + start :],
                    cumulative_logprob=req.cumulative_logprob if req.logprobs is not None else None,
                    logprobs=req.logprobs[start:] if req.logprobs is not None else None,
                    finish_reason=s.finish_reason,
                    stop_reason=s.stop_reason,
                )
            )
        if delta and not outs:
            return None
        prompt_logprobs = group.seqs[0].req.prompt_logprobs
        if delta:
            prompt_logprobs, group.sent_prompt_logprobs = None if group.sent_prompt_logprobs else prompt_logprobs, True
        first = [s.req.metrics for s in group.seqs]
        metrics = RequestMetrics(
            arrival_time=first[0].arrival_time,
            first_scheduled_time=_min(m.first_scheduled_time for m in first),
            first_token_time=_min(m.first_token_time for m in first),
            last_token_time=_max(m.last_token_time for m in first),
            finished_time=group.finished_time,
        )
        return RequestOutput(
            request_id=group.request_id,
            prompt=group.prompt,
            prompt_token_ids=group.prompt_token_ids,
            outputs=outs,
            finished=finished,
            metrics=metrics,
            num_cached_tokens=group.seqs[0].req.num_cached_tokens,
            prompt_logprobs=prompt_logprobs,
        )


def _min(xs):
    xs = [x for x in xs if x is not None]
    return min(xs) if xs else None


def _max(xs):
    xs = [x for x in xs if x is not None]
    return max(xs) if xs else None
