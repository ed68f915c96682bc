"""The CPU decode mirror (kernels/cpu_attention.py) equals the reference paged attention over many
steps of a changing batch: sequences joining, leaving, restarting (preemption), prefill chunks mixed
in, GQA, sliding windows, and the fall-back when the mirror's memory budget is too small."""

import random

import numpy as np
import pytest
import torch

from arcserve.kernels import cpu_attention, cpu_inductor, cpu_rows_attention, reference
from arcserve.kernels.reference import AttentionMetadata

BS, KVH, H, D, LAYERS, NB = 4, 2, 6, 16, 2, 400  # (D: a multiple of the rows kernel's lanes)


def make_meta(batch, block_tables, mirror):
    """batch: list of (seq_id, start, n_new)."""
    q_lens = np.array([n for _, _, n in batch])
    qsl = np.zeros(len(batch) + 1, dtype=np.int64)
    np.cumsum(q_lens, out=qsl[1:])
    seq_lens = np.array([s + n for _, s, n in batch])
    width = max(-(-int(x) // BS) for x in seq_lens)
    tables = np.zeros((len(batch), width), dtype=np.int64)
    slots = []
    for i, (sid, s, n) in enumerate(batch):
        bt = block_tables[sid]
        tables[i, : len(bt[:width])] = bt[:width]
        slots += [bt[p // BS] * BS + p % BS for p in range(s, s + n)]
    return AttentionMetadata(
        query_start_loc=torch.from_numpy(qsl).int(),
        seq_lens=torch.from_numpy(seq_lens).int(),
        block_tables=torch.from_numpy(tables).int(),
        slot_mapping=torch.tensor(slots),
        host={"query_start_loc": qsl, "seq_lens": seq_lens, "seq_ids": np.array([b[0] for b in batch]),
              "decode_mirror": mirror},
    )  # fmt: skip


@pytest.mark.parametrize("native,tiles", [(True, True), (True, False), (False, False)])
def test_mirror_dtype_follows_the_cpu(native, tiles, monkeypatch):
    """A half cache keeps a half mirror where the CPU multiplies halves natively, used at any context
    (the compiled kernels read it), its SDPA fallback in the GQA form with matrix tiles for them
    (AMX), in the rows form without (AVX-512-BF16, e.g. Zen 4); a CPU without native half products
    (AVX2-only) gets a float32 one, used at any context; a float32 cache always mirrors in float32,
    from MIN_MIRROR_CONTEXT."""
    monkeypatch.setattr(reference, "native_half_matmul", lambda dtype: native)
    monkeypatch.setattr(reference, "cpu_matrix_tiles", lambda dtype: tiles)
    half = cpu_attention.DecodeMirror(LAYERS, KVH, D, torch.bfloat16, torch.device("cpu"), 1 << 20)
    assert half.dtype == (torch.bfloat16 if native else torch.float32)
    assert half.min_context == 0
    assert half.gqa_form == (native and tiles)  # SDPA's GQA form over half mirrors of tiled CPUs only
    full = cpu_attention.DecodeMirror(LAYERS, KVH, D, torch.float32, torch.device("cpu"), 1 << 20)
    assert full.dtype == torch.float32 and full.min_context == cpu_attention.MIN_MIRROR_CONTEXT
    assert not full.gqa_form


@pytest.mark.parametrize(
    "seed,window,budget,dtype,native,sizing,prefault,cache",
    [(0, None, 1 << 30, torch.float32, False, False, False, None), (1, 7, 1 << 30, torch.float32, False, False, False, None),
     (2, None, 1 << 30, torch.float32, False, True, False, None), (3, None, 4000, torch.float32, False, False, False, None),
     (4, None, 1 << 30, torch.bfloat16, False, False, False, None), (5, 7, 1 << 30, torch.bfloat16, "products", True, False, None),
     (6, None, 1 << 30, torch.bfloat16, True, False, False, None), (7, 7, 1 << 30, torch.bfloat16, True, True, False, None),
     (8, None, 2 * LAYERS * KVH * D * 4 * 5 * 24, torch.float32, False, True, False, None),
     (9, None, 2 * LAYERS * KVH * D * 2 * 4 * 40, torch.bfloat16, True, True, False, None),
     (10, 7, 1 << 20, torch.bfloat16, True, True, True, None),
     (11, None, 2 * LAYERS * KVH * D * 4 * 5 * 24, torch.float32, False, True, True, None),
     (12, None, 2 * LAYERS * KVH * D * 2 * 4 * 40, torch.bfloat16, True, True, True, None),
     (13, None, 1 << 30, torch.bfloat16, True, "grain", False, None), (14, 7, 1 << 20, torch.float32, False, "grain", True, None),
     (15, None, 1 << 30, torch.bfloat16, True, True, False, torch.float8_e4m3fn),
     (16, 7, 1 << 30, torch.float32, False, False, True, torch.float8_e5m2),
     (17, None, 1 << 30, torch.bfloat16, "products", True, True, "rows"), (18, 7, 1 << 30, torch.bfloat16, False, "grain", False, "rows"),
     (19, None, 2 * LAYERS * KVH * D * 4 * 5 * 24, torch.bfloat16, "products", True, True, "rows"),
     (20, 7, 1 << 30, torch.bfloat16, False, True, True, torch.float8_e4m3fn),
     (21, 7, 1 << 30, torch.bfloat16, "products", "grain", True, torch.float8_e5m2),
     (22, None, 1 << 30, torch.bfloat16, True, True, False, "rows")]
)  # fmt: skip
def test_mirror_matches_reference_over_changing_batches(seed, window, budget, dtype, native, sizing, prefault,
                                                         cache, monkeypatch):  # fmt: skip
    """bf16 against the reference in float32 on the same bf16 values (outputs differ by their rounding
    to bf16 only): native=False, the float32 mirror of a CPU without native half products (AVX2-only);
    "products", a bf16 mirror in the rows form (native half products, no matrix tiles: Zen 4);
    native=True, a bf16 mirror through SDPA's GQA form (a CPU with AMX tiles). sizing: the engine's max_rows and max_len
    hints, with an 8-token growth grain ("grain": the grain without the hints, so rows widen while
    several are held and each layer's rows move within the arena); the small budgets hold only a
    few rows or tokens, so growths shrink one dimension to widen the other and some steps fall back. prefault: the arena
    written up front, as the engine makes it (every layout is a view of one arena either way, so a
    growth moves rows within memory the old layout also uses). cache: an 8-bit paged cache
    (kv_cache_dtype fp8*): the mirror holds the model dtype, and what it appends is rounded as the
    paged cache rounds it; "rows": a bf16 cache whose decode batches of two or more rows take the
    compiled kernel (cpu_rows_attention.py), as the engine binds it for half models (over an 8-bit
    cache too, and on a CPU with tiles, whose SDPA form the kernel replaces)."""
    monkeypatch.setattr(cpu_attention, "MIN_MIRROR_CONTEXT", 1)  # tiny contexts: always mirror
    tiles = native is True
    monkeypatch.setattr(reference, "half_tiles", lambda dtype: tiles)
    monkeypatch.setattr(reference, "native_half_matmul", lambda dtype: native is not False)
    ran: list[bool] = []  # each layer's outcome of the rows kernel, where the case binds it

    def rows_kernel(*args):
        run = cpu_rows_attention.decode_attention(*args)
        if run is None:
            return None

        def counted(q, layer):
            out = run(q, layer)
            ran.append(out is not None)
            return out

        counted.lens, counted.window = run.lens, run.window  # what the mirror's fallback to SDPA reads
        return counted

    rows = rows_kernel if seed >= 17 else None
    cache = None if cache == "rows" else cache
    if sizing:
        monkeypatch.setattr(cpu_attention, "_GROW", 8)
    rng = random.Random(seed)
    torch.manual_seed(seed)
    kc = [torch.randn(NB, BS, KVH, D).to(cache or dtype) for _ in range(LAYERS)]
    vc = [torch.randn(NB, BS, KVH, D).to(cache or dtype) for _ in range(LAYERS)]
    hints = sizing is True
    mirror = cpu_attention.DecodeMirror(LAYERS, KVH, D, dtype, torch.device("cpu"), budget,
                                        max_rows=6 if hints else None, max_len=16 * BS if hints else None,
                                        prefault=prefault)  # fmt: skip
    assert (mirror.arena is not None) == prefault
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=8e-3, atol=8e-3)
    assert mirror.gqa_form == tiles
    assert mirror.dtype == (torch.float32 if native is False else dtype)
    free = list(range(NB))
    rng.shuffle(free)
    seqs: dict[int, int] = {}  # seq id -> tokens computed
    tables: dict[int, list[int]] = {}
    next_id = 0
    used_mirror = False
    for _step in range(60):
        # churn: new sequences arrive, some leave, one sometimes restarts from scratch (preempted)
        if len(seqs) < 6 and rng.random() < 0.5:
            seqs[next_id], tables[next_id] = 0, [free.pop() for _ in range(16)]
            next_id += 1
        if seqs and rng.random() < 0.15:
            sid = rng.choice(list(seqs))
            free += tables.pop(sid)
            del seqs[sid]
        if seqs and rng.random() < 0.1:
            seqs[rng.choice(list(seqs))] = 0
        batch = []
        for sid, done in seqs.items():
            if done == 0 or rng.random() < 0.1:  # prefill chunk (or a skipped decode turns into one)
                n = rng.randint(2, 9) if done == 0 else 1
            else:
                n = 1
            if done + n > 16 * BS:
                continue
            batch.append((sid, done, n))
        if not batch:
            continue
        meta_fast = make_meta(batch, tables, mirror)
        meta_ref = make_meta(batch, tables, None)
        T = int(meta_fast.host["query_start_loc"][-1])
        for layer in range(LAYERS):
            q, k, v = (torch.randn(T, n, D).to(dtype) for n in (H, KVH, KVH))
            reference.store_kv(k, v, kc[layer], vc[layer], meta_fast.slot_mapping)
            fast = cpu_attention.paged_attention(q, k, v, kc[layer], vc[layer], meta_fast, 0.3, window, layer, rows=rows)
            assert fast.dtype == dtype
            # the reference reads fresh prompts' k/v as the cache gives them back
            k, v = reference.kv_round_trip(k, kc[layer].dtype), reference.kv_round_trip(v, vc[layer].dtype)
            f32 = [t.float() for t in (q, k, v, kc[layer], vc[layer])]
            ref = reference.paged_attention(*f32, meta_ref, 0.3, window)
            torch.testing.assert_close(fast.float(), ref, **tol)
        used_mirror |= meta_fast.cache.get("mirror_plan") is not None
        for sid, s, n in batch:
            seqs[sid] = s + n
    # The big budget serves decodes from the mirror; the tiny one must fall back every time.
    assert used_mirror == (budget > 4000)
    if rows is not None:  # the kernel ran its steps where it compiles, else SDPA did (after one failed try, or none)
        assert (ran and all(ran)) if not cpu_inductor.failed else not any(ran)


def brute_force(q, kc, vc, meta, scale, window):
    """Per-token attention straight from the definition: token at position p of a sequence attends to
    positions [max(0, p - window + 1), p] of that sequence, read slot by slot from the paged cache."""
    qsl, seq_lens = meta.host["query_start_loc"], meta.host["seq_lens"]
    out = torch.empty_like(q)
    g = q.shape[1] // kc.shape[2]
    for i in range(len(seq_lens)):
        n, ctx = int(qsl[i + 1] - qsl[i]), int(seq_lens[i])
        pos = torch.arange(ctx)
        slots = meta.block_tables[i].long()[pos // BS] * BS + pos % BS
        K, V = kc.view(-1, KVH, D)[slots], vc.view(-1, KVH, D)[slots]
        for j in range(n):
            p = ctx - n + j
            lo = 0 if window is None else max(0, p - window + 1)
            qq = q[qsl[i] + j].view(KVH, g, D)
            s = torch.einsum("kgd,lkd->kgl", qq, K[lo : p + 1]) * scale
            out[qsl[i] + j] = torch.einsum("kgl,lkd->kgd", s.softmax(-1), V[lo : p + 1]).reshape(-1, D)
    return out


@pytest.mark.parametrize("seed,window", [(0, None), (1, 5), (2, None), (3, 3)])
def test_reference_paged_attention_matches_definition(seed, window):
    """Mixed batches in any order (prefill chunks before decodes, cached prefixes, chunks ending on and
    just past block boundaries) against the per-token definition."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    kc, vc = torch.randn(NB, BS, KVH, D), torch.randn(NB, BS, KVH, D)
    free = list(range(NB))
    rng.shuffle(free)
    batch, tables = [], {}
    for sid in range(7):
        start = rng.choice([0, 0, BS, 2 * BS - 1, 3 * BS, 5])  # fresh, block-aligned or ragged prefix
        n = rng.choice([1, 1, BS, BS + 1, 3, 2 * BS])
        tables[sid] = [free.pop() for _ in range(-(-(start + n) // BS))]
        batch.append((sid, start, n))
    rng.shuffle(batch)
    meta = make_meta(batch, tables, None)
    T = int(meta.host["query_start_loc"][-1])
    q, k, v = torch.randn(T, H, D), torch.randn(T, KVH, D), torch.randn(T, KVH, D)
    reference.store_kv(k, v, kc, vc, meta.slot_mapping)
    got = reference.paged_attention(q, k, v, kc, vc, meta, 0.3, window)
    torch.testing.assert_close(got, brute_force(q, kc, vc, meta, 0.3, window), rtol=1e-5, atol=1e-5)


def test_mirror_growth_rule():
    """A growth reserves max_rows rows of max_len tokens when the budget allows, else twice the capacity needed, else exactly what the step needs; past that, None (the
    caller gathers). A batch that lengthens to its end keeps one buffer; rows keep their tokens
    through a growth; the reservation reads as zeros."""
    cpu = torch.device("cpu")
    per = cpu_attention.DecodeMirror(LAYERS, KVH, D, torch.float32, cpu, 1)._bytes(1, 1)  # one row-position
    blocks = torch.zeros(64, 16, dtype=torch.int32)
    m = cpu_attention.DecodeMirror(LAYERS, KVH, D, torch.float32, cpu, per * 48 * 560, max_rows=48, max_len=500)
    assert m.plan(np.arange(3), np.array([5, 9, 2]), blocks[:3], BS) is not None
    k = m.k
    assert k.shape[1] == 48 and k.shape[3] == 512  # every row, max_len rounded up to 128 tokens
    assert float(k.abs().sum()) == 0.0
    for step in range(1, 400, 50):  # more rows, longer rows, up to max_len: no growth
        assert m.plan(np.arange(40), np.full(40, 100 + step), blocks[:40], BS) is not None
    assert m.k is k
    m.k[0, 0, 0, :4] = 7.0  # row 0 holds tokens; a growth must carry them
    m.k[0, 1, 0, :4] = 5.0  # and row 1 too, though its sequence is gone: it must not survive
    lens = np.r_[452, np.full(39, 600)]  # sequence 0 decodes on; the others are new, past max_len
    assert m.plan(np.r_[0, np.arange(100, 139)], lens, blocks[:40], BS) is not None
    assert m.k.shape[1] == 42 and m.k.shape[3] == 640  # 48 rows of 1,280 (twice 600) do not fit: what fits at the need
    assert float(m.k[0, 0, 0, :4].sum()) == 7.0 * 4 * D and float(m.k[0, 1, 0, :4].sum()) == 0.0
    # without max_len, a growth takes twice the capacity needed
    free = cpu_attention.DecodeMirror(LAYERS, KVH, D, torch.float32, cpu, 1 << 30)
    assert free.plan(np.arange(2), np.array([300, 10]), blocks[:2], BS) is not None
    assert free.k.shape[1] == 2 and free.k.shape[3] == 640
    small = cpu_attention.DecodeMirror(LAYERS, KVH, D, torch.float32, cpu, per * 32 * 384, max_rows=48, max_len=2000)
    assert small.plan(np.arange(30), np.full(30, 300), blocks[:30], BS) is not None
    assert small.k.shape[1] == 32 and small.k.shape[3] == 384  # the rows that fit at the capacity needed
    assert small.plan(np.arange(33), np.full(33, 301), blocks[:33], BS) is None


@pytest.mark.parametrize("prefault", [False, True])
def test_growth_carries_every_held_row(prefault):
    """Layouts are views of one arena, so a growth that widens the rows moves each held row's tokens to
    memory another row of the old layout occupied: every held row of every layer keeps its tokens."""
    cpu = torch.device("cpu")
    blocks = torch.zeros(8, 400, dtype=torch.int32)
    m = cpu_attention.DecodeMirror(LAYERS, KVH, D, torch.float32, cpu, 1 << 24, prefault=prefault)
    lens = np.array([100, 50, 60, 90])
    assert m.plan(np.arange(4), lens, blocks[:4], BS) is not None
    assert m.k.shape[1] == 4 and m.k.shape[3] == 256
    for buf in (m.k, m.v):
        for r, n in enumerate(lens):
            buf[:, r, :, :n] = torch.randn(LAYERS, KVH, int(n), D)
    held = [(m.k[:, r, :, :n].clone(), m.v[:, r, :, :n].clone()) for r, n in enumerate(lens)]
    # the four continue, a fifth arrives with a long context: the rows widen to 1,280 positions
    assert m.plan(np.arange(5), np.r_[lens + 1, 600], blocks[:5], BS) is not None
    assert m.k.shape[3] == 1280 and m.k.data_ptr() == m.arena[0].data_ptr()
    for r, (k, v) in enumerate(held):
        torch.testing.assert_close(m.k[:, r, :, : lens[r]], k, rtol=0, atol=0)
        torch.testing.assert_close(m.v[:, r, :, : lens[r]], v, rtol=0, atol=0)
