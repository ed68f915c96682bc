"""ModelRunner: SchedulerOutput -> flattened input tensors -> model -> sampler -> token ids.

launch() issues a step without waiting for the device and returns a StepHandle; its result() reads
the sampled ids (the step's one host-device sync). The engine calls result() at once (synchronous
loop) or after launching the next step (overlapped steps).

Owns the KV cache tensors. Builds one unpadded batch per step: the new tokens of every scheduled
sequence back to back, their positions, the slot of each token in the paged cache, the block tables,
and the index of each sampling sequence's last token (the only rows that reach the LM head).
Everything is built with vectorised numpy over the step's tokens, never a Python loop over tokens.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from arcserve.config import KV_CACHE_DTYPES
from arcserve.engine.sampler import Sampler, num_sampled
from arcserve.engine.scheduler import SchedulerOutput
from arcserve.engine.step_graphs import StepGraphs, decode_sizes, feed_tokens, warm_feed_tokens
from arcserve.kernels.reference import AttentionMetadata
from arcserve.models.decoder import DecoderModel
from arcserve.outputs import Logprob
from arcserve.platform import (
    fp8_kv_cache_unsupported,
    graphs_supported,
    memory_info,
    new_event,
    to_device,
    to_host_async,
    wait_event,
)

log = logging.getLogger("arcserve")


@dataclass
class StepResult:
    # request id -> sampled token; for a speculating request, the list of its rows' tokens
    tokens: dict[str, int | list[int]]
    # request id -> (token logprob, entries); for a speculating request, a list of them by row
    logprobs: dict[str, tuple[float, dict[int, Logprob]] | list]
    prompt_logprobs: dict[str, list[dict[int, Logprob]]]  # request id -> entries for new prompt tokens


@dataclass
class StepHandle:
    """A launched step: its sampled tokens (and logprobs) are being copied to the host behind the
    step's work on the device. result() waits for them: the step's one host-device sync."""

    sched: SchedulerOutput
    reqs: list  # the sampling requests, in row order
    prompt_logprobs: dict
    tokens: torch.Tensor | None = None  # host (pinned) copies, valid after `event`
    logprob_rows: list[int] | None = None
    logprob_parts: tuple = ()  # token logprob, rank, top-k ids, top-k logprobs (or None)
    event: object = None
    # The sampler's inputs (logits, draft offsets, the rows' tokens sampled before the step when it
    # is deferred, the rows' packed parameters) until ModelRunner.sample issues it (launch, or later).
    pending: tuple | None = None
    # Speculative decoding: rows per sampling request (reqs then repeats each request that often).
    row_counts: list[int] | None = None

    def result(self) -> StepResult:
        if self.tokens is None:
            return StepResult({}, {}, self.prompt_logprobs)
        wait_event(self.event)
        tokens = self.tokens.tolist()
        reqs = self.reqs
        result = StepResult({r.request_id: t for r, t in zip(reqs, tokens)}, {}, self.prompt_logprobs)
        if self.row_counts is not None:  # speculating requests: every row's token, in order
            i = 0
            for c in self.row_counts:
                if c > 1:
                    result.tokens[reqs[i].request_id] = tokens[i : i + c]
                i += c
        if self.logprob_rows:
            tok_lp, ranks = (x.tolist() for x in self.logprob_parts[:2])
            top_ids, top_lp = self.logprob_parts[2:]
            ks = [reqs[i].params.logprobs for i in self.logprob_rows]
            if top_ids is not None and min(ks) == top_ids.shape[1]:  # one conversion when all rows want it all
                top_ids, top_lp = top_ids.tolist(), top_lp.tolist()
            elif top_ids is not None:  # each row only its own k (a vocabulary-wide row beside narrow ones)
                top_ids = [top_ids[j, :k].tolist() for j, k in enumerate(ks)]
                top_lp = [top_lp[j, :k].tolist() for j, k in enumerate(ks)]
            for j, i in enumerate(self.logprob_rows):
                req = reqs[i]
                entries = _entries(tokens[i], tok_lp[j], ranks[j], top_ids, top_lp, j, req.params.logprobs)
                if isinstance(result.tokens[req.request_id], list):
                    result.logprobs.setdefault(req.request_id, []).append((tok_lp[j], entries))
                else:
                    result.logprobs[req.request_id] = (tok_lp[j], entries)
        return result


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype, device: torch.device, kernels: str) -> torch.dtype:
    """The KV cache's element type for EngineArgs.kv_cache_dtype: auto = the model's dtype; fp8
    (= fp8_e4m3) and fp8_e5m2 = 8-bit floats with a scale of 1.0 (vLLM's default without
    calibrated scales): K/V are rounded to the nearest 8-bit value and saturate at its largest
    finite one (448 for e4m3, 57,344 for e5m2). kernels: the resolved kernel set ("torch" or
    "triton"). Raises ValueError where the device (or kernel set) cannot run it."""
    if KV_CACHE_DTYPES[name] is None:
        return model_dtype
    dtype = getattr(torch, KV_CACHE_DTYPES[name])
    why = fp8_kv_cache_unsupported(device, dtype, kernels == "triton")
    if why:
        raise ValueError(f"kv_cache_dtype={name!r} cannot run on {device}: {why}")
    return dtype


def scratch_meta(lens: list[int], block_size: int, device: torch.device,
                  q_lens: list[int] | None = None) -> AttentionMetadata:  # fmt: skip
    """Metadata of sequences of the given context lengths over blocks 0, 1, 2, ..., each computing
    its last q_lens[i] positions (default: all of them, fresh prefills), for steps run outside the
    scheduler (profiling, warm-up)."""
    q_lens = lens if q_lens is None else q_lens
    nblk = [-(-n // block_size) for n in lens]
    tables = np.zeros((len(lens), max(nblk)), dtype=np.int64)
    first = np.cumsum([0] + nblk[:-1])
    for i, n in enumerate(nblk):
        tables[i, :n] = np.arange(first[i], first[i] + n)
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int64)
    seq_lens = np.array(lens, dtype=np.int64)
    pos = np.concatenate([np.arange(n - q, n) for n, q in zip(lens, q_lens)])
    seq_of = np.repeat(np.arange(len(lens)), q_lens)
    slots = tables[seq_of, pos // block_size] * block_size + pos % block_size
    return AttentionMetadata(
        query_start_loc=torch.from_numpy(qsl.astype(np.int32)).to(device),
        seq_lens=torch.from_numpy(seq_lens.astype(np.int32)).to(device),
        block_tables=torch.from_numpy(tables.astype(np.int32)).to(device),
        slot_mapping=torch.from_numpy(slots).to(device),
        host={"query_start_loc": qsl, "seq_lens": seq_lens, "seq_ids": np.arange(len(lens)), "decode_mirror": None},
    )


class ModelRunner:
    def __init__(self, model: DecoderModel, num_blocks: int, block_size: int, seed: int,
                 max_model_len: int | None = None, max_num_seqs: int = 256,
                 mirror_bytes: int | None = None) -> None:  # fmt: skip
        """mirror_bytes: memory for the CPU's decode mirror, written at startup (the engine carves
        it out of the KV cache's default budget); None: an arena bounded by the KV cache's size and
        a quarter of the free memory, mapped at the mirror's first growth and filled in by the OS
        as its pages are first written (a draft model's runner, budgets given by the user)."""
        self.model = model
        self.block_size = block_size
        self.device = model.device
        self.max_model_len = max_model_len or model.cos_sin.shape[0]
        self.max_num_seqs = max_num_seqs
        self.graphs: StepGraphs | None = None
        cfg = model.cfg
        self.kv = torch.zeros(
            cfg.num_layers, 2, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim,
            dtype=model.kv_cache_dtype, device=self.device,
        )  # fmt: skip
        self.kv_caches = [(self.kv[i, 0], self.kv[i, 1]) for i in range(cfg.num_layers)]
        self.sampler = Sampler(self.device, seed, model.ops.sample_from_cdf, model.ops.apply_penalties, max_num_seqs)
        # The previous step's sampled tokens (device) and the row of each request in them: the
        # source of tokens that a step computes before the host has read them (overlapped steps).
        self._last_tokens: torch.Tensor | None = None
        self._last_rows: dict[str, int] = {}
        self.decode_mirror = None
        if model.ops.make_decode_mirror is not None:
            budget = mirror_bytes
            if budget is None:
                # room for the paged cache's tokens in the model's dtype (an 8-bit cache's twice its bytes)
                budget = min(self.kv.numel() * model.dtype.itemsize, memory_info(self.device)[0] // 4)
            self.decode_mirror = model.ops.make_decode_mirror(
                cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, model.dtype, self.device, budget,
                max_rows=max_num_seqs, max_len=self.max_model_len, prefault=mirror_bytes is not None,
            )

    def _host_inputs(self, out: SchedulerOutput) -> dict:
        """The step's flattened batch as numpy arrays: token ids, positions, query start offsets,
        context lengths, block tables and the cache slot of every token. A token sampled by the
        previous step and not yet read by the host is fed on the device: its id here is 0 until
        then, and feed_dst / feed_src say where it goes and which row of the previous step's
        sampled tokens holds it."""
        seqs = out.seqs
        bs = self.block_size
        starts = np.fromiter((s.start_pos for s in seqs), dtype=np.int64, count=len(seqs))
        q_lens = np.fromiter((s.num_new_tokens for s in seqs), dtype=np.int64, count=len(seqs))
        T = int(q_lens.sum())
        qsl = np.zeros(len(seqs) + 1, dtype=np.int64)
        np.cumsum(q_lens, out=qsl[1:])
        seq_lens = starts + q_lens
        tables = out.block_tables
        id_lists, feed_dst, feed_src = [], [], []
        for i, s in enumerate(seqs):
            known = s.new_token_ids
            if len(known) < s.num_new_tokens:
                rid = s.request.request_id
                if len(known) != s.num_new_tokens - 1 or rid not in self._last_rows:
                    raise RuntimeError(f"request {rid}: scheduled tokens that no step has sampled")
                feed_dst.append(int(qsl[i + 1]) - 1)
                feed_src.append(self._last_rows[rid])
                known = known + [0]
            id_lists.append(known)
        ids = np.fromiter(itertools.chain.from_iterable(id_lists), dtype=np.int64, count=T)
        seq_of_token = np.repeat(np.arange(len(seqs)), q_lens)
        positions = np.arange(T) - qsl[:-1][seq_of_token] + starts[seq_of_token]
        slots = tables[seq_of_token, positions // bs].astype(np.int64) * bs + positions % bs
        seq_ids = np.fromiter((s.request.seq_no for s in seqs), dtype=np.int64, count=len(seqs))
        return {"ids": ids, "positions": positions, "q_lens": q_lens, "qsl": qsl, "seq_lens": seq_lens,
                "tables": tables, "slots": slots, "seq_ids": seq_ids,
                "feed_dst": np.asarray(feed_dst, dtype=np.int64), "feed_src": np.asarray(feed_src, dtype=np.int64)}  # fmt: skip

    def _prepare(self, h: dict) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        dev = self.device
        meta = AttentionMetadata(
            query_start_loc=to_device(h["qsl"].astype(np.int32), dev),
            seq_lens=to_device(h["seq_lens"].astype(np.int32), dev),
            block_tables=to_device(h["tables"].astype(np.int32), dev),
            slot_mapping=to_device(h["slots"], dev),
            host={
                "query_start_loc": h["qsl"],
                "seq_lens": h["seq_lens"],
                "seq_ids": h["seq_ids"],
                "decode_mirror": self.decode_mirror,
                "kv_cache": self.kv,  # every layer's K/V [layers, 2, blocks, block_size, kv heads, hd]
            },
        )
        ids = to_device(h["ids"], dev)
        if len(h["feed_dst"]):
            feed_tokens(ids, self._last_tokens, h["feed_dst"], h["feed_src"])
        return ids, to_device(h["positions"], dev), meta

    # ---- graphs ---------------------------------------------------------------------------
    def prepare(self, enforce_eager: bool, max_num_batched_tokens: int, what: str = "", sampler: bool = True) -> None:
        """At startup: capture the step graphs where the device has them (graphs_possible), else
        compile the CPU's decode kernels where they apply (warm_up); logs which and how long it
        took, `what` (e.g. "Draft model: ") in front of each line. Then, on GPUs, the sampler's
        kernels (Sampler.warm_up), unless `sampler` is False (a draft model, which takes argmaxes),
        and feed_tokens' reordering path (warm_feed_tokens)."""
        t0, dev = time.time(), self.device
        if self.graphs_possible(enforce_eager):
            n = self.capture_graphs(max_num_batched_tokens)
            log.info("%sCaptured %d step graphs (decode batches up to %d, mixed steps up to %d tokens) in %.1f s",
                     what, n, self.max_num_seqs, max_num_batched_tokens, time.time() - t0)  # fmt: skip
        elif self.warm_up_length() is not None:
            log.info("%sCompiling the CPU's decode kernels (once per process; inductor's disk cache "
                     "makes later starts faster; --enforce-eager skips them)", what)  # fmt: skip
            self.warm_up()
            log.info("%sCompiled them in %.1f s", what, time.time() - t0)
        if sampler and dev.type != "cpu":  # (Triton compiles, and torch's kernels load, at their first launch)
            self.sampler.warm_up(self.model.cfg.vocab_size, self.model.dtype)
        if dev.type != "cpu":  # (eager steps' token ids and indices: int64, indices from the host)
            warm_feed_tokens(torch.zeros(2, dtype=torch.long, device=dev))

    def graphs_possible(self, enforce_eager: bool) -> bool:
        """Graphs need a GPU that has them and attention that plans on the device (the Triton
        kernels), not the torch twin's host plan."""
        dev = self.device
        return dev.type != "cpu" and not enforce_eager and graphs_supported(dev) and self.model.ops.name == "triton"

    def capture_graphs(self, max_num_batched_tokens: int) -> int:
        """Capture decode and mixed-step graphs (step_graphs.py); returns how many."""
        self.graphs = StepGraphs(self.model, self.kv_caches, self.block_size, self.max_model_len,
                                 self.max_num_seqs, max_num_batched_tokens)  # fmt: skip
        return self.graphs.capture()

    def warm_up_length(self) -> int | None:
        """The context length of the one-token step warm_up runs (ops.warm_up_length: half models on
        the CPU; None elsewhere)."""
        return self.model.ops.warm_up_length(self.model.dtype, self.max_model_len)

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Run a one-token step at warm_up_length, then a step decoding two sequences there (the
        decode attention over many mirror rows, cpu_rows_attention.py), so that their kernels
        compile now rather than while a request waits. At startup only (it reads blocks 0, 1, ...
        as the sequences' context, which no request holds yet); what the steps write into the paged
        cache and the decode mirror is zeroed after, and the mirror's rows dropped."""
        n = self.warm_up_length()
        if n is None:
            return
        mirror = self.decode_mirror
        for rows in (1, 2) if self.max_num_seqs > 1 else (1,):
            meta = scratch_meta([n] * rows, self.block_size, self.device, q_lens=[1] * rows)
            meta.host.update(seq_ids=-1 - np.arange(rows), decode_mirror=mirror, kv_cache=self.kv)
            ids = torch.zeros(rows, dtype=torch.long, device=self.device)
            positions = torch.full((rows,), n - 1, device=self.device)
            self._logits(self.model.forward(ids, positions, meta, self.kv_caches), None, rows)
            for slot in meta.slot_mapping.tolist():
                block, offset = divmod(slot, self.block_size)
                self.kv[:, :, block, offset] = 0
            if mirror is not None:
                if mirror.k is not None:
                    mirror.k[:, :rows, :, :n] = 0
                    mirror.v[:, :rows, :, :n] = 0
                mirror.reset()

    # ---- one step -----------------------------------------------------------------------------
    @torch.inference_mode()
    def launch(self, out: SchedulerOutput, defer_history: bool = False) -> StepHandle:
        """Issue the step's work (forward, sampling, copies of the results to the host) without
        waiting for the device (except for prompt logprobs, which are read at once). defer_history:
        when a sampling row reads its output so far on the host (bad words of several
        tokens, structured outputs) while the previous step's tokens are still on the device, stop
        after the LM head; sample(handle), once they are read, issues the rest (the forward runs
        on the device meanwhile)."""
        h = self._host_inputs(out)
        T = int(h["qsl"][-1])
        key = self.graphs.pick(h["q_lens"]) if self.graphs is not None else None
        if key is not None:  # the graph's output: every token's hidden state, then its padding rows
            hidden = self.graphs.run(key, h, self._last_tokens)
        else:
            ids, positions, meta = self._prepare(h)
            hidden = self.model.forward(ids, positions, meta, self.kv_caches)
        handle = StepHandle(out, [], self._prompt_logprobs(out, hidden, h["qsl"]))
        sampling = [i for i, s in enumerate(out.seqs) if s.sample]
        self._last_rows = {}
        if not sampling:
            return handle
        reqs = [out.seqs[i].request for i in sampling]
        offsets = None
        if len(sampling) == T:  # one sampled token per row (decode): no gather
            logits = self._logits(hidden, None, T)
        else:
            last = h["qsl"][1:][sampling] - 1
            if out.num_spec_tokens:  # a speculating request samples at its last token and every draft
                nspec = np.fromiter((len(out.seqs[i].spec_token_ids) for i in sampling), np.int64, len(sampling))
                counts = nspec + 1
                offsets = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
                last = np.repeat(last - nspec, counts) + offsets
                reqs = [r for r, c in zip(reqs, counts.tolist()) for _ in range(c)]
                handle.row_counts = counts.tolist()
            logits = self._logits(hidden, last, len(last))
        rows = self.sampler.rows(reqs, logits.shape[1])
        defer = defer_history and rows[2]
        # (a deferred sampling takes the positions as they stand now, before the step's tokens are pending)
        handle.reqs, handle.pending = reqs, (logits, offsets, [num_sampled(r) for r in reqs] if defer else None, rows)
        if not defer:
            self.sample(handle)
        return handle

    @torch.inference_mode()
    def sample(self, handle: StepHandle) -> None:
        """Issue a launched step's sampling and the copies of its results (launch's, or later)."""
        (logits, offsets, sampled, rows), reqs = handle.pending, handle.reqs
        handle.pending = None
        so = self.sampler(logits, reqs, offsets, sampled, rows)
        self._last_tokens = so.tokens  # (the next step's input takes them on the device)
        self._last_rows = {r.request_id: i for i, r in enumerate(reqs)}
        handle.tokens = to_host_async(so.tokens)
        if so.logprob_rows:
            handle.logprob_rows = so.logprob_rows
            handle.logprob_parts = tuple(
                to_host_async(x) if x is not None else None
                for x in (so.token_logprob, so.token_rank, so.topk_ids, so.topk_logprobs)
            )
        handle.event = new_event(self.device)

    def lm_head_rows(self, n: int) -> int:
        """Rows the LM head runs over for n sampled rows: on accelerators the next decode-graph
        batch size (beyond them, the next multiple of 64), whose products graph capture has run. The
        library's first product at a new row count can wait for the device to drain (H100: F.linear
        over a 151,936 x 1,024 LM head at 8 of 10 new row counts from 22 to 154 blocked the host
        21-23 ms behind ~20 ms of queued work; 0.05-0.08 ms at counts that had run before), which
        left the device idle in every mixed step of a throughput run and once per batch size its
        decode steps passed through. The CPU computes exactly n."""
        if self.device.type == "cpu" or n <= 1:  # (one row takes the matrix-vector kernel)
            return n
        sizes = decode_sizes(self.max_num_seqs)
        return sizes[bisect.bisect_left(sizes, n)] if n <= sizes[-1] else -(-n // 64) * 64

    def _logits(self, hidden: torch.Tensor, rows: np.ndarray | None, n: int) -> torch.Tensor:
        """Logits of n rows, hidden's first n or `rows`, computed over lm_head_rows(n) of them. The
        extra rows: a decode graph's own padding rows (its output has exactly that many), else
        copies of the last row."""
        m = self.lm_head_rows(n)
        if rows is not None:
            if m > n:
                rows = np.concatenate([rows, np.repeat(rows[-1:], m - n)])
            hidden = hidden[to_device(rows, self.device)]
        elif hidden.shape[0] >= m:
            hidden = hidden[:m]
        else:
            hidden = torch.cat([hidden[:n], hidden[n - 1 : n].expand(m - n, -1)])
        return self.model.logits(hidden)[:n]

    def _prompt_logprobs(self, out: SchedulerOutput, hidden: torch.Tensor, qsl: np.ndarray) -> dict:
        """For requests that asked for prompt logprobs: the logprob (and top-k) of every prompt token
        this chunk gives context for, i.e. token p + 1 from the logits at position p. Positions whose
        entries were already collected (before a preemption) are skipped."""
        result = {}
        for i, s in enumerate(out.seqs):
            req = s.request
            if req.prompt_logprobs is None:
                continue
            lo = max(s.start_pos, len(req.prompt_logprobs) - 1)
            hi = min(s.start_pos + s.num_new_tokens, req.num_prompt_tokens - 1)
            if lo >= hi:
                continue
            k = req.params.prompt_logprobs
            entries = []
            for a in range(lo, hi, 256):  # bounded [rows, vocab] logits at a time
                b = min(hi, a + 256)
                rows = torch.arange(a, b, device=self.device) - s.start_pos + int(qsl[i])
                lp = self.model.logits(hidden[rows]).float().log_softmax(dim=-1)
                target = torch.tensor(req.token_ids[a + 1 : b + 1], device=self.device)
                chosen = lp.gather(1, target[:, None])[:, 0]
                ranks = ((lp > chosen[:, None]).sum(dim=-1) + 1).tolist()
                top_v, top_i = lp.topk(k, dim=-1) if k > 0 else (lp[:, :0], target[:, None][:, :0])
                top_ids, top_lps, chosen = top_i.tolist(), top_v.tolist(), chosen.tolist()
                for j, tok in enumerate(req.token_ids[a + 1 : b + 1]):
                    entries.append(_entries(tok, chosen[j], ranks[j], top_ids, top_lps, j, k))
            result[req.request_id] = entries
        return result


def _entries(tok: int, lp: float, rank: int, top_ids, top_lps, row: int, k: int) -> dict[int, Logprob]:
    """The chosen token's Logprob plus the row's top-k (host lists), best first."""
    entries = {tok: Logprob(lp, rank)}
    for r in range(k):
        entries.setdefault(top_ids[row][r], Logprob(top_lps[row][r], r + 1))
    return entries
