"""Every Triton kernel against its pure-PyTorch twin (reference.py) on fresh random inputs.

On a GPU machine these run on the GPU (bf16 and fp16 included); in CI they run on the CPU in
Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1), on small shapes.
"""

from __future__ import annotations

import functools
import random

import numpy as np
import pytest
import torch
import triton
from conftest import DEVICE

from arcserve.kernels import reference, triton_attention, triton_linear, triton_ops, triton_sampling
from arcserve.kernels.reference import AttentionMetadata
from arcserve.models.config import _llama3_inv_freq

GPU = DEVICE.type != "cpu"
DTYPES = [torch.float32, torch.bfloat16, torch.float16] if GPU else [torch.float32, torch.bfloat16]
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    assert torch.isfinite(a).all()
    return float((a - b).norm() / b.norm().clamp(min=1e-12))


def product_err(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> float:
    """Error of y = x @ w.T (+ b) against the exact product, relative to the product's own scale
    |x| @ |w|.T (+ |b|): rounding in a sum is bounded by the sum of the terms' magnitudes, so an
    output that cancels to near zero (one output feature, say) does not blow the ratio up."""
    x, w = x.double(), w.double()
    exact = x @ w.T + (0 if b is None else b.double())
    scale = x.abs() @ w.abs().T + (0 if b is None else b.double().abs())
    assert torch.isfinite(y.double()).all()
    return float((y.double() - exact).norm() / scale.norm().clamp(min=1e-12))


def rand(*shape, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, device=DEVICE) * scale).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", [(1, 64), (7, 96), (33, 576)])
def test_rms_norm_and_fused_add(dtype, rows, hidden):
    x, res, w = rand(rows, hidden, dtype=dtype), rand(rows, hidden, dtype=dtype), rand(hidden, dtype=dtype)
    assert rel_err(triton_ops.rms_norm(x, w, 1e-6), reference.rms_norm(x, w, 1e-6)) < TOL[dtype]
    out, new_res = triton_ops.fused_add_rms_norm(x, res, w, 1e-5)
    ref_out, ref_res = reference.fused_add_rms_norm(x, res, w, 1e-5)
    # the same sum in the model dtype (to one rounding: the interpreter truncates to bf16)
    assert rel_err(new_res, ref_res) < TOL[dtype] / 4
    assert rel_err(out, ref_out) < TOL[dtype]
    out, same = triton_ops.fused_add_rms_norm(x, None, w, 1e-5)
    assert same is x and rel_err(out, reference.rms_norm(x, w, 1e-5)) < TOL[dtype]


def test_rms_norm_per_head_on_a_strided_view():
    """Qwen3's q/k norm: normalise each head of a [T, heads, head_dim] slice of the qkv output."""
    qkv = rand(5, 7, 32)
    w = rand(32)
    view = qkv[:, :4]
    assert rel_err(triton_ops.rms_norm(view, w, 1e-6), reference.rms_norm(view, w, 1e-6)) < TOL[torch.float32]


def _table(head_dim: int, max_pos: int, llama3: bool, rot: int | None = None) -> torch.Tensor:
    dim = rot or head_dim
    inv = 1.0 / (10000.0 ** (torch.arange(0, dim, 2).float() / dim))
    if llama3:
        s = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
        inv = _llama3_inv_freq(inv, s)
    f = torch.outer(torch.arange(max_pos).float(), inv)
    return torch.cat((f.cos(), f.sin()), -1).to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("heads,head_dim,rot,llama3", [(7, 64, None, False), (5, 128, None, True), (3, 64, 32, False)])
def test_rotary_embedding(dtype, neox, heads, head_dim, rot, llama3):
    T = 9
    table = _table(head_dim, 300, llama3, rot)
    positions = torch.tensor(random.Random(heads).sample(range(300), T), device=DEVICE)
    # q and k heads as a strided slice of a wider qkv row, as the decoder passes them
    qkv = rand(T, heads + 2, head_dim, dtype=dtype)
    qk = qkv[:, :heads]
    want = reference.rotary_embedding(qk.clone(), reference.rope_cos_sin(table, positions, dtype), neox)
    got = triton_ops.rotary_embedding(qk, triton_ops.rope_cos_sin(table, positions, dtype), neox)
    assert got.data_ptr() == qk.data_ptr()  # in place
    assert rel_err(got, want) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,inter", [(1, 128), (6, 1536), (3, 100)])
def test_silu_and_mul(dtype, rows, inter):
    x = rand(rows, 2 * inter, dtype=dtype)
    assert rel_err(triton_ops.silu_and_mul(x), reference.silu_and_mul(x)) < TOL[dtype]


# Rows longer than triton_linear.ONE_TILE_MAX_K take several K tiles per program (the pipelined loop):
# few outputs in the interpreter, many outputs on a GPU only (slow in the interpreter).
LONG_K = pytest.mark.gpu


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k", [(1, 1, 64), (1, 1000, 100), (2, 7, 1024), (3, 300, 96), (4, 512, 256),
                                   (1, 9, 4500), pytest.param(1, 4096, 5000, marks=LONG_K)])  # fmt: skip
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_matches_linear(dtype, m, n, k, bias):
    x = rand(m, k + 8, dtype=dtype)[:, 3 : 3 + k]  # rows with a stride, as views of wider tensors are
    w, b = rand(n, k, dtype=dtype, scale=0.1), rand(n, dtype=dtype) if bias else None
    y = triton_linear.gemv(x, w, b)
    assert y.shape == (m, n) and y.dtype == dtype
    assert product_err(y, x, w, b) < TOL[dtype] / 2
    # linear() takes the kernel up to MAX_ROWS rows (small matrices) and the library GEMM beyond
    assert product_err(triton_linear.linear(x, w, b), x, w, b) < TOL[dtype] / 2
    xs = rand(triton_linear.MAX_ROWS + 1, k, dtype=dtype)
    assert product_err(triton_linear.linear(xs, w, b), xs, w, b) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k", [(1, 1000, 100), (1, 96, 1024), (2, 300, 96), (1, 6, 5000),
                                   pytest.param(1, 4096, 6000, marks=LONG_K)])  # fmt: skip
@pytest.mark.parametrize("first_layer", [False, True])
def test_add_rms_norm_linear_fused(dtype, m, n, k, first_layer):
    """Residual add + RMSNorm fused into the matrix-vector kernel: the unfused composition's result and
    residual (one row takes the fused kernel, two rows the unfused pair)."""
    x = rand(m, k + 5, dtype=dtype)[:, 2 : 2 + k]  # a strided view, as the o_proj output is not
    res = None if first_layer else rand(m, k, dtype=dtype)
    nw, w, b = rand(k, dtype=dtype), rand(n, k, dtype=dtype, scale=0.1), rand(n, dtype=dtype)
    y, new_res = triton_linear.add_rms_norm_linear(x, res, nw, 1e-6, w, b)
    want_h, want_res = reference.fused_add_rms_norm(x.double(), None if res is None else res.double(), nw.double(), 1e-6)
    assert y.shape == (m, n) and y.dtype == dtype
    assert rel_err(y, reference.linear(want_h, w.double(), b.double())) < TOL[dtype]
    assert rel_err(new_res, want_res) < TOL[dtype] / 4
    # the input is left as it was (the residual stream goes to a new tensor)
    if res is not None:
        assert new_res.data_ptr() not in (x.data_ptr(), res.data_ptr())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,inter", [(1, 64, 1536), (1, 1000, 100), (2, 33, 256), (1, 7, 4400),
                                       pytest.param(1, 4096, 5100, marks=LONG_K)])  # fmt: skip
def test_silu_mul_linear_fused(dtype, m, n, inter):
    x = rand(m, 2 * inter, dtype=dtype)
    w, b = rand(n, inter, dtype=dtype, scale=0.1), rand(n, dtype=dtype)
    y = triton_linear.silu_mul_linear(x, w, b)
    assert y.shape == (m, n) and y.dtype == dtype
    want = reference.linear(reference.silu_and_mul(x.double()), w.double(), b.double())
    assert rel_err(y, want) < TOL[dtype]


def test_fused_linears_take_the_kernel_only_where_it_fits(monkeypatch):
    """One row and a decoder-sized matrix: one fused launch; more rows or an LM-head-wide matrix:
    the unfused pair (the library's product)."""
    calls = []
    real = triton_linear._launch
    monkeypatch.setattr(triton_linear, "_launch", lambda *a, **kw: calls.append(a[3]) or real(*a, **kw))
    w = rand(8, 64, scale=0.1)
    triton_linear.silu_mul_linear(rand(1, 128), w)
    triton_linear.add_rms_norm_linear(rand(1, 64), rand(1, 64), rand(64), 1e-6, w)
    assert calls == [triton_linear._SILU_MUL, triton_linear._ADD_RMS_NORM]
    triton_linear.linear(rand(1, 64), w)  # plain, one row: the matrix-vector kernel
    triton_linear.linear(rand(2, 64), w)  # two rows: the library
    monkeypatch.setattr(triton_linear, "MAX_N", 7)
    triton_linear.linear(rand(1, 64), w)  # more outputs than MAX_N: the library
    assert calls == [triton_linear._SILU_MUL, triton_linear._ADD_RMS_NORM, triton_linear._PLAIN]
    calls.clear()
    triton_linear.silu_mul_linear(rand(1, 128), w)
    triton_linear.add_rms_norm_linear(rand(2, 64), rand(2, 64), rand(64), 1e-6, w)
    monkeypatch.setattr(triton_linear, "MAX_N", 8)
    monkeypatch.setattr(triton_linear, "NORM_MAX_K", 63)
    triton_linear.add_rms_norm_linear(rand(1, 64), rand(1, 64), rand(64), 1e-6, w)  # row too long to fuse
    assert calls == [triton_linear._PLAIN]  # the unfused pair's matrix-vector product at one row


SAMPLE_SHAPES = [(1, 5), (7, 1000), (33, 5000), (3, 12289)] + ([(256, 151936), (1, 151936)] if GPU else [])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,vocab", SAMPLE_SHAPES)
def test_sample_from_cdf_matches_twin(rows, vocab, dtype):
    """One vocabulary chunk per program (4,096 tokens under the interpreter, 8,192 on a GPU): the
    larger vocabularies take the merge of several chunks, the smallest one chunk. The token must be
    the one whose interval of the float64 cumulative distribution holds u, up to float32 rounding of
    sums over the vocabulary (the twin's cumsum and the kernel's chunk sums round differently, so
    over 256 rows of 152k tokens an exact match would fail by rounding alone)."""
    x = rand(rows, vocab, scale=3.0)
    x[torch.rand(rows, vocab, device=DEVICE) < 0.3] = float("-inf")  # filtered-out tokens
    x[:, 0] = 0.0  # every row keeps at least one token
    if vocab > 10000:  # a row whose mass sits in its last chunk only, one in its first only
        x[0, : vocab - 100] = float("-inf")
        x[-1, 100:] = float("-inf")
        x[0, -1] = x[-1, 0] = 0.0
    x = x.to(dtype)
    inv_t = torch.rand(rows, device=DEVICE) * 2 + 0.25
    u = torch.rand(rows, device=DEVICE)
    got = triton_sampling.sample_from_cdf(x, inv_t, u)
    cdf = (x.double() * inv_t.double()[:, None]).softmax(dim=-1).cumsum(dim=-1)
    cdf = torch.cat([torch.zeros(rows, 1, dtype=cdf.dtype, device=DEVICE), cdf], dim=1)
    lo_edge, hi_edge = cdf.gather(1, got[:, None])[:, 0], cdf.gather(1, got[:, None] + 1)[:, 0]
    ud = u.double()
    bad = ((ud < lo_edge - 1e-5) | (ud > hi_edge + 1e-5)).nonzero()[:, 0].tolist()
    assert not bad, [(i, float(u[i]), int(got[i]), float(lo_edge[i]), float(hi_edge[i])) for i in bad[:5]]
    assert torch.isfinite(x.gather(1, got[:, None]).float()).all()  # never a filtered token
    twin = reference.sample_from_cdf(x, inv_t, u)
    assert (got == twin).float().mean() > 0.95  # the twin agrees but where rounding decides
    # The ends of the distribution: u = 0 gives the first allowed token; u -> 1 an allowed token at
    # least as late as u = 0.99 gives (which one, among the last of negligible mass, is rounding).
    idx = torch.arange(vocab, device=DEVICE).expand(rows, -1)
    lo = triton_sampling.sample_from_cdf(x, inv_t, torch.zeros(rows, device=DEVICE))
    assert lo.tolist() == torch.where(torch.isfinite(x.float()), idx, vocab).min(1).values.tolist()
    u1 = torch.full((rows,), 1 - 2**-24, device=DEVICE)
    hi = triton_sampling.sample_from_cdf(x, inv_t, u1)
    assert (hi >= reference.sample_from_cdf(x, inv_t, u1 * 0 + 0.99)).all()
    assert torch.isfinite(x.gather(1, hi[:, None]).float()).all()
    assert int(triton_ops.zeroed_counters(1, DEVICE).abs().sum()) == 0  # left at 0 for the next launch


@pytest.mark.parametrize("rows,vocab,slots", [(1, 5, 1), (6, 1000, 9), (5, 4097, 5), (3, 12289, 8)]
                         + ([(256, 151936, 300)] if GPU else []))  # fmt: skip
def test_apply_penalties_matches_twin(rows, vocab, slots):
    """Some of the logits' rows (in any order) take the penalties of table rows (in any order, not
    all used): counts of a few tokens each, prompt flags, every penalty alone and together, both
    signs; the rows not named stay as they were. Vocabularies past one block and off its multiple."""
    x = rand(rows + 2, vocab + 3, scale=3.0).float()[:, :vocab]  # (rows further apart than the vocabulary)
    counts = torch.zeros(slots, vocab, device=DEVICE)
    counts[torch.rand(slots, vocab, device=DEVICE) < 0.05] = 1.0
    counts[torch.rand(slots, vocab, device=DEVICE) < 0.02] = 3.0
    prompt = torch.rand(slots, vocab, device=DEVICE) < 0.1
    params = torch.stack([torch.rand(slots, device=DEVICE) + 0.5, torch.randn(slots, device=DEVICE),
                          torch.randn(slots, device=DEVICE)], dim=1)  # fmt: skip
    counts[:, 1] = 2.0
    if slots > 2:
        params[0, 1:] = 0.0  # repetition alone
        params[-1, 0] = 1.0  # frequency and presence alone
    row_ids = torch.randperm(rows + 2, device=DEVICE)[:rows]
    slot_ids = torch.randperm(slots, device=DEVICE)[:rows]
    want = x.clone()
    reference.apply_penalties(want, row_ids, counts, prompt, slot_ids, params)
    whole = torch.full((rows + 2, vocab + 3), float("nan"), device=DEVICE)
    whole[:, :vocab] = x
    got = whole[:, :vocab]
    triton_sampling.apply_penalties(got, row_ids, counts, prompt, slot_ids, params)
    assert got.stride(0) == vocab + 3 and whole[:, vocab:].isnan().all()  # the padding untouched
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert not torch.equal(got[row_ids], x[row_ids])  # (the penalties changed something)
    untouched = torch.ones(rows + 2, dtype=torch.bool, device=DEVICE)
    untouched[row_ids] = False
    assert torch.equal(got[untouched], x[untouched])


@pytest.mark.parametrize("kvh,head_dim", [(1, 64), (3, 64), (2, 128)])
def test_store_kv_from_strided_views_skips_padding(kvh, head_dim):
    T, nb, bs = 11, 6, 16
    qkv = rand(T, 4 + 2 * kvh, head_dim)
    k, v = qkv[:, 4 : 4 + kvh], qkv[:, 4 + kvh :]
    slots = torch.randperm(nb * bs, device=DEVICE)[:T]
    slots[3] = -1  # a padding token
    kc, vc = rand(nb, bs, kvh, head_dim), rand(nb, bs, kvh, head_dim)
    kc2, vc2 = kc.clone(), vc.clone()
    triton_ops.store_kv(k, v, kc, vc, slots)
    keep = slots >= 0
    reference.store_kv(k[keep], v[keep], kc2, vc2, slots[keep])
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)


FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


@pytest.mark.parametrize("cache_dtype", FP8)
@pytest.mark.parametrize("dtype", DTYPES)
def test_store_kv_into_an_fp8_cache_rounds_and_saturates_as_the_twin(cache_dtype, dtype):
    """kv_cache_dtype fp8*: the stored bytes equal the twin's (nearest 8-bit value, saturating at
    the largest finite one; K/V scaled so that some pass e4m3's 448 and e5m2's 57,344)."""
    T, nb, bs, kvh, d = 9, 4, 16, 2, 64
    k = rand(T, kvh, d, dtype=dtype, scale=200.0)
    v = rand(T, kvh, d, dtype=dtype, scale=3e4 if dtype != torch.float16 else 1e4)
    k[0, 0, 0], v[1, 1, 1] = 6e4, -6e4
    slots = torch.randperm(nb * bs, device=DEVICE)[:T]
    kc, vc = torch.zeros(nb, bs, kvh, d, dtype=cache_dtype, device=DEVICE), torch.zeros(nb, bs, kvh, d, dtype=cache_dtype, device=DEVICE)
    kc2, vc2 = kc.clone(), vc.clone()
    triton_ops.store_kv(k, v, kc, vc, slots)
    reference.store_kv(k, v, kc2, vc2, slots)
    assert_same_fp8(kc, kc2)
    assert_same_fp8(vc, vc2)
    big = torch.finfo(cache_dtype).max
    got = kc.float().view(-1, kvh, d)[slots]
    assert torch.isfinite(got).all() and float(got.abs().max()) == big  # saturated, not inf/NaN
    assert rel_err(got, k.float().clamp(-big, big)) < 0.1  # 8-bit rounding: 2-3 mantissa bits


def assert_same_fp8(got: torch.Tensor, want: torch.Tensor) -> None:
    """Bit-equal 8-bit values on a GPU (its hardware conversion rounds to nearest even, as torch
    does). Triton's interpreter converts to 8-bit floats without carrying a rounding into the
    exponent (124.5 -> 64, not 128) and without subnormal results, so on the CPU the values are
    compared with the error that leaves (~1 in 50 values off, by up to half)."""
    if GPU:
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    else:
        assert rel_err(got.float(), want.float()) < 0.15


# ---- paged attention -------------------------------------------------------------------------
def make_step(rng: random.Random, seqs: list[tuple[int, int]], heads: int, kvh: int, head_dim: int, bs: int,
              dtype) -> tuple:  # fmt: skip
    """seqs: (cached tokens before the step, new tokens this step). A random paged cache, random
    block tables, this step's K/V already stored at its slots (as the decoder does)."""
    nblk = [-(-(c + n) // bs) for c, n in seqs]
    num_blocks = sum(nblk) + 3
    perm = rng.sample(range(num_blocks), sum(nblk))
    tables = np.zeros((len(seqs), max(nblk)), dtype=np.int64)
    at = 0
    for i, n in enumerate(nblk):
        tables[i, :n] = perm[at : at + n]
        at += n
    kc = rand(num_blocks, bs, kvh, head_dim, dtype=dtype)
    vc = rand(num_blocks, bs, kvh, head_dim, dtype=dtype)
    q_lens = np.array([n for _, n in seqs])
    seq_lens = np.array([c + n for c, n in seqs])
    qsl = np.concatenate([[0], np.cumsum(q_lens)])
    T = int(qsl[-1])
    pos = np.concatenate([np.arange(c, c + n) for c, n in seqs])
    seq_of = np.repeat(np.arange(len(seqs)), q_lens)
    slots = torch.from_numpy(tables[seq_of, pos // bs] * bs + pos % bs).to(DEVICE)
    k = kc.view(-1, kvh, head_dim)[slots]
    v = vc.view(-1, kvh, head_dim)[slots]
    q = rand(T, heads, head_dim, dtype=dtype)
    meta = AttentionMetadata(
        query_start_loc=torch.from_numpy(qsl.astype(np.int32)).to(DEVICE),
        seq_lens=torch.from_numpy(seq_lens.astype(np.int32)).to(DEVICE),
        block_tables=torch.from_numpy(tables.astype(np.int32)).to(DEVICE),
        slot_mapping=slots,
        host={"query_start_loc": qsl, "seq_lens": seq_lens},
    )
    return q, k, v, kc, vc, meta


def fresh(meta: AttentionMetadata) -> AttentionMetadata:
    return AttentionMetadata(meta.query_start_loc, meta.seq_lens, meta.block_tables, meta.slot_mapping,
                             host=dict(meta.host))  # fmt: skip


# (cached, new) per sequence: decodes, prefill chunks over cached prefixes, fresh prompts; lengths
# that end exactly on and just past 16-token blocks.
BATCHES = {
    "decode": [(15, 1), (16, 1), (40, 1), (1, 1), (70, 1)],
    "mixed": [(31, 1), (0, 16), (16, 17), (5, 1), (32, 9), (0, 3)],
    "prefill": [(0, 33), (48, 16), (17, 20)],
    "long_decode": [(200, 1)],
}


@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("heads,kvh,head_dim", [(4, 2, 64), (6, 2, 64), (3, 3, 32), (8, 1, 128)])
@pytest.mark.parametrize("window", [None, 24])
def test_paged_attention_matches_twin(batch, heads, kvh, head_dim, window):
    rng = random.Random(str((batch, heads, kvh, window)))  # the same inputs every run
    q, k, v, kc, vc, meta = make_step(rng, BATCHES[batch], heads, kvh, head_dim, 16, torch.float32)
    scale = head_dim**-0.5
    want = reference.paged_attention(q, k, v, kc, vc, fresh(meta), scale, window)
    got = triton_attention.paged_attention(q, k, v, kc, vc, fresh(meta), scale, window)
    assert rel_err(got, want) < 1e-4


@pytest.mark.parametrize("dtype", [d for d in DTYPES if d != torch.float32])
@pytest.mark.parametrize("bs", [16, 32] + ([64, 128] if GPU else []))
def test_paged_attention_half_precision_and_block_sizes(dtype, bs):
    rng = random.Random(bs)
    seqs = [(bs - 1, 1), (2 * bs, 1), (0, bs + 1), (bs, 5), (3 * bs + 7, 1)]
    q, k, v, kc, vc, meta = make_step(rng, seqs, 8, 2, 64, bs, dtype)
    want = reference.paged_attention(q.float(), k.float(), v.float(), kc.float(), vc.float(), fresh(meta), 0.125)
    got = triton_attention.paged_attention(q, k, v, kc, vc, fresh(meta), 0.125)
    assert got.dtype == dtype and rel_err(got, want) < TOL[dtype]


@pytest.mark.parametrize("cache_dtype", FP8)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16] if not GPU else DTYPES)
@pytest.mark.parametrize("batch", ["decode", "mixed"])
def test_paged_attention_over_an_fp8_cache_matches_twin(cache_dtype, dtype, batch):
    """An 8-bit cache (this step's K/V stored in it, as the decoder does): the kernel converts what it
    reads to q's dtype; the twin reads the same values (fresh prompts: k/v rounded through the cache)."""
    rng = random.Random(str((batch, str(cache_dtype), str(dtype))))
    q, _, _, kc, vc, meta = make_step(rng, BATCHES[batch], 6, 2, 64, 16, dtype)
    kc8, vc8 = reference.to_kv_cache(kc, cache_dtype), reference.to_kv_cache(vc, cache_dtype)
    k = kc8.to(dtype).view(-1, 2, 64)[meta.slot_mapping]
    v = vc8.to(dtype).view(-1, 2, 64)[meta.slot_mapping]
    want = reference.paged_attention(q, k, v, kc8, vc8, fresh(meta), 0.125)
    # the twin over an 8-bit cache = the twin over a cache in q's dtype holding the 8-bit values
    assert torch.equal(want, reference.paged_attention(q, k, v, kc8.to(dtype), vc8.to(dtype), fresh(meta), 0.125))
    got = triton_attention.paged_attention(q, k, v, kc8, vc8, fresh(meta), 0.125)
    assert got.dtype == dtype and rel_err(got, want) < (1e-4 if dtype == torch.float32 else TOL[dtype])


@pytest.mark.parametrize("splits", [2, 4, 16])
@pytest.mark.parametrize("split_tiles", [None, 1])
@pytest.mark.parametrize("heads_first", [True, False])
def test_split_kv_merge_equals_one_pass(splits, split_tiles, heads_first):
    """The flash-decoding split (partials, merged by the last split to finish) gives what one
    program over the whole range gives: decodes, a prefill chunk over a cached prefix, and a short
    context where most splits are empty. split_tiles=1: as in a captured mixed graph, only the first
    tile (the chunk's, plan_tiles puts it first) splits, the other tiles and padding tiles run in a
    second, unsplit launch. Run twice: the merge counters are left at zero. In either order of the
    programs (heads_first: a tile's heads and splits one after another; else tiles first)."""
    rng = random.Random(7)
    q, k, v, kc, vc, meta = make_step(rng, [(300, 1), (90, 1), (40, 20), (3, 1)], 4, 2, 64, 16, torch.float32)
    one = fresh(meta)
    triton_attention.prepare(one, 4, 2, DEVICE)["splits"] = 1
    a = triton_attention.paged_attention(q, k, v, kc, vc, one, 0.125)
    for _ in range(2):
        split = fresh(meta)
        plan = triton_attention.prepare(split, 4, 2, DEVICE)
        plan.update(splits=splits, heads_first=heads_first)
        if split_tiles is not None:
            assert int(plan["tile_seq"][0]) == 2  # the chunk's tile first
            pad = torch.full((3,), -1, dtype=plan["tile_seq"].dtype, device=DEVICE)
            plan.update(split_tiles=split_tiles, num_tiles=plan["num_tiles"] + 3,
                        tile_seq=torch.cat([plan["tile_seq"], pad]), tile_q=torch.cat([plan["tile_q"], pad * 0]))  # fmt: skip
        b = triton_attention.paged_attention(q, k, v, kc, vc, split, 0.125)
        assert rel_err(b, a) < 1e-5
        assert int(triton_ops.zeroed_counters(1, DEVICE).abs().sum()) == 0


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_trips_without_masks_give_what_masked_trips_give(splits, dtype):
    """Loop trips that every row of a tile sees whole run without the causal and range masks
    (diag_only); the rest keep them. Prompt chunks over long cached prefixes, a long fresh prompt,
    chunks whose first token is the last position of a trip or the one before it, decodes ending on
    and past a trip: the same output with the masks on every trip, and the twin's, whole and with
    the KV range split."""
    rng = random.Random(str((splits, str(dtype))))
    seqs = [(300, 20), (260, 1), (0, 140), (126, 5), (127, 5), (255, 1), (256, 1)]
    q, k, v, kc, vc, meta = make_step(rng, seqs, 4, 2, 64, 16, dtype)
    want = reference.paged_attention(q.float(), k.float(), v.float(), kc.float(), vc.float(), fresh(meta), 0.125)
    outs = []
    for diag_only in (True, False):
        m = fresh(meta)
        plan = triton_attention.prepare(m, 4, 2, DEVICE)
        plan.update(diag_only=diag_only, splits=splits)
        outs.append(triton_attention.paged_attention(q, k, v, kc, vc, m, 0.125).float())
    tol = 1e-4 if dtype == torch.float32 else TOL[dtype]
    assert rel_err(outs[0], want) < tol and rel_err(outs[1], want) < tol
    assert rel_err(outs[0], outs[1]) < (1e-5 if dtype == torch.float32 else TOL[dtype])


def test_only_unsplit_prompt_chunks_skip_the_masks(monkeypatch):
    """tile_plan's diag_only: a mixed step whose tiles fill the device unsplit walks its whole trips
    without masks; decode steps and split ranges (their programs run a few trips) keep one loop."""
    monkeypatch.setattr(triton_attention, "triton_interpreting", lambda: False)
    monkeypatch.setattr(triton_attention, "compute_units", lambda device: 132)
    plan = functools.partial(triton_attention.tile_plan, 16, 8)
    dev = torch.device("cuda")
    unsplit, split = plan(False, 256, 2048, dev), plan(False, 2, 4096, dev)
    assert unsplit["splits"] == 1 and unsplit["diag_only"]
    assert split["splits"] > 1 and not split["diag_only"]
    for tiles, ctx in ((1, 2048), (64, 2048), (256, 2048), (256, 300)):
        assert not plan(True, tiles, ctx, dev)["diag_only"]


def test_num_splits_for_fills_the_device_within_its_caps(monkeypatch):
    """Splits only where the tiles alone would leave compute units idle; at most 16 (decode) or 8
    (mixed: one program merges a tile's splits in turn) and never under 256 positions per split."""
    monkeypatch.setattr(triton_attention, "triton_interpreting", lambda: False)
    f = triton_attention.num_splits_for
    assert f(1, 8, 8192, 132, True) == 16 and f(1, 8, 8192, 132, False) == 8
    assert f(1, 8, 1024, 132, True) == 4  # 256 positions per split at least
    assert f(1, 8, 400, 132, True) == 1  # short contexts are not split
    assert f(64, 8, 8192, 132, True) == 1  # 512 programs: enough already
    assert f(8, 8, 8192, 132, True) == 8  # 64 programs: x8 reaches 2 per unit
    # decode over a 16-bit cache: ~4 programs per unit, not only powers of two
    kv16 = functools.partial(f, units=132, decode_only=True, kv16=True)
    assert [kv16(n, 8, 4096) for n in (1, 4, 8, 16, 24, 32)] == [16, 16, 8, 4, 3, 2]
    assert kv16(1, 8, 2048) == 8 and kv16(4, 8, 1024) == 4 and kv16(24, 8, 511) == 1
    # from 2 programs per unit up (the wide tiles), in two below 4 per unit; other caches not at all
    assert kv16(33, 8, 2048) == 2 and kv16(66, 8, 2048) == 1 and f(33, 8, 2048, 132, True) == 1


def test_decode_tiles_over_an_8bit_cache_read_as_many_bytes_per_trip(monkeypatch):
    """An 8-bit cache's decode tiles take 128 positions per loop trip (the bytes of 64 in bf16);
    mixed steps and 16-bit caches keep 64."""
    monkeypatch.setattr(triton_attention, "triton_interpreting", lambda: False)
    monkeypatch.setattr(triton_attention, "compute_units", lambda device: 132)
    plan = triton_attention.tile_plan
    dev = torch.device("cuda")
    assert plan(16, 8, True, 64, 2048, dev, kv_itemsize=1)["block_n"] == 128
    assert plan(16, 8, True, 32, 2048, dev)["block_n"] == 64
    assert plan(16, 8, False, 64, 2048, dev, kv_itemsize=1)["block_n"] == 64


def test_decode_batches_over_a_16bit_cache_take_wide_two_stage_tiles(monkeypatch):
    """Decode steps with at least 2 programs per compute unit read 128 positions a trip in 2
    stages over a 16-bit cache with heads up to 128 wide, and below 4 per unit split the KV range
    in two (contexts of 512 and more); smaller batches, mixed steps and other caches keep their
    settings. Programs start a tile's heads first, except in decode steps on the narrow tiles."""
    monkeypatch.setattr(triton_attention, "triton_interpreting", lambda: False)
    monkeypatch.setattr(triton_attention, "compute_units", lambda device: 132)
    plan = triton_attention.tile_plan
    dev = torch.device("cuda")
    setting = lambda p: (p["block_n"], p["launch"], p["splits"])  # noqa: E731
    assert setting(plan(16, 8, True, 33, 2048, dev)) == (128, {"num_stages": 2}, 2)  # 264 programs = 2 per unit
    assert setting(plan(16, 8, True, 65, 2048, dev)) == (128, {"num_stages": 2}, 2)  # 520 < 4 per unit
    assert setting(plan(16, 8, True, 66, 2048, dev)) == (128, {"num_stages": 2}, 1)
    assert setting(plan(16, 8, True, 64, 511, dev)) == (128, {"num_stages": 2}, 1)  # too short to split
    assert setting(plan(16, 8, True, 32, 2048, dev)) == (64, {}, 2)  # num_splits_for's: ~4 programs per unit
    assert plan(16, 8, True, 256, 2048, dev, kv_itemsize=1)["launch"] == {}
    assert plan(16, 8, True, 64, 2048, dev, kv_itemsize=1)["splits"] == 1
    assert setting(plan(16, 8, False, 64, 2048, dev))[:2] == (64, {})  # mixed: num_splits_for decides
    # programs start heads first, except in decode steps on narrow tiles
    assert plan(16, 8, True, 33, 2048, dev)["heads_first"] and plan(16, 8, False, 4, 2048, dev)["heads_first"]
    assert not plan(16, 8, True, 32, 2048, dev)["heads_first"]
    # float32 caches and heads over 128 keep 64 positions (two wide stages would overflow shared memory)
    for kw in ({"kv_itemsize": 4}, {"head_dim": 256}):
        assert setting(plan(16, 8, True, 64, 2048, dev, **kw)) == (64, {}, 1)


@pytest.mark.parametrize("dtype", [d for d in DTYPES if d != torch.float32])
@pytest.mark.parametrize("units", [2, 4])
def test_paged_attention_wide_decode_tiles_match_twin(dtype, units, monkeypatch):
    """A decode batch that takes the wide tiles (6 sequences x 2 KV heads on a device of 2 compute
    units; of 4, where a GPU also splits the KV range in two: 3 programs per unit), contexts ending
    on, before and past 128-position trips."""
    monkeypatch.setattr(triton_attention, "compute_units", lambda device: units)
    seqs = [(127, 1), (128, 1), (300, 1), (5, 1), (255, 1), (1000, 1)]
    q, k, v, kc, vc, meta = make_step(random.Random(7), seqs, 6, 2, 128, 16, dtype)
    plan = triton_attention.prepare(meta, 6, 2, q.device, kc.element_size(), 128)
    assert plan["block_n"] == 128
    assert plan["splits"] == (1 if units == 2 or q.device.type == "cpu" else 2)
    want = reference.paged_attention(q.float(), k.float(), v.float(), kc.float(), vc.float(), fresh(meta), 128**-0.5)
    got = triton_attention.paged_attention(q, k, v, kc, vc, meta, 128**-0.5)
    assert got.dtype == dtype and rel_err(got, want) < TOL[dtype]


@pytest.mark.parametrize("heads,kvh", [(16, 8), (32, 8), (8, 8), (12, 4)])
def test_tile_shape_pads_decode_tiles_only_where_the_backend_needs_it(heads, kvh):
    """Decode tiles hold one token's heads; on Intel XPU they are padded to tl.dot's 16 rows; mixed
    tiles have 64 rows everywhere."""
    g_pad = triton.next_power_of_2(heads // kvh)
    for dev in ("cpu", "cuda"):
        assert triton_attention.tile_shape(heads, kvh, True, torch.device(dev)) == (1, g_pad)
    bq, gp = triton_attention.tile_shape(heads, kvh, True, torch.device("xpu"))
    assert gp == g_pad and bq * gp >= 16 and (bq - 1) * gp < 16
    assert triton_attention.tile_shape(heads, kvh, False, torch.device("cuda")) == (64 // g_pad, g_pad)


def test_plan_tiles_cover_every_token_once():
    qsl = np.array([0, 1, 18, 19, 52])
    seq, q0 = triton_attention.plan_tiles(qsl, 8, np.full(4, 60))  # equal contexts: sequence order
    covered = sorted((int(s), int(t)) for s, a in zip(seq, q0) for t in range(a, min(a + 8, qsl[s + 1] - qsl[s])))
    assert covered == [(s, t) for s in range(4) for t in range(int(qsl[s + 1] - qsl[s]))]
    # prompt chunks' tiles first (a mixed graph splits those), then the single-token sequences'
    assert seq.tolist() == [1, 1, 1, 3, 3, 3, 3, 3, 0, 2]


def test_plan_tiles_start_the_longest_contexts_first_within_each_kind():
    qsl = np.array([0, 1, 18, 19, 52, 53, 54])
    seq_lens = np.array([5, 40, 900, 60, 7, 300, 0])  # one entry past the batch (a padded array)
    seq, q0 = triton_attention.plan_tiles(qsl, 8, seq_lens)
    covered = sorted((int(s), int(t)) for s, a in zip(seq, q0) for t in range(a, min(a + 8, qsl[s + 1] - qsl[s])))
    assert covered == [(s, t) for s in range(6) for t in range(int(qsl[s + 1] - qsl[s]))]
    # chunks first, longer context first (3: 60 before 1: 40), then decodes by context: 2, 5, 4, 0
    assert seq.tolist() == [3, 3, 3, 3, 3, 1, 1, 1, 2, 5, 4, 0]
    assert q0.tolist() == [0, 8, 16, 24, 32, 0, 8, 16, 0, 0, 0, 0]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("nq,nkv,head_dim,rot", [(4, 2, 64, None), (6, 2, 128, None), (3, 1, 64, 32)])
def test_qkv_prepare_fused_norm_rope_store(dtype, norm, neox, nq, nkv, head_dim, rot):
    """q/k norm + RoPE + K/V store in one pass equals the twin's composition (partial rotary takes
    the unfused path); padding tokens (slot -1) store nothing."""
    T, nb, bs = 13, 5, 16
    table = _table(head_dim, 200, llama3=False, rot=rot)
    positions = torch.tensor(random.Random(nq).sample(range(200), T), device=DEVICE)
    qkv = rand(T, nq + 2 * nkv, head_dim, dtype=dtype)
    qn, kn = (rand(head_dim, dtype=dtype), rand(head_dim, dtype=dtype)) if norm else (None, None)
    slots = torch.randperm(nb * bs, device=DEVICE)[:T]
    slots[4] = -1
    kc, vc = rand(nb, bs, nkv, head_dim, dtype=dtype), rand(nb, bs, nkv, head_dim, dtype=dtype)
    kc2, vc2, qkv2 = kc.clone(), vc.clone(), qkv.clone()
    keep = slots >= 0
    rq, rk, rv = reference.qkv_prepare(qkv2[keep], nq, qn, kn, 1e-6, reference.rope_cos_sin(table, positions[keep], dtype),
                                       kc2, vc2, slots[keep], neox)  # fmt: skip
    q, k, v = triton_ops.qkv_prepare(qkv, nq, qn, kn, 1e-6, triton_ops.rope_cos_sin(table, positions, dtype),
                                     kc, vc, slots, neox)  # fmt: skip
    assert rel_err(q[keep], rq) < TOL[dtype] and rel_err(k[keep], rk) < TOL[dtype]
    assert torch.equal(v[keep], rv)
    assert rel_err(kc, kc2) < TOL[dtype] and torch.equal(vc, vc2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16] if GPU else [torch.bfloat16])
def test_qkv_prepare_into_an_fp8_cache(dtype):
    """The fused store rounds to the 8-bit cache as the twin does: V bit-equal; K after norm and
    RoPE, whose last-bit differences may move a value to the next 8-bit step."""
    T, nb, bs, nq, nkv, d = 13, 5, 16, 4, 2, 64
    table = _table(d, 200, llama3=False)
    positions = torch.tensor(random.Random(3).sample(range(200), T), device=DEVICE)
    qkv = rand(T, nq + 2 * nkv, d, dtype=dtype, scale=300.0)
    qn, kn = rand(d, dtype=dtype), rand(d, dtype=dtype)
    slots = torch.randperm(nb * bs, device=DEVICE)[:T]
    kc = torch.zeros(nb, bs, nkv, d, dtype=torch.float8_e4m3fn, device=DEVICE)
    vc, kc2, vc2 = kc.clone(), kc.clone(), kc.clone()
    reference.qkv_prepare(qkv.clone(), nq, qn, kn, 1e-6, reference.rope_cos_sin(table, positions, dtype), kc2, vc2, slots)
    triton_ops.qkv_prepare(qkv.clone(), nq, qn, kn, 1e-6, triton_ops.rope_cos_sin(table, positions, dtype), kc, vc, slots)
    assert_same_fp8(vc, vc2)
    assert float(vc2.float().abs().max()) == 448.0  # V at scale 300 saturates
    if GPU:  # (the interpreter's float8 conversion is off, see assert_same_fp8)
        assert float(vc.float().abs().max()) == 448.0
    assert rel_err(kc.float(), kc2.float()) < (0.05 if GPU else 0.15)  # bf16 last-bit differences (TOL) can move a value one 8-bit step


def test_gemv_program_shape_takes_whole_rows_up_to_the_one_tile_limit():
    """The cases above cover both kernel paths: one load per row up to ONE_TILE_MAX_K, the K loop past it."""
    limit = triton_linear.ONE_TILE_MAX_K
    assert triton_linear._tiles(1, limit)[2] >= limit
    assert triton_linear._tiles(1, 4500)[2] < 4500 and triton_linear._tiles(1, 4400)[2] < 4400


def test_every_kernel_takes_the_pdl_flag():
    """platform.triton_launch_options passes PDL=True to every launch on GPUs with programmatic
    dependent launch: a kernel without the parameter fails there, and only there (the interpreter
    gets no options)."""
    kernels = [(m.__name__, name, fn) for m in (triton_attention, triton_linear, triton_ops, triton_sampling)
               for name, fn in vars(m).items() if isinstance(fn, triton.runtime.KernelInterface) and name.endswith("_kernel")]  # fmt: skip
    assert len(kernels) >= 8
    missing = [f"{mod}.{name}" for mod, name, fn in kernels if "PDL" not in fn.arg_names]
    assert not missing
