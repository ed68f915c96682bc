"""Sampler: logits of the sequences that sample this step -> next token ids (+ logprobs).

The whole batch is processed with tensor ops. Per-request work is confined to the host: one pass over
the requests packs their parameters into a few numpy arrays, which reach the device in one
asynchronous copy each (the host never waits for the device here, so overlapped steps stay
overlapped). No token-level Python loop, no per-request device op.

Order of processing: logprobs are taken from the raw logits; then allowed_token_ids (every other
token masked), logit_bias, min_tokens (stop tokens masked), repetition/frequency/presence penalties,
bad_words (masked where the output ends with a bad word's other tokens), structured outputs (every token the
row's grammar does not allow next masked; where the edits before left none of those, the grammar's
tokens over the raw logits); greedy rows take the argmax; the other
rows apply temperature, top-k, top-p and min-p and sample by inverse CDF: one uniform number per row
located in the row's cumulative distribution (kernels' sample_from_cdf: one Triton launch on GPUs).
The logits come in the model's dtype; float32 copies are made only where needed (logprobs, edits,
filters).

The uniform numbers are drawn on the host. A seeded request's number is a hash of (its seed, the index
of the token being sampled): counter-based, so a seeded request samples the same tokens whatever its
batch mates, whether steps overlap, and after a preemption. Unseeded rows draw from the engine's
generator (seeded by the engine seed).

Speculative decoding gives a request several rows, one per verified position: `offsets` says how
many of its drafts come before each row, and that row samples as if they had been accepted (its
penalty history holds them, min_tokens and the seeded number count them).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from arcserve.engine import structured
from arcserve.engine.penalties import PenaltyState, flat
from arcserve.engine.request import Request
from arcserve.kernels import reference
from arcserve.platform import pin_memory_available, to_device
from arcserve.sampling_params import SamplingParams

_M64 = (1 << 64) - 1


@dataclass
class SamplerOutput:
    tokens: torch.Tensor  # [B] int64, on the device
    # For rows that asked for logprobs (all on the device until the step's single sync):
    logprob_rows: list[int]
    topk_ids: torch.Tensor | None = None  # [R, K]
    topk_logprobs: torch.Tensor | None = None  # [R, K]
    token_logprob: torch.Tensor | None = None  # [R]
    token_rank: torch.Tensor | None = None  # [R]


def _splitmix64(x: np.ndarray) -> np.ndarray:
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax (its first, on ties). On the CPU, half logits go through float32 (exact):
    torch's half argmax there is scalar code (measured on a 2-vCPU AVX2 EPYC, one row of 49,152
    bf16 logits: ~240 us, against ~75 us converted first)."""
    if logits.device.type == "cpu" and logits.dtype in (torch.bfloat16, torch.float16):
        logits = logits.float()
    return logits.argmax(dim=-1)


def seeded_uniform(seeds: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """Uniform numbers in [0, 1), float32-exact (24 bits), as a pure function of (seed, position)."""
    with np.errstate(over="ignore"):
        h = _splitmix64(_splitmix64(seeds.astype(np.int64).view(np.uint64)) ^ positions.astype(np.uint64))
    return (h >> np.uint64(40)).astype(np.float64) * 2.0**-24


def num_sampled(req: Request) -> int:
    """Output tokens before the one being sampled: those on the host plus those still on the device."""
    return req.num_output_tokens + req.num_pending


def _before(reqs: list[Request], sampled: list[int] | None, i: int) -> int:
    """Row i's request's tokens sampled before this step (Sampler.__call__'s `sampled`, or now)."""
    return sampled[i] if sampled is not None else num_sampled(reqs[i])


def _stop_ids(req: Request) -> list[int]:
    """The ids min_tokens masks: stop_token_ids and EOS, EOS even under ignore_eos (vLLM's rule:
    no EOS before min_tokens)."""
    p = req.params
    return sorted(set(p.stop_token_ids) | p._eos_token_ids)


def _allowed_array(req: Request) -> np.ndarray:
    """The request's allowed_token_ids as an int64 array, made once and kept on the request."""
    if req.allowed_ids is None:
        req.allowed_ids = np.asarray(req.params.allowed_token_ids, dtype=np.int64)
    return req.allowed_ids


def banned_by_bad_words(req: Request, offset: int, V: int) -> list[int]:
    """The ids a bad-words request may not sample now: each bad sequence's last token where the
    output so far (with the first `offset` drafts of a speculating row) ends with the sequence's
    other tokens; one-token sequences always."""
    out = req.output_token_ids
    if offset:
        out = out + req.spec_token_ids[:offset]
    banned = []
    for seq in req.params._bad_words_token_ids:
        k = len(seq) - 1
        if seq[-1] < V and (k == 0 or (len(out) >= k and out[-k:] == seq[:-1])):
            banned.append(seq[-1])
    return banned


def apply_top_k_top_p_min_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None, min_p: torch.Tensor | None
) -> torch.Tensor:
    """Mask (to -inf) what falls outside each row's min-p, top-k and nucleus top-p sets, in vLLM's
    order: min-p first (on the whole distribution), then top-k and top-p over what it kept."""
    if min_p is not None:
        probs = logits.softmax(dim=-1)
        thresh = min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(probs < thresh, float("-inf"))
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
    return logits


def _warm_up_batches(vocab: int) -> list[list[SamplingParams]]:
    """The batches Sampler.warm_up samples: every filter and logprobs over all rows, alone and as a
    pair; a greedy row with logprobs beside a top-p row (some rows' logprobs, greedy beside sampled);
    min-p alone and top-k alone (paths without the sort or without the cumulative sum)."""
    every = SamplingParams(temperature=0.8, top_k=50, top_p=0.9, min_p=0.05, logprobs=min(2, vocab))
    return [
        [every], [every, every],
        [SamplingParams(temperature=0.0, logprobs=1), SamplingParams(temperature=0.8, top_p=0.9)],
        [SamplingParams(temperature=0.8, min_p=0.1)], [SamplingParams(temperature=0.8, top_k=20)],
    ]  # fmt: skip

# Columns of the per-row float parameters, copied to the device as one array.
_TEMP, _INV_T, _TOP_P, _MIN_P, _TOP_K, _U = range(6)
# What a row needs beyond plain sampling, as bits of its flags.
_LOGPROBS, _BIAS, _MIN_TOKENS, _PENALTIES, _GREEDY, _SEEDED, _ALLOWED, _BAD_WORDS, _HISTORY, _GRAMMAR = (
    1 << i for i in range(10)
)


def _static_row(req: Request, V: int) -> tuple[int, np.ndarray]:
    """(flags, [temperature (0 = greedy), its inverse (1 for greedy), top_p, min_p, top_k (V = off),
    0 for the uniform number]) of one request's sampling parameters."""
    p = req.params
    temp = 0.0 if p.greedy else p.temperature
    row = np.array([temp, 1.0, p.top_p, p.min_p, p.top_k if 0 < p.top_k < V else V, 0.0], dtype=np.float32)
    if temp:
        row[_INV_T] = np.float32(1.0) / row[_TEMP]  # in float32, as the device uses it
    flags = (
        (_LOGPROBS if p.logprobs is not None else 0) | (_BIAS if p.logit_bias else 0)
        | (_MIN_TOKENS if p.min_tokens > 0 else 0) | (_PENALTIES if p.needs_penalties else 0)
        | (_GREEDY if p.greedy else 0) | (_SEEDED if req.seed is not None else 0)
        | (_ALLOWED if p.allowed_token_ids else 0) | (_BAD_WORDS if p._bad_words_token_ids else 0)
        | (_GRAMMAR if p._grammar is not None else 0)
        | (_HISTORY if any(len(t) > 1 for t in p._bad_words_token_ids) or p._grammar else 0)
    )  # fmt: skip
    return flags, row


class Sampler:
    def __init__(self, device: torch.device, seed: int, sample_from_cdf=reference.sample_from_cdf,
                 apply_penalties=reference.apply_penalties, penalty_slots: int | None = None) -> None:  # fmt: skip
        """penalty_slots: the penalties' table size (PenaltyState's slots; the engine: max_num_seqs)."""
        self.device = device
        self.rng = np.random.default_rng(seed)
        self.sample_from_cdf = sample_from_cdf  # the kernel namespace's (Triton on GPUs), and:
        self.apply_penalties = apply_penalties
        self.penalty_slots = penalty_slots
        self._bits: torch.Tensor | None = None  # structured outputs' allowed-token words (pinned; reused)
        self.penalties: PenaltyState | None = None  # made at warm_up or the first penalized row

    @torch.no_grad()  # (not inference_mode: the table must stay an ordinary tensor, updatable outside it)
    def warm_up(self, vocab: int, dtype: torch.dtype) -> None:
        """At startup on GPUs, where kernels compile (Triton) or load at their first launch (torch's):
        launch the sampling kernel over logits in the model's dtype and in float32 (rows that were
        edited or filtered) and the penalties' kernel, so that none compiles at the first request
        that needs it (~30 ms with Triton's disk cache warm, far longer cold, while every running
        request waits); sample through the filters and logprobs; and make the penalties' table now
        (its memory is set aside at startup anyway)."""
        dev = self.device
        x = torch.randn(2, vocab, device=dev)
        inv_t, u = torch.ones(2, device=dev), torch.full((2,), 0.5, device=dev)
        for logits in (x.to(dtype), x):
            self.sample_from_cdf(logits, inv_t, u)
        pen = self._penalty_state(vocab)
        # rows and slots as separate (16-byte aligned) tensors, as apply() hands them over
        rows, slots = (torch.zeros(1, dtype=torch.int64, device=dev) for _ in range(2))
        pen.kernel(x, rows, pen.counts, pen.prompt, slots, pen.params)
        # torch's own kernels for the filters (sort, cumsum, scatter) and for logprobs (log_softmax,
        # topk) load at their first launch, which stalled the first request that used them while
        # every running request waited (H200: ~170 ms for top-k/top-p, ~120 ms for logprobs): take
        # those paths now, one row and two, through a scratch sampler (the engine's generator and
        # table stay untouched).
        scratch = Sampler(dev, 0, self.sample_from_cdf, self.apply_penalties)
        for batch in _warm_up_batches(vocab):
            reqs = [Request(f"warm-up-{i}", [0], p, max_tokens=1) for i, p in enumerate(batch)]
            scratch(x[: len(reqs)].to(dtype), reqs)

    def _penalty_state(self, vocab: int) -> PenaltyState:
        if self.penalties is None:
            self.penalties = PenaltyState(self.device, vocab, self.apply_penalties, self.penalty_slots)
        return self.penalties

    def _rows(self, reqs: list[Request], V: int) -> tuple[np.ndarray, list[np.ndarray]]:
        """(flags [B], each row's float parameters [6] without the uniform number): computed once
        per request, at its first sampling, and kept on the request (its params never change)."""
        rows = []
        for r in reqs:
            row = r.sampling_row
            if row is None:
                row = r.sampling_row = _static_row(r, V)
            rows.append(row)
        return np.fromiter((f for f, _ in rows), dtype=np.int64, count=len(rows)), [v for _, v in rows]

    def rows(self, reqs: list[Request], V: int) -> tuple[np.ndarray, list[np.ndarray], bool]:
        """The rows' packed parameters (_rows) and whether a row reads its output so far on the host
        (bad words of several tokens, structured outputs): then it samples only once the
        previous step's tokens are read. A step's launch asks, and hands them to __call__."""
        flags, params = self._rows(reqs, V)
        return flags, params, bool(len(flags)) and bool(np.bitwise_or.reduce(flags) & _HISTORY)

    def __call__(self, logits: torch.Tensor, reqs: list[Request], offsets: np.ndarray | None = None,
                 sampled: list[int] | None = None, rows: tuple | None = None) -> SamplerOutput:  # fmt: skip
        """offsets: per row, the drafts before it (speculative decoding; None = no drafts). sampled:
        per row, its request's tokens sampled before this step (num_sampled when the step was
        launched: a sampling issued later, ModelRunner.sample, finds the step's own token pending
        and the one before read); None: num_sampled now. rows: self.rows(reqs, V) when the caller
        has it already."""
        B, V = logits.shape
        dev = logits.device
        flags, param_rows, _ = rows if rows is not None else self.rows(reqs, V)
        some = int(np.bitwise_or.reduce(flags)) if B else 0

        def rows_with(flag: int) -> list[int]:
            return np.flatnonzero(flags & flag).tolist() if some & flag else []

        lp_rows = rows_with(_LOGPROBS)
        raw_logprobs = logits.float().log_softmax(dim=-1) if lp_rows else None

        allowed_rows = rows_with(_ALLOWED)
        bias_rows = rows_with(_BIAS)
        mask_rows = [
            i for i in rows_with(_MIN_TOKENS)
            if _before(reqs, sampled, i) + (offsets[i] if offsets is not None else 0) < reqs[i].params.min_tokens
        ]  # fmt: skip
        pen_rows = rows_with(_PENALTIES)
        bad_rows = rows_with(_BAD_WORDS)
        grammar_rows = rows_with(_GRAMMAR)
        raw = logits
        if allowed_rows or bias_rows or mask_rows or pen_rows or bad_rows or grammar_rows:  # edited in place: a float32 copy
            logits = logits.to(torch.float32, memory_format=torch.contiguous_format, copy=True)
            # (flat positions row * V + id, and index_fill_ / index_add_: an assignment of a Python
            # scalar through an index copies it to the device synchronously, and index_put_ with
            # accumulate waits for the device too, either of which would stall overlapped steps)
            flat_logits = logits.view(-1)
        if allowed_rows:  # -inf everywhere in those rows but at their allowed ids (validated < vocab)
            arrays = [_allowed_array(reqs[i]) for i in allowed_rows]
            rows = np.repeat(np.asarray(allowed_rows, dtype=np.int64), [len(a) for a in arrays])
            idx = to_device(np.concatenate([rows * V + np.concatenate(arrays), allowed_rows]), dev)
            at = idx[: len(rows)]
            kept = flat_logits[at]
            logits.index_fill_(0, idx[len(rows) :], float("-inf"))
            flat_logits.index_copy_(0, at, kept)
        if bias_rows:
            biases = [{t: b for t, b in reqs[i].params.logit_bias.items() if t < V} for i in bias_rows]
            rows, ids = flat(bias_rows, [list(d) for d in biases])
            vals = np.fromiter(itertools.chain.from_iterable(d.values() for d in biases), np.float32, len(ids))
            flat_logits.index_add_(0, to_device(rows * V + ids, dev), to_device(vals, dev))
        if mask_rows:
            rows, ids = flat(mask_rows, [[t for t in _stop_ids(reqs[i]) if t < V] for i in mask_rows])
            if len(ids):
                flat_logits.index_fill_(0, to_device(rows * V + ids, dev), float("-inf"))
        if pen_rows:
            self._penalty_state(V).apply(logits, reqs, pen_rows, [_before(reqs, sampled, i) for i in pen_rows], offsets)
        if bad_rows:
            banned = [banned_by_bad_words(reqs[i], offsets[i] if offsets is not None else 0, V) for i in bad_rows]
            rows, ids = flat(bad_rows, banned)
            if len(ids):
                flat_logits.index_fill_(0, to_device(rows * V + ids, dev), float("-inf"))
        if grammar_rows:  # (rows that earlier edits may have left without a grammar token: checked)
            edited = set(allowed_rows) | set(mask_rows) | set(bad_rows)
            self._apply_grammars(logits, raw, [reqs[i].grammar for i in grammar_rows], grammar_rows, edited)

        greedy = (flags & _GREEDY) != 0
        if greedy.all():
            tokens = argmax(logits)
        else:  # the parameter array only here: all-greedy steps (the common case) skip building it
            f = np.concatenate(param_rows).reshape(B, 6)
            f[:, _U] = self._uniform(reqs, flags, sampled, offsets)
            # Uploaded by columns, each padded to a multiple of 4 floats: every column then starts
            # 16-byte aligned whatever B is. (Column views of the row-major array had the kernel's
            # alignment of u change at B = 1, a fresh Triton compile of ~300 ms mid-run.)
            cols = np.zeros((6, -(-B // 4) * 4), dtype=np.float32)
            cols[:, :B] = f.T
            f_d = to_device(cols, dev)[:, :B]
            sampled = self._sample(logits, f_d, f)
            if greedy.any():
                tokens = torch.where(f_d[_TEMP] == 0, argmax(logits), sampled)
            else:
                tokens = sampled

        if pen_rows:
            self.penalties.count(tokens)
        out = SamplerOutput(tokens=tokens, logprob_rows=lp_rows)
        if lp_rows:
            if len(lp_rows) == B:
                lp, toks = raw_logprobs, tokens
            else:
                rows_d = to_device(np.asarray(lp_rows, dtype=np.int64), dev)
                lp, toks = raw_logprobs[rows_d], tokens[rows_d]
            k = max(reqs[i].params.logprobs for i in lp_rows)
            if k > 0:
                out.topk_logprobs, out.topk_ids = lp.topk(k, dim=-1)
            chosen = lp.gather(1, toks[:, None])
            out.token_logprob = chosen[:, 0]
            out.token_rank = (lp > chosen).sum(dim=-1) + 1
        return out

    def _grammar_bits(self, constraints: list, dev: torch.device) -> torch.Tensor:
        """The rows' allowed-token words on the device. The host buffer is pinned once and reused: a
        constrained row samples only once the previous step's tokens were read, so the copy out of
        it that the previous step made has finished (a fresh pinned staging buffer every step cost
        ~0.3 ms of host time for 64 rows of a 152k vocabulary)."""
        rows, words = len(constraints), constraints[0].words
        if self._bits is None or self._bits.shape[0] < rows or self._bits.shape[1] != words:
            self._bits = torch.empty(max(rows, 2 * (0 if self._bits is None else self._bits.shape[0])), words,
                                     dtype=torch.int32, pin_memory=pin_memory_available(dev))  # fmt: skip
        host = self._bits[:rows]
        structured.fill(constraints, host.numpy())  # (every constrained row in one call)
        return host if dev.type == "cpu" else host.to(dev, non_blocking=True)  # (read at once on the CPU)

    def _apply_grammars(self, logits: torch.Tensor, raw: torch.Tensor, constraints: list, rows: list[int],
                        edited: set[int]) -> None:  # fmt: skip
        """Mask, in `rows` of the float32 logits, every token the row's grammar does not allow next. A row
        that the earlier edits (min_tokens, bad_words, allowed_token_ids: `edited`) left with none of
        the grammar's tokens takes them over its raw logits instead: the grammar wins."""
        dev = logits.device
        no = structured.banned(self._grammar_bits(constraints, dev), logits.shape[1])
        if len(rows) == logits.shape[0]:  # (every row: no gather)
            logits.masked_fill_(no, float("-inf"))
        else:
            rows_d = to_device(np.asarray(rows, dtype=np.int64), dev)
            logits[rows_d] = logits[rows_d].masked_fill(no, float("-inf"))
        check = [j for j, r in enumerate(rows) if r in edited]
        if check:
            sub = to_device(np.asarray([rows[j] for j in check], dtype=np.int64), dev)
            no_sub = no[to_device(np.asarray(check, dtype=np.int64), dev)]
            cur = logits[sub]
            dead = (cur == float("-inf")).all(dim=-1, keepdim=True)
            logits[sub] = torch.where(dead, raw[sub].float().masked_fill(no_sub, float("-inf")), cur)

    def _uniform(self, reqs: list[Request], flags: np.ndarray, sampled: list[int] | None,
                 offsets: np.ndarray | None = None) -> np.ndarray:  # fmt: skip
        """One uniform number per row: hashed from (seed, token index) for seeded requests, from
        the engine's generator otherwise; below 1 in float32."""
        u = self.rng.random(len(reqs))
        seeded = np.flatnonzero(flags & _SEEDED)
        if len(seeded):
            seeds = np.array([reqs[i].seed for i in seeded], dtype=np.int64)
            pos = np.array([_before(reqs, sampled, i) for i in seeded], dtype=np.int64)
            if offsets is not None:
                pos += offsets[seeded]
            u[seeded] = seeded_uniform(seeds, pos)
        return np.minimum(u, 1.0 - 2.0**-24)  # float32 rounding must not reach 1

    def _sample(self, logits: torch.Tensor, f_d: torch.Tensor, f: np.ndarray) -> torch.Tensor:
        """f: [B, 6] parameters on the host; f_d: the same on the device by columns, [6, B]."""
        V = logits.shape[1]
        inv_t = f_d[_INV_T]
        top_k = f_d[_TOP_K].long() if (f[:, _TOP_K] < V).any() else None
        top_p = f_d[_TOP_P] if (f[:, _TOP_P] < 1.0).any() else None
        min_p = f_d[_MIN_P] if (f[:, _MIN_P] > 0.0).any() else None
        if top_k is not None or top_p is not None or min_p is not None:
            # the filters act on the temperature-scaled distribution (in float32)
            logits = apply_top_k_top_p_min_p(logits.float() * inv_t[:, None], top_k, top_p, min_p)
            inv_t = torch.ones_like(inv_t)
        return self.sample_from_cdf(logits, inv_t, f_d[_U])
