"""Captured graphs of the model forward, so a step costs one replay instead of hundreds of kernel
launches from Python (a Triton launch costs ~65 us of host time; a decode step of a 28-layer model
issues ~400 of them: 24 ms eager against 1.7 ms replayed, benchmarks in docs/BENCHMARKS.md).

Two kinds, both over one set of static input buffers that each replay fills from the step's host
arrays (padding rows store nothing: slot -1; padding attention tiles do nothing: sequence -1):
- decode graphs for batch sizes 1, 2, 4, 8, 16, 24, ... max_num_seqs (one token per sequence,
  one tile per sequence, KV split across programs for small batches);
- mixed graphs for token counts 8, 16, ..., 1024, 2048, 3072, ... max_num_batched_tokens (prefill chunks with
  decodes), whose attention grid is the bound on tiles for that many tokens and sequences.

Graphs need attention that plans on the device (the Triton kernels); the torch twins plan on the
host and run eagerly.
"""

from __future__ import annotations

import functools
import gc

import numpy as np
import torch

from arcserve.kernels.reference import AttentionMetadata
from arcserve.platform import (
    capture,
    graph_pool,
    new_event,
    new_graph,
    pin_memory_available,
    synchronize,
    to_device,
    wait_event,
)


def feed_tokens(ids: torch.Tensor, last: torch.Tensor, dst_h: np.ndarray, src_h: np.ndarray,
                dst: torch.Tensor | None = None, src: torch.Tensor | None = None) -> None:
    """ids[dst] = last[src] on the device (tokens sampled by the previous step, not yet on the host).
    The common case, a decode batch in the previous step's order, is one slice copy. dst / src: the
    index arrays already on the device (the graphs' input buffer), else copied from dst_h / src_h."""
    k = len(dst_h)
    if (dst_h == np.arange(k)).all() and (src_h == dst_h).all():
        ids[:k].copy_(last[:k])
        return
    if dst is None:
        both = to_device(np.stack([dst_h, src_h]), ids.device)
        dst, src = both[0], both[1]
    ids.index_copy_(0, dst.long(), last[src.long()].to(ids.dtype))


def warm_feed_tokens(ids: torch.Tensor, dst: torch.Tensor | None = None, src: torch.Tensor | None = None) -> None:
    """Take feed_tokens' reordering path once over ids[:2] (left as they were), with index tensors
    of the dtype the steps use (dst / src; None: host indices, as eager steps pass them). The first
    step after a request finishes takes that path; run at startup, its kernels load then instead
    (an H200 throughput run stalled 16 ms at its first finished request without this)."""
    if len(ids) < 2:
        return
    saved = ids[:2].clone()
    order = np.array([1, 0])
    feed_tokens(ids, torch.zeros(2, dtype=torch.long, device=ids.device), order, order, dst, src)
    ids[:2] = saved


@functools.cache
def decode_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then steps of 8 up to max_num_seqs (one list per max_num_seqs, shared: the runner
    looks its LM-head rows up in it every step; not to be modified)."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_num_seqs] + list(range(16, max_num_seqs, 8))
    return sorted(set(sizes + [max_num_seqs]))


def mixed_sizes(max_tokens: int) -> list[int]:
    """Token buckets for mixed steps: powers of two from 8 to 1024, then steps of 1024 up to
    max_num_batched_tokens (a step pads to its bucket: at most 2x below 1024 tokens, at most 1023
    tokens above). The small buckets keep the padding of short steps small (a short prompt over a
    cached prefix, a few decodes beside a small chunk, a verification of a few drafts)."""
    sizes = [t for t in (8, 16, 32, 64, 128, 256, 512, 1024) if t < max_tokens] + list(range(2048, max_tokens, 1024))
    return sizes + [max_tokens]


class StepGraphs:
    def __init__(self, model, kv_caches, block_size: int, max_model_len: int, max_num_seqs: int,
                 max_num_batched_tokens: int) -> None:  # fmt: skip
        from arcserve.kernels import triton_attention as ta

        self.model, self.kv_caches = model, kv_caches
        self.plan_tiles = ta.plan_tiles
        self.max_model_len, self.max_num_seqs = max_model_len, max_num_seqs
        cfg, dev = model.cfg, model.device
        self.device = dev
        self.decode = decode_sizes(max_num_seqs)
        self.mixed = mixed_sizes(max(max_num_batched_tokens, 256))
        # tokens per attention tile, by graph kind (mixed graphs size their tile bound with it)
        self.block_q = {
            k: ta.tile_shape(cfg.num_heads, cfg.num_kv_heads, k == "decode", dev)[0] for k in ("decode", "mixed")
        }
        self.tile_plan = ta.tile_plan
        T = max(self.mixed[-1], self.decode[-1])
        S = max_num_seqs
        tiles = max(self.decode[-1], self._max_tiles(self.mixed[-1]))
        max_blocks = -(-max_model_len // block_size)

        # Every input lives in one int32 device buffer, filled by one copy per step from a pinned
        # host twin (one transfer instead of eight). Two host twins take turns, so the host can fill
        # one for the next step while the copy of the other is still queued behind the running step.
        shapes = {"ids": (T,), "positions": (T,), "slots": (T,), "qsl": (S + 1,), "seq_lens": (S,),
                  "tile_seq": (tiles,), "tile_q": (tiles,), "feed_dst": (S,), "feed_src": (S,),
                  "block_tables": (S, max_blocks)}  # fmt: skip
        total = sum(int(np.prod(v)) for v in shapes.values())
        self.buf = torch.zeros(total, dtype=torch.int32, device=dev)
        pin = pin_memory_available(dev)
        self.hbufs = [torch.zeros(total, dtype=torch.int32, pin_memory=pin) for _ in range(2)]
        self.copied = [None, None]  # event after the last copy out of each host twin
        self.turn = 0
        self.st, self.hsts, off = {}, [{}, {}], 0
        for name, shape in shapes.items():
            n = int(np.prod(shape))
            self.st[name] = self.buf[off : off + n].view(shape)
            for hbuf, hst in zip(self.hbufs, self.hsts):
                hst[name] = hbuf[off : off + n].view(shape).numpy()
            off += n
        self.bt_offset, self.max_blocks = off - S * max_blocks, max_blocks  # block tables come last
        for name in ("slots", "tile_seq"):
            self.st[name].fill_(-1)
            for hst in self.hsts:
                hst[name][:] = -1
        self.graphs: dict[tuple[str, int], tuple] = {}

    def _max_tiles(self, tokens: int) -> int:
        return -(-tokens // self.block_q["mixed"]) + min(tokens, self.max_num_seqs)

    def _shape(self, kind: str, size: int) -> tuple[int, int, int]:
        """(tokens, sequences, tiles) of a graph."""
        if kind == "decode":
            return size, size, size
        return size, min(size, self.max_num_seqs), self._max_tiles(size)

    def _meta(self, kind: str, size: int) -> AttentionMetadata:
        st = self.st
        T, S, tiles = self._shape(kind, size)
        meta = AttentionMetadata(query_start_loc=st["qsl"][: S + 1], seq_lens=st["seq_lens"][:S],
                                 block_tables=st["block_tables"][:S], slot_mapping=st["slots"][:T])  # fmt: skip
        # decode: split for the batch size; mixed: for one chunk of the bucket's size over a long
        # cached prefix (small buckets get splits, large ones have enough tiles already), and only
        # the chunk's tiles (first, plan_tiles) take the split, not the padding of the tile bound
        cfg, decode = self.model.cfg, kind == "decode"
        plan = self.tile_plan(cfg.num_heads, cfg.num_kv_heads, decode, tiles if decode else -(-size // self.block_q["mixed"]),
                              self.max_model_len, self.device, self.model.kv_cache_dtype.itemsize, cfg.head_dim)  # fmt: skip
        plan.update(tile_seq=st["tile_seq"][:tiles], tile_q=st["tile_q"][:tiles], num_tiles=tiles)
        meta.cache["triton"] = plan
        return meta

    def _forward(self, kind: str, size: int, meta: AttentionMetadata) -> torch.Tensor:
        T = self._shape(kind, size)[0]
        return self.model.forward(self.st["ids"][:T], self.st["positions"][:T], meta, self.kv_caches)

    @torch.inference_mode()
    def capture(self) -> int:
        """Capture every graph, largest first, into one memory pool. Returns how many.
        The garbage collector stays off meanwhile: collecting another engine's graphs during a
        capture resets them, which the capture forbids (seen: 'operation not permitted when stream
        is capturing' when a process built a new LLM while an old one was garbage)."""
        pool = graph_pool(self.device)
        keys = [("mixed", t) for t in reversed(self.mixed)] + [("decode", b) for b in reversed(self.decode)]
        gc.collect()
        gc.disable()
        try:
            for kind, size in keys:
                meta = self._meta(kind, size)
                self._forward(kind, size, meta)  # warm-up: compiles this shape's kernels; stores nothing
                synchronize(self.device)
                graph = new_graph(self.device)
                with capture(graph, self.device, pool):
                    hidden = self._forward(kind, size, meta)
                self.graphs[(kind, size)] = (graph, hidden)
            # Logits are computed outside the graphs, over the decode batch sizes (runner.lm_head_rows),
            # and one row takes the matrix-vector kernel: run each now, not in the run (H100: the first
            # one-row product compiled for 136 ms in a throughput run's first batch-1 step; the
            # library's first product at a new row count waits for the device to drain).
            for b in self.decode:
                self.model.logits(self.graphs[("decode", b)][1])
            order = torch.tensor([1, 0], dtype=self.buf.dtype, device=self.device)
            warm_feed_tokens(self.st["ids"], order, order)
        finally:
            gc.enable()
        synchronize(self.device)
        return len(keys)

    def pick(self, q_lens: np.ndarray) -> tuple[str, int] | None:
        """The smallest graph that holds a step with these per-sequence token counts, if any."""
        n, T = len(q_lens), int(q_lens.sum())
        if (q_lens == 1).all() and n <= self.decode[-1]:
            return "decode", next(b for b in self.decode if b >= n)
        if n <= self.max_num_seqs and T <= self.mixed[-1]:
            return "mixed", next(t for t in self.mixed if t >= T)
        return None

    def run(self, key: tuple[str, int], h: dict, last_tokens: torch.Tensor | None) -> torch.Tensor:
        """Fill the static inputs (stage), replay, and return the graph's output: the hidden states
        of the step's T tokens, then the padding rows (the runner's LM head reuses a decode graph's)."""
        self.stage(key, h, last_tokens)
        graph, hidden = self.graphs[key]
        graph.replay()
        return hidden

    def stage(self, key: tuple[str, int], h: dict, last_tokens: torch.Tensor | None) -> None:
        """Fill the static inputs of graph `key` from the step's host arrays (runner._host_inputs)
        and the tokens the previous step sampled on the device (last_tokens)."""
        kind, size = key
        turn = self.turn
        self.turn ^= 1
        wait_event(self.copied[turn])  # this twin's previous copy has been issued two steps ago
        hs, hbuf = self.hsts[turn], self.hbufs[turn]
        Tg, _, tiles = self._shape(kind, size)
        qsl, n = h["qsl"], len(h["seq_lens"])
        T = int(qsl[-1])
        seq, q0 = self.plan_tiles(qsl, self.block_q[kind], h["seq_lens"])
        hs["ids"][:T] = h["ids"]
        hs["positions"][:T] = h["positions"]
        hs["slots"][:T] = h["slots"]
        hs["slots"][T:Tg] = -1
        hs["qsl"][: n + 1] = qsl
        hs["seq_lens"][:n] = h["seq_lens"]
        hs["tile_seq"][: len(seq)] = seq
        hs["tile_seq"][len(seq) : tiles] = -1
        hs["tile_q"][: len(q0)] = q0
        k = len(h["feed_dst"])
        hs["feed_dst"][:k] = h["feed_dst"]
        hs["feed_src"][:k] = h["feed_src"]
        tables = h["tables"]
        hs["block_tables"][:n, : tables.shape[1]] = tables
        end = self.bt_offset + n * self.max_blocks  # up to the last used row of the block tables
        self.buf[:end].copy_(hbuf[:end], non_blocking=True)
        self.copied[turn] = new_event(self.device)
        if k:
            st = self.st
            feed_tokens(st["ids"], last_tokens, h["feed_dst"], h["feed_src"], st["feed_dst"][:k], st["feed_src"][:k])
