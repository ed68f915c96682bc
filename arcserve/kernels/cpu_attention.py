"""CPU decode attention over a dense mirror of the decoding sequences' KV.

Pure-PyTorch paged attention must gather every decoding sequence's blocks on every layer and step
(`reference.paged_attention`), which triples the memory traffic of attention. Here each sequence in
decode owns a row of a dense per-layer buffer [rows, kv_heads, capacity, head_dim]: the row is filled
from the paged cache once, when the sequence starts decoding (or comes back after a preemption), and
afterwards only the step's new token is appended. Rows stay packed (a leaving sequence's row is
refilled by moving the last row into it), so every layer runs one SDPA over a plain slice.

The paged cache stays the source of truth (prefix caching, preemption); the mirror is a cache of it,
bounded by `max_bytes` (beyond that, decode falls back to gathering). Prefill chunks use the
reference path.

A half model's decode attention (reference.compiled_half) runs through the compiled kernels
get_ops binds instead of SDPA, where they apply: `one_row` (cpu_compiled.decode_attention) for a
step decoding one sequence, `rows` (cpu_rows_attention.decode_attention) for more; SDPA otherwise
(its GQA form on CPUs with half matrix tiles, AMX; the rows form elsewhere). There the mirror is
used at any context. Where the CPU has no native half products (AVX2-only) a bf16/fp16 cache
gets a float32 mirror: torch's half attention is slow there (SDPA at one query over 100 positions,
SmolLM2's heads: ~150 us in bf16, ~35 us in float32). With native half products (AVX-512-BF16,
e.g. Zen 4, or AMX) the mirror keeps the cache's dtype: the kernels read half the bytes
(the 64-request benchmark ~4% faster than over a float32 mirror, docs/BENCHMARKS.md, session 37)
and SDPA's rows form runs as fast over bf16 rows as over float32 ones there.
"""

from __future__ import annotations

import mmap
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

from arcserve.kernels import reference
from arcserve.kernels.reference import AttentionMetadata

_GROW = 128  # capacity granularity in tokens
# Below this many context tokens across the step's decoders, gathering is cheaper than the mirror's
# bookkeeping for float32 models (measured on SmolLM2 with a bf16 mirror read by SDPA: single short
# decodes ran ~10% slower through the mirror). Half models' mirrors are used at any context: their
# compiled kernels read them (reference.compiled_half).
MIN_MIRROR_CONTEXT = 1024


def mirror_dtype(dtype: torch.dtype) -> torch.dtype:
    """The cache's dtype, or float32 for a half cache where the CPU lacks native half products
    (reference.native_half_matmul; see above)."""
    upcast = dtype in (torch.float16, torch.bfloat16) and not reference.native_half_matmul(dtype)
    return torch.float32 if upcast else dtype


def _footprint(layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, rows: int, cap: int) -> int:
    """Bytes of K and V for `rows` rows of `cap` tokens."""
    return 2 * layers * rows * kv_heads * cap * head_dim * dtype.itemsize


class DecodeMirror:
    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, dtype, device, max_bytes: int,
                 max_rows: int | None = None, max_len: int | None = None, prefault: bool = False) -> None:  # fmt: skip
        """max_bytes bounds the buffers' size; max_rows and max_len (the engine's max_num_seqs and
        max_model_len) are what a growth reserves when the budget allows (largest_bytes: the most
        worth giving it). prefault: write the whole arena now (the engine's startup) rather than at
        each page's first use (see _arena)."""
        self.shape = (num_layers, kv_heads, head_dim)
        self.dtype = mirror_dtype(dtype)
        self.device, self.max_bytes, self.max_rows, self.max_len = device, max_bytes, max_rows, max_len
        self.min_context = 0 if reference.compiled_half(dtype) else MIN_MIRROR_CONTEXT
        self.gqa_form = reference.half_tiles(dtype)
        # gqa_form: SDPA's GQA form over a half mirror on CPUs with half matrix tiles, for the
        # batches the compiled kernels leave to SDPA (and enforce_eager): measured on a 2-vCPU
        # AVX-512/AMX Xeon, 64 sequences x ~400 positions of SmolLM2's heads, ~2.1 ms per layer
        # against ~2.5-3.2 ms with the query heads as rows (the rows form). Elsewhere the rows
        # form, the faster one there (4x in bf16 on a Zen 4).
        self.k: torch.Tensor | None = None  # [layers, rows, kvh, cap, hd], a view of the arena
        self.v: torch.Tensor | None = None
        self.ids: list[int] = []  # seq id held by each row
        self.lens = np.zeros(0, dtype=np.int64)  # tokens valid in each row
        self.layer_index = [torch.tensor([i], device=device) for i in range(num_layers)]  # for one_row
        self.arena = self._arena(prefault) if prefault else None  # made at the first growth otherwise

    @staticmethod
    def largest_bytes(num_layers: int, kv_heads: int, head_dim: int, dtype, max_rows: int, max_len: int) -> int:
        """The most a growth ever takes: max_rows rows of max_len tokens (rounded up to _GROW), K and V,
        in the mirror's dtype for a cache of `dtype`."""
        return _footprint(num_layers, kv_heads, head_dim, mirror_dtype(dtype), max_rows, -(-max_len // _GROW) * _GROW)

    def _bytes(self, rows: int, cap: int) -> int:
        return _footprint(*self.shape, self.dtype, rows, cap)

    def _ensure(self, rows: int, cap: int) -> bool:
        """Room for `rows` rows of `cap` tokens. A growth takes as much as the budget allows: up
        to max_rows rows of max_len tokens, else twice the capacity needed, else exactly what the
        step needs. Every layout is a view of one arena of max_bytes, so a growth only moves the
        held rows' tokens within it (under an earlier rule, rows from 8 and capacity x1.5 in new
        buffers, the 64-request benchmark's mirror grew five times, ~2.5 of its 29 s on a 2-vCPU
        Xeon)."""
        cur_rows, cur_cap = (0, 0) if self.k is None else (self.k.shape[1], self.k.shape[3])
        if rows <= cur_rows and cap <= cur_cap:
            return True
        # what the step and the (packed) rows held now need; a growth may shrink the other
        need_rows, need_cap = max(rows, len(self.ids)), max(cap, int(self.lens.max(initial=0)))
        per_row = self._bytes(1, 1)
        for c in (self.max_len or 2 * need_cap, 2 * need_cap, need_cap):
            c = -(-max(c, need_cap) // _GROW) * _GROW
            r = min(max(need_rows, self.max_rows or 2 * cur_rows), self.max_bytes // (per_row * c))
            if r >= need_rows:
                break
        else:
            return False
        if self.arena is None:
            self.arena = self._arena(False)
        L, kvh, hd = self.shape
        k, v = (a[:, : r * kvh * c * hd].view(L, r, kvh, c, hd) for a in self.arena)
        if self.k is not None and self.ids:  # the held rows' tokens, to their places in the new layout
            n, m = len(self.ids), int(self.lens.max())
            for layer in range(L):  # the layouts overlap: each layer's rows are copied out first
                for new, old in ((k, self.k), (v, self.v)):
                    new[layer, :n, :, :m] = old[layer, :n, :, :m].clone()
        self.k, self.v = k, v
        return True

    def _arena(self, prefault: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V storage, [layers, elements] each, of max_bytes together, zero-filled: every
        position a row reads holds zero or a K/V value some layout wrote there earlier, never
        uninitialised memory (masked positions still meet V in the softmax-weighted sum, and
        0 * NaN would poison the output).

        prefault=False: an anonymous mapping that the OS zero-fills page by page at the first
        touch, so only the positions rows reach cost memory. prefault=True: torch.zeros, every page
        written now. The engine prefaults the mirror at startup out of the KV cache's memory budget
        (as it does the paged cache): on the 2-vCPU VMs measured here, a page touched for the first
        time costs ~2-5 ms per MB, and the 64-request benchmark's mirror touched ~860 MB mid-run
        (248,605 page faults in the run before, 34,810 after; the run +4%).

        Each layer gets one element more than max_bytes allows the layouts, so that every layout is
        a view of the start of its layer's storage, never all of it: the compiled one-row kernels
        (cpu_inductor._shape_key) then take every layout with one kernel."""
        L, size = self.shape[0], self.dtype.itemsize
        n = self.max_bytes // (2 * L * size) + 1
        if prefault:
            return torch.zeros(L, n, dtype=self.dtype), torch.zeros(L, n, dtype=self.dtype)
        buf = mmap.mmap(-1, max(1, 2 * L * n) * size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        both = torch.frombuffer(buf, dtype=self.dtype)[: 2 * L * n].view(2, L, n)  # the tensor keeps buf alive
        return both[0], both[1]

    def reset(self) -> None:
        self.ids, self.lens = [], np.zeros(0, dtype=np.int64)

    def forget(self, seq_id: int) -> None:
        """The sequence's tokens past some position changed (a draft model's rejected drafts): its
        row must not continue; the next step that decodes it refills it from the paged cache."""
        if seq_id in self.ids:
            self.lens[self.ids.index(seq_id)] = -2  # no step's length is -2 + 1

    def plan(self, ids: np.ndarray, lens: np.ndarray, block_tables: torch.Tensor, block_size: int):
        """Assign rows to this step's decoding sequences (ids; context lengths after the step).
        Returns (row of each decode token, refill info or None), or None to fall back to gathering."""
        wanted = {int(s): int(n) for s, n in zip(ids, lens)}
        # A row survives if its sequence decodes now and continues exactly where the row ends
        # (not after a preemption, not a new sequence under a reused id).
        alive = [wanted.get(sid) == self.lens[r] + 1 for r, sid in enumerate(self.ids)]
        n_alive = sum(alive)
        holes = [r for r in range(n_alive) if not alive[r]]
        movers = [r for r in range(n_alive, len(self.ids)) if alive[r]]
        if movers:  # pack: move the few live rows past the front into the front's holes
            dst = torch.tensor(holes, device=self.device)
            src = torch.tensor(movers, device=self.device)
            m = int(self.lens[movers].max())  # what the movers hold, not the rows' capacity
            self.k[:, dst, :, :m] = self.k[:, src, :, :m]
            self.v[:, dst, :, :m] = self.v[:, src, :, :m]
            for h, m in zip(holes, movers):
                self.ids[h], self.lens[h] = self.ids[m], self.lens[m]
        self.ids, self.lens = self.ids[:n_alive], self.lens[:n_alive].copy()
        if not self._ensure(len(ids), int(lens.max())):  # after packing: live rows only
            self.reset()
            return None
        keep = {sid: r for r, sid in enumerate(self.ids)}
        rows = np.empty(len(ids), dtype=np.int64)
        new_lens = np.zeros(len(ids), dtype=np.int64)
        new_lens[:n_alive] = self.lens
        refill = []
        for i, (sid, n) in enumerate(zip(ids.tolist(), lens.tolist())):
            r = keep.get(sid)
            if r is None:
                r = len(self.ids)
                self.ids.append(sid)
                refill.append((i, r, n - 1))
            rows[i] = r
            new_lens[r] = n
        self.lens = new_lens
        fill = None
        if refill:  # new rows are appended: one contiguous range [first, first + len(refill))
            prev = max(n for _, _, n in refill)
            idx = torch.tensor([i for i, _, _ in refill], device=self.device)
            fill = (refill[0][1], block_tables[idx, : -(-prev // block_size)].long(), prev)
        return rows, fill

    def refill(self, layer: int, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: dict) -> None:
        """The step's new decoders (plan["fill"]): their context copied into their rows from the
        paged cache, once (before their first decode step's attention, layer by layer)."""
        if plan["fill"] is not None:
            first, blocks, n = plan["fill"]
            rows = slice(first, first + blocks.shape[0])
            K, V = self.k[layer], self.v[layer]
            K[rows, :, :n] = reference._gather(k_cache, blocks, K.dtype)[:, :, :n]
            V[rows, :, :n] = reference._gather(v_cache, blocks, V.dtype)[:, :, :n]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache, v_cache,
               plan: dict, scale: float) -> torch.Tensor:  # fmt: skip
        """Attention of the decode tokens, in row order (plan["tok"][r] is row r's token), in q's
        dtype. plan["tok"] is None when the decode tokens are the step's tokens in row order."""
        tok = plan["tok"]
        self.refill(layer, k_cache, v_cache, plan)
        if tok is not None:
            q, k, v = q[tok], k[tok], v[tok]
        # (as the paged cache holds this step's token: an 8-bit cache's rounding included)
        k, v = reference.kv_round_trip(k, k_cache.dtype), reference.kv_round_trip(v, v_cache.dtype)
        if plan["one_row"] is not None:  # one row read whole, through the step's compiled kernel
            k_last, v_last, run = plan["one_row"]
            k_last[layer].copy_(k)
            v_last[layer].copy_(v)
            o = run(q, self.layer_index[layer])
            if o is not None:
                return o  # (else it failed to compile: SDPA below, the token written again)
        K, V = self.k[layer], self.v[layer]
        (n, heads, hd), kvh, L = q.shape, K.shape[1], plan["max_len"]
        # This step's token of each row: one index_copy_ per buffer at flat (row, head, pos) offsets.
        K.view(-1, hd).index_copy_(0, plan["slots"], k.to(K.dtype).reshape(-1, hd))
        V.view(-1, hd).index_copy_(0, plan["slots"], v.to(V.dtype).reshape(-1, hd))
        if plan["rows"] is not None:  # many rows, through the step's compiled kernel
            run = plan["rows"]
            o = run(q.contiguous(), self.layer_index[layer])  # (one layout: one kernel)
            if o is not None:
                return o
            # it failed to compile: SDPA for the rest of the step, over the mask the plan left out
            plan["rows"], plan["mask"] = None, reference.decode_mask(run.lens, L, run.window, K.dtype)
        # Rows form: the query heads sharing a KV head ride as its query rows (no mask among them);
        # GQA form: one query row per head, enable_gqa (gqa_form says which).
        gqa = self.gqa_form
        g = 1 if gqa else heads // kvh
        o = F.scaled_dot_product_attention(
            q.view(n, heads // g, g, hd).to(K.dtype), K[:n, :, :L], V[:n, :, :L], attn_mask=plan["mask"], scale=scale,
            enable_gqa=gqa,
        )  # fmt: skip
        return o.view(n, heads, hd).to(q.dtype)


def paged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    meta: AttentionMetadata, scale: float, sliding_window: int | None = None, layer: int = 0,
    one_row: Callable | None = None, rows: Callable | None = None,
) -> torch.Tensor:  # fmt: skip
    """Same contract as reference.paged_attention; decode tokens go through meta's DecodeMirror.
    one_row (get_ops binds cpu_compiled.decode_attention): for a step whose decoding is one row
    read whole, one_row(K, V, length, dtype, scale) gives the step's attention kernel or None.
    rows (get_ops binds cpu_rows_attention.decode_attention): for a step decoding more rows,
    rows(K, V, lens, width, heads, dtype, scale, sliding_window) gives the step's kernel or None."""
    mirror: DecodeMirror | None = meta.host.get("decode_mirror")
    plan = _plan(meta, k_cache.shape[1], mirror, sliding_window, one_row, q.dtype, scale, rows, q.shape[1])
    if plan is None:
        return reference.paged_attention(q, k, v, k_cache, v_cache, meta, scale, sliding_window)
    if plan["tok"] is None:  # decode-only step, tokens in row order
        return mirror.attend(layer, q, k, v, k_cache, v_cache, plan, scale)
    # Prefill chunks (if any) through the reference; decode rows from the mirror into the same output.
    out = reference.paged_attention(q, k, v, k_cache, v_cache, meta, scale, sliding_window, skip_decode=True)
    out[plan["tok"]] = mirror.attend(layer, q, k, v, k_cache, v_cache, plan, scale)
    return out


def _plan(meta: AttentionMetadata, block_size: int, mirror: DecodeMirror | None, sliding_window: int | None,
          one_row: Callable | None, dtype: torch.dtype, scale: float, many_rows: Callable | None = None,
          heads: int = 0):  # fmt: skip
    """Once per step: rows for this step's decoders, in row order, or None to gather instead; and
    the step's one-row kernel where one_row gives one (the new position's views with it), or its
    many-rows kernel where many_rows gives one (for `heads` query heads)."""
    if "mirror_plan" in meta.cache:
        return meta.cache["mirror_plan"]
    plan = None
    qsl, seq_lens = meta.host["query_start_loc"], meta.host["seq_lens"]
    dec = ((qsl[1:] - qsl[:-1]) == 1).nonzero()[0]
    if mirror is not None and len(dec) and seq_lens[dec].sum() >= mirror.min_context:
        lens = seq_lens[dec]
        got = mirror.plan(meta.host["seq_ids"][dec], lens, meta.block_tables[torch.from_numpy(dec)], block_size)
        if got is not None:
            rows, fill = got
            order = np.empty_like(rows)
            order[rows] = np.arange(len(rows))  # decoder index of each row
            dev = meta.block_tables.device
            lens_rows = torch.from_numpy(mirror.lens.copy()).to(dev)
            max_len = int(mirror.lens.max())
            many = None
            if many_rows is not None and len(rows) > 1:
                many = many_rows(mirror.k, mirror.v, lens_rows, max_len, heads, dtype, scale, sliding_window)
            # (SDPA's mask: not made where the many-rows kernel runs; attend makes it if that fails)
            mask = None if many is not None else reference.decode_mask(lens_rows, max_len, sliding_window, mirror.dtype)
            tok = qsl[dec][order]
            _, kvh, cap, _ = mirror.k.shape[1:]
            # flat offset of (row, head, the row's new position) in a layer's [rows, kvh, cap, hd]
            slots = (np.arange(len(rows))[:, None] * kvh + np.arange(kvh)[None, :]) * cap + (lens[order] - 1)[:, None]
            in_order = len(dec) == len(seq_lens) and np.array_equal(tok, np.arange(len(tok)))
            run = None
            if one_row is not None and len(rows) == 1 and mask is None:
                run = one_row(mirror.k, mirror.v, max_len, dtype, scale)
            plan = {
                "fill": fill, "max_len": max_len, "mask": mask, "rows": many,
                # the row's new position in every layer, viewed once for the step, and its kernel
                "one_row": None if run is None else (mirror.k[:, :1, :, max_len - 1], mirror.v[:, :1, :, max_len - 1], run),
                "tok": None if in_order else torch.from_numpy(tok).to(dev),
                "slots": torch.from_numpy(slots.reshape(-1)).to(dev),
            }  # fmt: skip
    meta.cache["mirror_plan"] = plan
    return plan
