"""Draft-model proposer: a smaller model with the target's tokenizer guesses the next k tokens.

The draft runs on its own ModelRunner (own paged KV cache, own block manager, own captured graphs on
GPUs), batched across the requests that speculate. Per step and request it runs a catch-up chunk (the
tokens its cache lacks: the whole prompt the first time, then the tokens accepted since) whose last
position gives the first draft, then k - 1 one-token steps, each fed the previous draft on the device
(the host reads all k drafts once, at the end). Drafts are the draft model's argmax: a one-token
proposal, which speculative.accept verifies exactly (see there).

The draft's cache never decides what the target outputs, only how much of it is guessed right, so
its bookkeeping stays simple: positions of drafts that the target rejected are recomputed at the next
catch-up, requests that stop running (finished, preempted) drop their draft blocks, and a request the
draft cache has no room for proposes nothing that step.
"""

from __future__ import annotations

from arcserve.config import EngineArgs
from arcserve.engine.inputs import check_max_model_len
from arcserve.engine.kv_cache import KVCacheManager
from arcserve.engine.request import Request
from arcserve.engine.runner import ModelRunner
from arcserve.engine.scheduler import ScheduledSeq, SchedulerOutput
from arcserve.models.config import ModelConfig
from arcserve.models.decoder import DecoderModel
from arcserve.models.hf_files import load_tokenizer
from arcserve.models.loader import load_model
from arcserve.sampling_params import SamplingParams

_ARGMAX = SamplingParams(temperature=0.0)


def load_draft_model(path: str, engine, ops) -> DecoderModel:
    """The draft model in the target's dtype, device and kernels. Its vocabulary must be the
    target's: same size, and the same tokens where the draft folder has a tokenizer."""
    cfg = ModelConfig.from_dir(path)
    target = engine.model_config
    if cfg.vocab_size != target.vocab_size:
        raise ValueError(
            f"The draft model {path} has a vocabulary of {cfg.vocab_size} tokens, the target {target.vocab_size}: "
            "a draft model must share the target's tokenizer"
        )
    try:
        tok = load_tokenizer(path, engine.args.trust_remote_code)
    except Exception:  # no tokenizer files in the draft folder: the vocabulary size is all we can check
        tok = None
    if tok is not None and tok.get_vocab() != engine.tokenizer.get_vocab():
        raise ValueError(
            f"The draft model {path} has another tokenizer than the target (their vocabularies differ): "
            "a draft model must share the target's tokenizer"
        )
    check_max_model_len(engine.max_model_len, cfg, f"the draft model {path}")
    a = engine.args
    model = load_model(cfg, engine.dtype, engine.device, ops, engine.max_model_len, a.load_format, a.seed)
    model.kv_cache_dtype = engine.model.kv_cache_dtype
    return model


class _DraftSeq:
    """The draft's view of a request: what ModelRunner reads of a request, plus its draft state."""

    def __init__(self, req: Request) -> None:
        self.request_id, self.seq_no = req.request_id, req.seq_no
        self.token_ids: list[int] = req.token_ids  # the request's own list, read only
        self.num_computed_tokens = 0  # positions in the draft's cache
        self.params, self.seed, self.sampling_row, self.prompt_logprobs = _ARGMAX, None, None, None
        self.base = 0  # the request's length when the last drafts were made
        self.drafts: list[int] = []


class DraftProposer:
    empty_is_miss = False  # no drafts only while catching up or when the cache is full

    def __init__(self, model: DecoderModel, num_blocks: int, args: EngineArgs, max_model_len: int,
                 max_num_batched_tokens: int) -> None:  # fmt: skip
        self.kv = KVCacheManager(num_blocks, args.block_size, enable_prefix_caching=False)
        self.runner = ModelRunner(model, num_blocks, args.block_size, args.seed, max_model_len, args.max_num_seqs)
        self.runner.prepare(args.enforce_eager, max_num_batched_tokens, "Draft model: ", sampler=False)
        self.budget = max_num_batched_tokens  # catch-up tokens per step
        self.seqs: dict[int, _DraftSeq] = {}  # by request seq_no

    def _seq(self, req: Request) -> _DraftSeq:
        ds = self.seqs.get(req.seq_no)
        if ds is None:
            ds = self.seqs[req.seq_no] = _DraftSeq(req)
        elif ds.drafts:  # the cache keeps the drafts the target accepted (those it was fed: all but the last)
            fed = ds.drafts[:-1]
            got = req.token_ids[ds.base : ds.base + len(fed)]
            n = next((i for i, (a, b) in enumerate(zip(fed, got)) if a != b), min(len(fed), len(got)))
            if ds.base + n < ds.num_computed_tokens and self.runner.decode_mirror is not None:
                self.runner.decode_mirror.forget(req.seq_no)  # its row holds rejected drafts' K/V
            ds.num_computed_tokens = min(ds.num_computed_tokens, ds.base + n)
            ds.drafts = []
        # the last token always runs again: its logits give the first draft (it may be in the cache
        # already when the last proposal was not verified: its request was not scheduled)
        ds.num_computed_tokens = min(ds.num_computed_tokens, req.num_tokens - 1)
        ds.token_ids = req.token_ids
        return ds

    def _step(self, seqs: list[ScheduledSeq]) -> SchedulerOutput:
        return SchedulerOutput(seqs, sum(s.num_new_tokens for s in seqs), block_tables=self.kv.block_tables(seqs))

    def propose(self, wanted: list[tuple[Request, int]], running: list[Request]) -> None:
        """Set spec_token_ids of each (request, k) to k drafts (none where the draft cache is full or
        still catching up on a long prompt); drop the draft state of requests not running."""
        live = {r.seq_no for r in running}
        for key in [s for s in self.seqs if s not in live]:
            self.kv.free(self.seqs.pop(key))
        budget = self.budget
        first: list[ScheduledSeq] = []
        active: list[tuple[Request, _DraftSeq, int]] = []
        for req, k in wanted:
            ds = self._seq(req)
            n = req.num_tokens - ds.num_computed_tokens
            if budget <= 0:
                break
            done = n <= budget
            chunk = n if done else budget  # a long catch-up takes several steps (no drafts meanwhile)
            if not self.kv.allocate(ds, chunk + (k - 1 if done else 0)):
                continue
            first.append(ScheduledSeq(ds, ds.num_computed_tokens, chunk, done))
            ds.num_computed_tokens += chunk
            budget -= chunk
            if done:
                active.append((req, ds, k))
        if not first:
            return
        handles = [self.runner.launch(self._step(first))]
        for j in range(1, max((k for _, _, k in active), default=1)):
            seqs = []
            for _, ds, k in active:  # one token each, fed on the device from the previous step
                if k > j:
                    seqs.append(ScheduledSeq(ds, ds.num_computed_tokens, 1, True))
                    ds.num_computed_tokens += 1
            handles.append(self.runner.launch(self._step(seqs)))
        results = [h.result().tokens for h in handles]
        for req, ds, k in active:
            ds.base = req.num_tokens
            ds.drafts = req.spec_token_ids = [results[j][ds.request_id] for j in range(k)]

