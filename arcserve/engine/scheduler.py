"""Token-budget scheduler: which requests run this step and how many tokens each.

Each step spends at most `max_num_batched_tokens` tokens on at most `max_num_seqs` running requests:
running requests first (those decoding one token before those in the middle of a prefill), then new
requests from the waiting queue in policy order, each getting a prefill chunk that fits the budget.
When KV blocks run out, the policy's victim is preempted: its blocks are freed (keeping their prefix
hashes, so re-admission mostly hits the cache) and it goes back to the waiting queue to be recomputed.

The result is a SchedulerOutput, the only thing the runner sees. The scheduler touches no tensors.
"""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass, field

import numpy as np

from arcserve.engine.kv_cache import KVCacheManager
from arcserve.engine.policy import SchedulingPolicy
from arcserve.engine.request import Request, RequestStatus


@dataclass
class ScheduledSeq:
    request: Request  # read-only for the runner: sampling params, seed, token history
    start_pos: int  # tokens already in the KV cache
    num_new_tokens: int  # tokens computed this step (positions start_pos ...)
    sample: bool  # the chunk reaches the end of the sequence: sample the next token
    # Speculative decoding: draft tokens scheduled after the request's last token (they are the
    # last len(spec_token_ids) of num_new_tokens); every position from the last token on samples.
    spec_token_ids: list[int] = field(default_factory=list)

    @property
    def new_token_ids(self) -> list[int]:
        """The new tokens known on the host (drafts included); with overlapped steps the last one
        may still be on the device (then this list is one shorter than num_new_tokens)."""
        ids = self.request.token_ids[self.start_pos : self.start_pos + self.num_new_tokens]
        return ids + self.spec_token_ids if self.spec_token_ids else ids


@dataclass
class SchedulerOutput:
    seqs: list[ScheduledSeq] = field(default_factory=list)
    num_batched_tokens: int = 0
    preempted: list[str] = field(default_factory=list)
    num_spec_tokens: int = 0  # drafts scheduled in all (speculative decoding)
    # The seqs' block tables, one int32 row each (KVCacheManager.block_tables)
    block_tables: np.ndarray | None = None

    @property
    def is_empty(self) -> bool:
        return not self.seqs


@dataclass
class SchedulerStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        policy: SchedulingPolicy,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
    ) -> None:
        self.kv = kv
        self.policy = policy
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.running: list[Request] = []
        self._waiting: list[tuple] = []  # heap of (policy key, request)
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0

    # ---- queue management -------------------------------------------------------------------
    def queue_key(self, req: Request):
        """The policy's key for req, checked to compare with the queue's keys: a policy that raises
        or gives keys of another type fails here, before anything changes."""
        key = self.policy.key(req)
        if self._waiting:
            _ = key < self._waiting[0][0]  # TypeError where they do not compare
        return key

    def add_request(self, req: Request, key=None) -> None:
        assert req.request_id not in self.requests, req.request_id
        key = self.queue_key(req) if key is None else key
        self.requests[req.request_id] = req
        heapq.heappush(self._waiting, (key, req.seq_no, req))

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        """End a request (abort, or a stop string found by the detokenizer) and free its blocks."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            self._waiting = [e for e in self._waiting if e[2] is not req]
            heapq.heapify(self._waiting)
        req.status = status
        self.kv.free(req)
        return req

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self._waiting),
            kv_cache_usage=self.kv.usage(),
            prefix_cache_queries=self.kv.prefix_queries,
            prefix_cache_hits=self.kv.prefix_hits,
            num_preemptions=self.num_preemptions,
        )

    # ---- one step ---------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        scheduled: dict[str, ScheduledSeq] = {}
        # Decoding requests first, then those in the middle of a prefill; each group in admission order.
        order = sorted(self.running, key=lambda r: r.num_uncomputed > 1)
        for req in order:
            if budget == 0:
                break
            if req.status != RequestStatus.RUNNING:  # preempted earlier in this loop
                continue
            if req.num_pending and self._at_length_limit(req, req.num_pending):
                continue  # its last token is being sampled now: it finishes when the host reads it
            n = min(req.num_uncomputed, budget)
            if n <= 0:
                continue
            spec = req.spec_token_ids
            if spec and (n != 1 or req.num_pending):  # drafts only follow a decode's known last token
                spec = req.spec_token_ids = []
            if spec:
                n = min(1 + len(spec), budget)
                spec = req.spec_token_ids = spec[: n - 1]
            while not self.kv.allocate(req, n):
                victim = self.policy.pick_victim(self.running)
                self._preempt(victim)
                out.preempted.append(victim.request_id)
                undone = scheduled.pop(victim.request_id, None)
                if undone is not None:
                    budget += undone.num_new_tokens
                if victim is req:
                    break
            if req.status != RequestStatus.RUNNING:
                continue
            scheduled[req.request_id] = self._scheduled(req, n, spec)
            out.num_spec_tokens += len(spec)
            budget -= n

        # Admit waiting requests, unless this step already had to preempt.
        now = time.time()
        while self._waiting and budget > 0 and len(self.running) < self.max_num_seqs and not out.preempted:
            req = self._waiting[0][2]
            if req.num_pending:  # preempted while its token was on the device: wait until it is read
                break
            cached = self.kv.find_cached_prefix(req)
            num_cached = len(cached) * self.kv.block_size
            n = min(req.num_tokens - num_cached, budget)
            if not self.kv.allocate(req, n, cached):
                break  # head-of-line: later requests wait their turn
            heapq.heappop(self._waiting)
            self.kv.prefix_queries += req.num_tokens
            self.kv.prefix_hits += num_cached
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = now
                req.num_cached_tokens = num_cached
            req.num_computed_tokens = num_cached
            req.status = RequestStatus.RUNNING
            req.spec_token_ids = []  # drafts proposed before a preemption are stale
            self.running.append(req)
            scheduled[req.request_id] = self._scheduled(req, n)
            budget -= n

        out.seqs = list(scheduled.values())
        out.num_batched_tokens = self.max_num_batched_tokens - budget
        out.block_tables = self.kv.block_tables(out.seqs)
        return out

    def _scheduled(self, req: Request, n: int, spec: list[int] | None = None) -> ScheduledSeq:
        return ScheduledSeq(
            request=req,
            start_pos=req.num_computed_tokens,
            num_new_tokens=n,
            sample=req.num_computed_tokens + n == req.num_tokens + req.num_pending + len(spec or ()),
            spec_token_ids=spec or [],
        )

    def _preempt(self, req: Request) -> None:
        key = self.queue_key(req)  # first: a policy that raises leaves req running (the step fails it)
        self.running.remove(req)
        self.kv.free(req)
        req.status = RequestStatus.WAITING
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        heapq.heappush(self._waiting, (key, req.seq_no, req))

    # ---- after the step ---------------------------------------------------------------------
    def on_launched(self, out: SchedulerOutput) -> None:
        """The step is on the device: its tokens count as computed; each sampling sequence has one
        more token pending (on the device until on_sampled)."""
        for seq in out.seqs:
            req = seq.request
            req.num_computed_tokens += seq.num_new_tokens
            self.kv.commit(req)  # full blocks of known tokens only; pending ones wait for on_sampled
            if seq.sample:
                req.num_pending += 1

    def on_sampled(self, out: SchedulerOutput, sampled: dict[str, int | list[int]]) -> list[Request]:
        """The step's sampled tokens are on the host: append them and apply token-level stops.
        A speculating request gets a list, its accepted tokens (speculative.accept): they are
        appended up to the first stop, and the positions of its rejected drafts stop counting as
        computed. A token of a request that ended while the step ran (abort, or a stop found one
        step late) is surplus and dropped. Returns the requests that received tokens (finished
        ones included, already freed)."""
        got_token = []
        for seq in out.seqs:
            if not seq.sample:
                continue
            req = seq.request
            req.num_pending -= 1
            if req.is_finished:
                continue
            tokens = sampled[req.request_id]
            if isinstance(tokens, int):
                tokens = (tokens,)
            elif seq.spec_token_ids:  # roll back the rejected drafts' positions
                req.num_computed_tokens -= len(seq.spec_token_ids) + 1 - len(tokens)
                req.spec_token_ids = []
            got_token.append(req)
            status = None
            for token in tokens:
                req.token_ids.append(token)
                status = self._check_stop(req, token)
                if status is not None:
                    break
            if req.status == RequestStatus.RUNNING:  # (not when preempted after this step was launched)
                self.kv.commit(req)
            if status is not None:
                self.finish_request(req.request_id, status)
        return got_token

    def update(self, out: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """on_launched then on_sampled: one synchronous step."""
        self.on_launched(out)
        return self.on_sampled(out, sampled)

    def _check_stop(self, req: Request, token: int) -> RequestStatus | None:
        p = req.params
        # (an output its grammar lets end only with EOS ends there, min_tokens or not: structured outputs)
        if req.num_output_tokens >= p.min_tokens or (req.grammar is not None and req.grammar.only_eos):
            if token in p._eos_token_ids and not p.ignore_eos:
                if token != p._eos_token_id:  # generation_config's other EOS ids: stop tokens to vLLM
                    req.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
            if token in p.stop_token_ids:
                req.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if self._at_length_limit(req):
            return RequestStatus.FINISHED_LENGTH
        return None

    def _at_length_limit(self, req: Request, pending: int = 0) -> bool:
        """max_tokens or max_model_len reached, counting `pending` tokens still on the device."""
        total = req.num_tokens + pending
        return total - req.num_prompt_tokens >= req.max_tokens or total >= self.max_model_len
