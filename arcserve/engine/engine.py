"""LLMEngine: the synchronous engine the offline API, the server and researchers drive.

step() = schedule -> execute (runner) -> update (scheduler) -> detokenize / stop strings -> outputs.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

import torch

from arcserve.config import EngineArgs
from arcserve.engine.inputs import InputProcessor, refuse_lora
from arcserve.engine.kv_budget import plan_kv_cache
from arcserve.engine.kv_cache import KVCacheManager
from arcserve.engine.metrics import EngineMetrics
from arcserve.engine.output_processor import OutputProcessor, RequestGroup
from arcserve.engine.request import Request, RequestStatus
from arcserve.engine.runner import ModelRunner, StepHandle, resolve_kv_cache_dtype
from arcserve.engine.scheduler import Scheduler, SchedulerOutput
from arcserve.engine.speculative import DraftLength, accept
from arcserve.kernels import get_ops
from arcserve.models.loader import load_model
from arcserve.outputs import RequestOutput
from arcserve.platform import keep_host_memory_mapped, resolve_device
from arcserve.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger("arcserve")

# Per-step token budget when none is given: on GPUs large prompt chunks keep the prefill phase short
# (a 256-request throughput run on the H100 spent 975 ms in 75 mixed steps at 2,048 tokens, 570 ms
# in 18 at 8,192, 437 ms in 9 at 16,384; gpu_bench.py throughput --timeline); vLLM's default is 8,192
# for its server on large GPUs. On the CPU a step's time grows with its tokens: 2,048 bounds the pause
# a prompt chunk puts into the decodes beside it.
DEFAULT_MAX_NUM_BATCHED_TOKENS = {"cpu": 2048}
GPU_MAX_NUM_BATCHED_TOKENS = 8192


class LLMEngine(InputProcessor):
    def __init__(self, args: EngineArgs) -> None:
        super().__init__(args)
        cfg = self.model_config
        self.device = resolve_device(args.device)
        if self.device.type == "cpu":
            keep_host_memory_mapped()
        self.dtype = cfg.resolve_dtype(args.dtype)
        torch.manual_seed(args.seed)

        t0 = time.time()
        ops = get_ops(args.kernels, self.device, compiled=not args.enforce_eager)
        kv_dtype = resolve_kv_cache_dtype(args.kv_cache_dtype, self.dtype, self.device, ops.name)
        self.model = load_model(cfg, self.dtype, self.device, ops, self.max_model_len, args.load_format, args.seed)
        self.model.kv_cache_dtype = kv_dtype
        logger.info(
            "Loaded %s (%s, %d layers) as %s on %s in %.1f s%s", args.model, cfg.architecture,
            cfg.num_layers, str(self.dtype).removeprefix("torch."), self.device, time.time() - t0,
            "" if kv_dtype == self.dtype else f"; KV cache in {str(kv_dtype).removeprefix('torch.')}",
        )  # fmt: skip
        self.max_num_batched_tokens = args.max_num_batched_tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS.get(
            self.device.type, GPU_MAX_NUM_BATCHED_TOKENS
        )
        spec = args.speculative_config
        self.draft_model = None
        if spec is not None and spec.method == "draft_model":  # loaded before the KV cache is sized
            from arcserve.engine.draft import load_draft_model

            self.draft_model = load_draft_model(spec.model, self, ops)
        num_blocks, mirror_bytes = plan_kv_cache(args, self.model, self.draft_model, self.max_model_len,
                                                 self.max_num_batched_tokens)  # fmt: skip
        self.runner = ModelRunner(self.model, num_blocks, args.block_size, args.seed, self.max_model_len,
                                  args.max_num_seqs, mirror_bytes)  # fmt: skip
        self.runner.prepare(args.enforce_eager, self.max_num_batched_tokens)
        self.kv = KVCacheManager(num_blocks, args.block_size, args.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.kv, self.policy, args.max_num_seqs,
            self.max_num_batched_tokens, self.max_model_len,
        )  # fmt: skip
        self.outputs = OutputProcessor(self.tokenizer)
        self.metrics = EngineMetrics(self.max_model_len)
        # Overlapped steps: on by default on GPUs; the synchronous loop stays for the CPU and debugging.
        self.async_scheduling = args.async_scheduling if args.async_scheduling is not None else self.device.type != "cpu"
        self._in_flight: StepHandle | None = None
        # The steps step() is working on (the one it schedules, the one in flight): fail_step()
        # fails their requests when it raises; None in the list while the scheduler runs, the
        # requests drafts are proposed for while the proposer runs.
        self._stepping: list[SchedulerOutput | list[Request] | None] = []
        self._salvage: list[RequestOutput] = []  # outputs a step built before it failed
        self._failures = 0  # steps failed in a row
        # Called with each scheduled step before it is launched; tests inject faults through it
        # (ARCSERVE_FAULT_TOKEN=<id>: a step holding a request whose prompt has that token raises).
        self.fault_hook: Callable[[SchedulerOutput], None] | None = _fault_hook_from_env()
        self.proposer = None
        if spec is not None:
            self.draft_length = DraftLength(spec.num_speculative_tokens)
            self._spec_logged = time.monotonic()
            if spec.method == "ngram":
                from arcserve.engine.ngram import NgramProposer

                self.proposer = NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
            else:
                from arcserve.engine.draft import DraftProposer

                self.proposer = DraftProposer(self.draft_model, num_blocks, args, self.max_model_len,
                                              self.max_num_batched_tokens)  # fmt: skip
            logger.info("Speculative decoding: %s, up to %d draft tokens per step",
                        spec.method if spec.method == "ngram" else f"draft model {spec.model}",
                        spec.num_speculative_tokens)  # fmt: skip

    # ---- requests ---------------------------------------------------------------------------
    def add_prepared(self, prepared: tuple[RequestGroup, list[Request]]) -> None:
        """Queue a request made by prepare_request (possibly in another thread or process)."""
        group, children = prepared
        if group.request_id in self.outputs.groups:
            raise ValueError(f"request_id {group.request_id!r} is already in use")
        for req in children:  # n > 1: the sequences' ids ("0_<id>", ...) must be free as well
            if req.request_id in self.outputs.seq_of or req.request_id in self.scheduler.requests:
                raise ValueError(
                    f"request_id {group.request_id!r}: its sequence id {req.request_id!r} is already in use"
                )
        grammar = children[0].params._grammar
        if grammar is not None:  # each sequence follows the grammar on its own (made here: not picklable)
            for req, c in zip(children, self.grammars.matchers(grammar, len(children))):
                req.grammar = c
        try:  # (the policy is researchers' code: its failure refuses the request, changing nothing)
            keys = [self.scheduler.queue_key(req) for req in children]
        except Exception as e:
            raise ValueError(f"request_id {group.request_id!r}: the scheduling policy "
                             f"({type(self.scheduler.policy).__name__}) failed on it: {type(e).__name__}: {e}") from e  # fmt: skip
        self.outputs.add(group, children)
        for req, key in zip(children, keys):
            self.scheduler.add_request(req, key)

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> LLMEngine:
        return cls(engine_args)

    def get_tokenizer(self):
        return self.tokenizer

    def add_request(
        self,
        request_id: str,
        prompt,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        lora_request=None,
        tokenization_kwargs: dict | None = None,
        trace_headers=None,
        priority: int = 0,
        output_kind: RequestOutputKind | None = None,
    ) -> str:
        """Validate and queue a request; returns its id. vLLM's arguments, in vLLM's order.
        Raises ValueError (TypeError for a request_id that is not a str) and changes nothing on bad
        input. tokenization_kwargs: {"add_special_tokens": bool} for a text prompt; trace_headers
        (tracing metadata) are not used; lora_request must be None (no LoRA adapters); output_kind
        (arcserve's) overrides the params' without touching the caller's params."""
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a string, got {type(request_id).__name__}")
        refuse_lora(lora_request)
        self.add_prepared(self.prepare_request(request_id, prompt, params, arrival_time, priority, output_kind,
                                               tokenization_kwargs))  # fmt: skip
        return request_id

    def abort_request(self, request_id: str | list[str]) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            group = self.outputs.remove(rid)
            if group is None:
                continue
            for s in group.seqs:
                if self.scheduler.finish_request(s.req.request_id, RequestStatus.FINISHED_ABORTED):
                    self._record_finish(s.req)

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Forget every cached prefix (vLLM's name): later requests compute their prompts afresh.
        While requests hold KV blocks: False, changing nothing (vLLM's rule), or with
        reset_running_requests their blocks' hashes go too (they keep their own KV: vLLM recomputes
        it because its weights may have changed, which arcserve's never do)."""
        return self.kv.reset_prefix_cache(reset_running_requests)

    def has_unfinished_requests(self) -> bool:
        return bool(self.outputs.groups)

    def get_num_unfinished_requests(self) -> int:
        return len(self.outputs.groups)

    # ---- one step ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One scheduling step (see _step). If it raises, call fail_step() before the next one."""
        self._stepping = [self._in_flight.sched] if self._in_flight is not None else []
        self._salvage = []
        outs = self._step()
        self._stepping, self._salvage, self._failures = [], [], 0
        return outs

    def fail_step(self) -> tuple[list[RequestOutput], list[str]]:
        """After step() raised: abort the requests of the steps it was working on (the step it
        scheduled and the one in flight; the requests it was proposing drafts for; every running
        request if the scheduler itself failed), freeing their blocks. Returns the outputs the step
        had already built (of the step it read before failing: deliver them) and the request ids
        (of the groups) that failed. Requests in none of those steps, e.g. waiting ones, are
        untouched and the engine serves on. If that leaves nothing to blame, or steps fail three
        times in a row, every unfinished request fails: a fault that outlives its requests (a
        waiting request that breaks the scheduler) must not loop forever."""
        children: list[Request] = []
        for part in self._stepping:
            if part is None:
                children += self.scheduler.running
            elif isinstance(part, SchedulerOutput):
                children += [s.request for s in part.seqs]
            else:  # the requests drafts were proposed for
                children += part
        outs, self._salvage = self._salvage, []
        self._stepping, self._in_flight = [], None
        self._failures += 1
        # by the Request itself: an aborted request's id may already name a new request
        seqs = [self.outputs.seq_of.get(r.request_id) for r in children]
        ids = {got[0].request_id for r, got in zip(children, seqs) if got is not None and got[1].req is r}
        if not ids or self._failures >= 3:
            ids = set(self.outputs.groups)
        self.abort_request(sorted(ids))
        return outs, sorted(ids)

    def _schedule(self) -> SchedulerOutput:
        self._stepping.append(None)  # the scheduler runs: a failure here may touch any running request
        sched = self.scheduler.schedule()
        self._stepping[-1] = sched
        if self.fault_hook is not None and not sched.is_empty:
            self.fault_hook(sched)
        return sched

    def _step(self) -> list[RequestOutput]:
        """One scheduling step. Synchronous: schedule, run, read the sampled tokens, emit outputs.
        Overlapped (async_scheduling): schedule and launch step N+1, then read step N's tokens
        (which the device finished while the host scheduled) and emit its outputs; step N+1 takes
        step N's tokens on the device. Stops are applied one step late: a request that stopped at
        step N computed one surplus token in step N+1, which is dropped. A step with a row that
        samples from its output so far on the host (bad words of several tokens, structured outputs)
        is launched up to its LM head and samples once step N's tokens are read."""
        due = self._spec_due() if self.proposer is not None else None
        if not self.async_scheduling:
            if due:
                self._propose(due)
            sched = self._schedule()
            if sched.is_empty:
                return []
            handle = self.runner.launch(sched)
            self.scheduler.on_launched(sched)
            return self._finish(handle)
        prev, self._in_flight = self._in_flight, None
        outs: list[RequestOutput] = []
        # Read the previous step first when it verified drafts (how many were accepted decides the
        # next positions), or when requests speculate now (proposals start from the tokens on the host).
        if prev is not None and (prev.row_counts is not None or due):
            outs, prev = self._finish(prev), None
            self._salvage = outs  # built and taken out of the engine: delivered even if the rest fails
        if due:
            self._propose(due)
        sched = self._schedule()
        handle = None
        if not sched.is_empty:
            handle = self._in_flight = self.runner.launch(sched, defer_history=prev is not None)
            self.scheduler.on_launched(sched)
        if prev is not None:
            outs = self._finish(prev)
            self._salvage = outs
        if handle is not None and handle.pending is not None:  # its rows sample from what prev's tokens made
            self.runner.sample(handle)
        return outs

    def _spec_due(self) -> list[Request]:
        """The running requests that decode next and speculate in this step (not paused)."""
        tick = self.draft_length.tick
        # (not structured outputs: drafts are proposed without the grammar, and their rows' masks would
        # need the drafts before them consumed)
        return [r for r in self.scheduler.running if r.num_uncomputed == 1 and r.grammar is None and tick(r)]

    def _propose(self, due: list[Request]) -> None:
        """Drafts for the due requests (speculative.py), with every token on the host. While it
        runs, `due` are the requests a failure fails (see fail_step)."""
        self._stepping.append(due)
        wanted = []
        limit = self.max_model_len
        for req in due:
            if req.status != RequestStatus.RUNNING or req.num_pending or req.num_uncomputed != 1:
                continue  # finished or preempted by the step read just now
            # a step yields up to k + 1 tokens: stay within max_tokens and max_model_len
            room = min(req.max_tokens - req.num_output_tokens, limit - req.num_tokens) - 1
            k = min(self.draft_length.state(req).k, room)
            if k > 0:
                wanted.append((req, k))
        self.proposer.propose(wanted, self.scheduler.running)
        if self.proposer.empty_is_miss:  # prompt lookup that found nothing: a miss (pauses lookups)
            for req, _ in wanted:
                if not req.spec_token_ids:
                    self.draft_length.update(req, 0, 0)
        self._stepping.pop()

    def _verify(self, handle: StepHandle, tokens: dict) -> dict[str, int]:
        """Replace each speculating request's row tokens by its accepted tokens; count them.
        Returns each speculating request's token count before this step's tokens."""
        counts, before = [], {}
        for seq in handle.sched.seqs:
            drafts = seq.spec_token_ids
            if drafts:
                rid = seq.request.request_id
                before[rid] = seq.request.num_tokens
                tokens[rid] = got = accept(drafts, tokens[rid])
                self.draft_length.update(seq.request, len(drafts), len(got) - 1)
                counts.append((len(drafts), len(got) - 1))
        self.metrics.on_spec(counts)
        now = time.monotonic()
        if now - self._spec_logged >= 10.0:
            self._spec_logged = now
            s = self.metrics.spec
            if s.num_drafts:
                logger.info(
                    "Speculative decoding: mean acceptance length %.2f, %d of %d draft tokens accepted (%.1f%%), "
                    "accepted per position %s", s.mean_acceptance_length, s.num_accepted_tokens,
                    s.num_draft_tokens, 100.0 * s.num_accepted_tokens / s.num_draft_tokens, s.accepted_per_pos,
                )  # fmt: skip
        return before

    def _finish(self, handle: StepHandle) -> list[RequestOutput]:
        """Read a launched step's tokens (waiting for the device) and turn them into outputs."""
        result = handle.result()
        if result.prompt_logprobs:
            # to the step's own requests: an id aborted since the launch may name a new request now
            step_reqs = {s.request.request_id: s.request for s in handle.sched.seqs}
            for rid, entries in result.prompt_logprobs.items():
                self.outputs.on_prompt_logprobs(step_reqs[rid], entries)
        before = self._verify(handle, result.tokens) if handle.row_counts is not None else None
        got = self.scheduler.on_sampled(handle.sched, result.tokens)
        now = time.time()
        touched: dict[str, RequestGroup] = {}
        ttfts, itls, prompt_tokens = [], [], 0
        logprobs = result.logprobs
        for req in got:
            m = req.metrics
            rid = req.request_id
            spec_before = before.get(rid) if before is not None else None  # a speculating request
            if spec_before is None:
                if req.grammar is not None:
                    err = req.grammar.advance(req.token_ids[-1])
                    if err is not None:  # (the sequence ends with EOS next: say why, once)
                        logger.warning("request %s: the grammar engine stopped its structured output: %s",
                                       rid, err.strip().splitlines()[0] if err.strip() else err)  # fmt: skip
                stop_str = self.outputs.on_token(req, req.token_ids[-1], logprobs.get(rid) if logprobs else None)
                new = 1
            else:  # (its tokens after a stop string are dropped here: count what remains)
                stop_str = self._on_tokens(req, spec_before, logprobs.get(rid))
                new = req.num_tokens - spec_before
            if m.first_token_time is None:  # (a prompt's last token can come with drafts too)
                ttfts.append(now - m.arrival_time)
                prompt_tokens += req.num_prompt_tokens
                m.first_token_time = now
                itls += [0.0] * (new - 1)  # drafts accepted with the first token came with it
            elif new == 1:
                itls.append(now - m.last_token_time)
            else:  # the step's tokens share its interval equally
                itls += [(now - m.last_token_time) / new] * new
            m.last_token_time = now
            if stop_str is not None:  # a stop string wins over a length stop in the same step
                if req.is_finished:
                    req.status = RequestStatus.FINISHED_STOPPED
                else:
                    self.scheduler.finish_request(req.request_id, RequestStatus.FINISHED_STOPPED)
            if req.is_finished:
                self.outputs.on_finish(req, req.status.value, stop_str if stop_str is not None else req.stop_reason)
                self._record_finish(req)
            group, _ = self.outputs.seq_of[req.request_id]
            touched[group.request_id] = group
        self.metrics.on_tokens(ttfts, prompt_tokens, itls)
        outs = []
        for group in touched.values():
            out = self.outputs.make_output(group)
            if out is not None:
                outs.append(out)
            if group.finished:
                self.outputs.remove(group.request_id)
        return outs

    def _on_tokens(self, req: Request, before: int, lps: list | None) -> str | None:
        """Detokenize the tokens a speculating request got this step (each with its own row's
        logprobs); a stop string drops the tokens after it."""
        new = req.num_tokens - before
        for j in range(new):
            stop_str = self.outputs.on_token(req, req.token_ids[before + j], lps[j] if lps else None, before + j + 1)
            if stop_str is not None:
                del req.token_ids[before + j + 1 :]
                return stop_str
        return None

    # ---- figures ------------------------------------------------------------------------------
    def _record_finish(self, req: Request) -> None:
        m = req.metrics
        now = time.time()
        queue = None if m.first_scheduled_time is None else m.first_scheduled_time - m.arrival_time
        self.metrics.on_finish(req.status.value, req.num_prompt_tokens, req.num_output_tokens, now - m.arrival_time, queue)

    def get_metrics(self) -> dict:
        """Every figure the server exports, by its Prometheus name (histograms as dicts with count,
        sum and cumulative buckets; finished requests by reason under request_success_total)."""
        st = self.scheduler.stats()
        m = self.metrics
        with m.lock:
            out = {
                "arcserve:num_requests_running": st.num_running,
                "arcserve:num_requests_waiting": st.num_waiting,
                "arcserve:kv_cache_usage_perc": st.kv_cache_usage,
                "arcserve:prefix_cache_queries_total": st.prefix_cache_queries,
                "arcserve:prefix_cache_hits_total": st.prefix_cache_hits,
                "arcserve:prompt_tokens_total": m.prompt_tokens,
                "arcserve:generation_tokens_total": m.generation_tokens,
                "arcserve:request_success_total": dict(m.success),
                "arcserve:num_preemptions_total": st.num_preemptions,
                "arcserve:spec_decode_num_drafts_total": m.spec.num_drafts,
                "arcserve:spec_decode_num_draft_tokens_total": m.spec.num_draft_tokens,
                "arcserve:spec_decode_num_accepted_tokens_total": m.spec.num_accepted_tokens,
                "arcserve:spec_decode_num_accepted_tokens_per_pos": dict(enumerate(m.spec.accepted_per_pos)),
            }
            for name, h in m.hist.items():
                out[f"arcserve:{name}"] = {"count": h.count, "sum": h.sum, "buckets": h.cumulative()}
        return out


def _fault_hook_from_env() -> Callable[[SchedulerOutput], None] | None:
    """The test hook of ARCSERVE_FAULT_TOKEN (unset: none): a step that holds a request whose prompt
    contains that token id raises, as a fault inside a step would (tests of fault isolation)."""
    raw = os.environ.get("ARCSERVE_FAULT_TOKEN")
    if not raw:
        return None
    token = int(raw)

    def hook(sched: SchedulerOutput) -> None:
        if any(token in s.request.token_ids[: s.request.num_prompt_tokens] for s in sched.seqs):
            raise RuntimeError(f"injected fault (ARCSERVE_FAULT_TOKEN={token})")

    return hook
