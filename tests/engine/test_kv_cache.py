"""BlockPool / KVCacheManager: chained prefix hashes, cache hits, LRU eviction, all-or-nothing
allocation; and a seeded random workload driving the Scheduler (no model) that checks the block
bookkeeping invariants after every step, with a fake runner that checks every KV read sees the
tokens that were written there."""

from __future__ import annotations

import random
from collections import Counter

import numpy as np
import pytest

from arcserve.engine.kv_cache import _ROOT_HASH, KVCacheManager, hash_block
from arcserve.engine.policy import make_policy
from arcserve.engine.request import Request, RequestStatus
from arcserve.engine.scheduler import Scheduler
from arcserve.sampling_params import SamplingParams

BS = 4


def make_req(
    rid: str, tokens: list[int], max_tokens: int = 8, priority: int = 0, arrival: float | None = None
):
    params = SamplingParams(max_tokens=max_tokens)
    params._eos_token_ids = frozenset()  # as LLMEngine.add_request does (no EOS: stop on length)
    return Request(rid, tokens, params, max_tokens, arrival, priority)


def compute(kv: KVCacheManager, req: Request, n: int, cached: list[int] | None = None) -> None:
    """What the scheduler + runner do for a chunk of n tokens: allocate, compute, commit."""
    assert kv.allocate(req, n, cached)
    if cached:  # admission with prefix-cache hits
        req.num_computed_tokens = len(cached) * kv.block_size
    req.num_computed_tokens += n
    kv.commit(req)


def free_order(kv: KVCacheManager) -> list[int]:
    return list(kv.pool.free_queue)


# ---- hashes -----------------------------------------------------------------------------------


def test_chained_hashes():
    kv = KVCacheManager(16, BS)
    a = make_req("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    b = make_req("b", [10, 11, 12, 13, 5, 6, 7, 8, 9])  # same block 2, different block 1
    c = make_req("c", [1, 2, 3, 4, 5, 6, 7, 8, 99])  # same two full blocks as a
    for r in (a, b, c):
        kv.find_cached_prefix(r)
        assert len(r.block_hashes) == 2  # (9 - 1) // 4 full blocks
    assert a.block_hashes[1] != b.block_hashes[1]
    assert a.block_hashes[0] != b.block_hashes[0]
    assert a.block_hashes == c.block_hashes
    # The chain: block i's hash is its parent's hash plus its own tokens.
    assert a.block_hashes[0] == hash_block(_ROOT_HASH, np.array([1, 2, 3, 4], np.int64).tobytes())
    assert a.block_hashes[1] == hash_block(a.block_hashes[0], np.array([5, 6, 7, 8], np.int64).tobytes())
    assert hash_block(_ROOT_HASH, np.array([5, 6, 7, 8], np.int64).tobytes()) != a.block_hashes[1]

    # In the cache: a's blocks are found by a's hashes, b's second block is not.
    compute(kv, a, 9)
    assert kv.pool.lookup(a.block_hashes[1]) == kv.block_table("a")[1]
    assert kv.pool.lookup(b.block_hashes[1]) is None
    assert kv.find_cached_prefix(b) == []
    assert kv.find_cached_prefix(c) == kv.block_table("a")[:2]


def test_partial_block_is_not_cached():
    kv = KVCacheManager(16, BS)
    a = make_req("a", list(range(100, 111)))  # 11 tokens: 2 full blocks + 3
    compute(kv, a, 11)
    table = kv.block_table("a")
    assert len(table) == 3
    assert kv.pool.block_hash[table[2]] is None
    assert len(kv.pool.cached) == 2
    # Only computed tokens count: a chunk that ends mid-block registers the blocks before it.
    b = make_req("b", list(range(200, 211)))
    compute(kv, b, 6)
    assert [kv.pool.block_hash[x] is not None for x in kv.block_table("b")] == [True, False]


# ---- prefix hits ------------------------------------------------------------------------------


def test_find_cached_prefix_never_covers_last_token():
    kv = KVCacheManager(16, BS)
    prompt = list(range(50, 58))  # exactly 2 full blocks
    a = make_req("a", prompt)
    compute(kv, a, 8)
    assert len(kv.pool.cached) == 2
    # Fully cached 2-block prompt: only the first block may be reused.
    assert kv.find_cached_prefix(make_req("b", prompt)) == kv.block_table("a")[:1]
    # One more token: both blocks.
    assert kv.find_cached_prefix(make_req("c", prompt + [1])) == kv.block_table("a")
    # Prompts of one block or less never hit.
    assert kv.find_cached_prefix(make_req("d", prompt[:4])) == []
    assert kv.find_cached_prefix(make_req("e", prompt[:1])) == []


def test_cached_blocks_shared_between_live_requests():
    kv = KVCacheManager(16, BS)
    prompt = list(range(30, 39))
    a = make_req("a", prompt)
    compute(kv, a, 9)
    b = make_req("b", prompt + [7, 7, 7])
    hits = kv.find_cached_prefix(b)
    assert hits == kv.block_table("a")[:2]
    compute(kv, b, 12 - 8, hits)
    assert kv.block_table("b")[:2] == hits
    assert kv.block_table("b")[2] not in kv.block_table("a")
    assert [kv.pool.ref_cnt[x] for x in hits] == [2, 2]
    kv.free(a)
    assert [kv.pool.ref_cnt[x] for x in hits] == [1, 1]
    assert all(x not in kv.pool.free_queue for x in hits)
    kv.free(b)
    assert kv.pool.num_free == 16 and kv.usage() == 0.0


# ---- LRU --------------------------------------------------------------------------------------


def test_freed_blocks_keep_hash_and_are_reused():
    kv = KVCacheManager(8, BS)
    prompt = list(range(10, 22))  # 3 full blocks
    a = make_req("a", prompt)
    compute(kv, a, 12)
    table_a = list(kv.block_table("a"))
    kv.free(a)
    assert kv.pool.num_free == 8 and kv.usage() == 0.0
    assert all(kv.pool.block_hash[x] is not None for x in table_a)
    b = make_req("b", prompt + [1, 2])
    hits = kv.find_cached_prefix(b)
    assert hits == table_a
    compute(kv, b, 2, hits)
    assert kv.block_table("b")[:3] == table_a
    assert [kv.pool.ref_cnt[x] for x in table_a] == [1, 1, 1]
    assert kv.pool.num_free == 8 - 4


def test_eviction_oldest_first_and_tail_before_head():
    kv = KVCacheManager(8, BS)
    a = make_req("a", list(range(100, 112)))  # 3 full blocks each
    b = make_req("b", list(range(200, 212)))
    compute(kv, a, 12)
    compute(kv, b, 12)
    ta, tb = list(kv.block_table("a")), list(kv.block_table("b"))
    kv.free(a)
    kv.free(b)
    never_used = [x for x in range(8) if x not in ta + tb]
    # Never-used blocks first, then a (freed first) tail to head, then b tail to head.
    assert free_order(kv) == never_used + ta[::-1] + tb[::-1]

    # Hand out 3 blocks: the 2 never used and a's tail block. a's head blocks stay cached.
    x = make_req("x", list(range(300, 312)))
    assert kv.allocate(x, 12)
    assert kv.block_table("x") == never_used + [ta[2]]
    a2 = make_req("a2", list(range(100, 112)) + [0])
    assert kv.find_cached_prefix(a2) == ta[:2]
    assert kv.find_cached_prefix(make_req("b2", list(range(200, 212)) + [0])) == tb


def test_cache_hit_refreshes_lru_position():
    """A freed block that is taken again by a cache hit and freed again goes to the back of the
    free queue: blocks not reused since are evicted before it."""
    kv = KVCacheManager(6, BS)
    pa, pb = list(range(100, 112)), list(range(200, 212))
    a, b = make_req("a", pa), make_req("b", pb)
    compute(kv, a, 12)
    compute(kv, b, 12)
    ta, tb = list(kv.block_table("a")), list(kv.block_table("b"))
    kv.free(a)
    kv.free(b)
    assert free_order(kv) == ta[::-1] + tb[::-1]  # a is older than b
    a2 = make_req("a2", pa + [0])
    hits = kv.find_cached_prefix(a2)
    assert hits == ta
    compute(kv, a2, 1, hits)
    assert kv.block_table("a2") == ta + [tb[2]]  # its one new block: b's tail, the oldest free one
    kv.free(a2)
    y = make_req("y", list(range(300, 308)))
    assert kv.allocate(y, 8)
    assert kv.block_table("y") == [tb[1], tb[0]]  # b's rest, now older than a's blocks
    assert kv.find_cached_prefix(make_req("b3", pb + [0])) == []
    assert kv.find_cached_prefix(make_req("a3", pa + [0])) == ta


# ---- allocation -------------------------------------------------------------------------------


def snapshot(kv: KVCacheManager):
    p = kv.pool
    return (
        list(p.ref_cnt), list(p.free_queue), list(p.block_hash), dict(p.cached),
        {k: list(v) for k, v in kv.blocks.items()}, dict(kv._num_hashed),
    )  # fmt: skip


def test_allocate_fails_without_changes():
    kv = KVCacheManager(4, BS)
    a = make_req("a", list(range(12)))
    compute(kv, a, 12)  # 3 of 4 blocks
    before = snapshot(kv)
    b = make_req("b", list(range(50, 58)))
    assert not kv.allocate(b, 8)  # needs 2 blocks, 1 free
    assert snapshot(kv) == before
    assert "b" not in kv.blocks
    # A running request that needs more than what is free: also nothing changed.
    a.token_ids += [1] * 8
    assert not kv.allocate(a, 8)
    assert snapshot(kv) == before
    assert kv.allocate(a, 4)  # exactly the one free block
    assert kv.pool.num_free == 0


def test_allocate_counts_free_cache_hits_as_used():
    """Hits sitting in the free queue stop being free when taken: a request whose hits would
    leave too few blocks for its new tokens is refused, hits untouched."""
    kv = KVCacheManager(4, BS)
    a = make_req("a", list(range(9)))
    compute(kv, a, 8)  # 3 blocks allocated, 2 full ones cached
    ta = list(kv.block_table("a"))
    kv.free(a)
    x = make_req("x", [500])
    assert kv.allocate(x, 1)  # takes the never-used block
    b = make_req("b", list(range(8)) + [70, 71, 72, 73, 74])  # 13 tokens: 2 hits + 2 new blocks
    hits = kv.find_cached_prefix(b)
    assert hits == ta[:2]
    before = snapshot(kv)
    assert kv.pool.num_free == 3  # a's 3 blocks, 2 of them the hits
    assert not kv.allocate(b, 13 - 8, hits)
    assert snapshot(kv) == before
    assert [kv.pool.ref_cnt[h] for h in hits] == [0, 0]
    kv.free(x)
    assert kv.allocate(b, 13 - 8, hits)
    assert kv.block_table("b")[:2] == ta[:2]
    assert kv.pool.num_free == 0


# ---- prefix caching off -----------------------------------------------------------------------


def test_prefix_caching_disabled_never_hits():
    kv = KVCacheManager(8, BS, enable_prefix_caching=False)
    prompt = list(range(13))
    a = make_req("a", prompt)
    compute(kv, a, 13)
    assert kv.find_cached_prefix(make_req("b", prompt)) == []
    kv.free(a)
    assert kv.find_cached_prefix(make_req("c", prompt)) == []
    assert kv.pool.cached == {}
    assert all(h is None for h in kv.pool.block_hash)
    assert kv.prefix_hits == 0

    # Through the scheduler: the same prompt twice, one after the other, computes it twice.
    sched = Scheduler(KVCacheManager(8, BS, False), make_policy("fcfs"), 4, 64, 32)
    for rid in ("r1", "r2"):
        sched.add_request(make_req(rid, prompt, max_tokens=1))
        out = sched.schedule()
        assert [(s.start_pos, s.num_new_tokens) for s in out.seqs] == [(0, 13)]
        sched.update(out, {rid: 5})
        assert not sched.has_unfinished()
    assert sched.kv.prefix_hits == 0


# ---- random workload through the scheduler ----------------------------------------------------


class FakeRunner:
    """Stands in for the model: writes each scheduled token into its KV slot and checks that every
    position a sequence attends to holds that sequence's token (so cache hits are real)."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.bs = block_size
        self.slots: list[list[int | None]] = [[None] * block_size for _ in range(num_blocks)]
        self.pending_writes = 0

    def execute(self, out, pool) -> None:
        """Through the step's own block tables (SchedulerOutput.block_tables), as the runner reads them."""
        assert out.block_tables.dtype == np.int32 and out.block_tables.shape[0] == len(out.seqs)
        for s, table in zip(out.seqs, out.block_tables.tolist()):
            req = s.request
            assert s.num_new_tokens >= 1  # the last token always runs (it yields the logits)
            assert len(table) * self.bs >= s.start_pos + s.num_new_tokens
            for pos in range(s.start_pos):
                assert self.token_at(table[pos // self.bs], pos) == req.token_ids[pos], (
                    f"{req.request_id} reads a wrong token at position {pos}"
                )
            for pos in range(s.start_pos, s.start_pos + s.num_new_tokens):
                block = table[pos // self.bs]
                assert pool.ref_cnt[block] == 1, f"write into shared block {block}"
                # Overlapped steps: the last token may still be "on the device" (sampled by the
                # previous step, not yet appended): the slot remembers whose token it is.
                known = pos < req.num_tokens
                assert known or (pos == req.num_tokens and req.num_pending > 0 and s.sample)
                self.slots[block][pos % self.bs] = req.token_ids[pos] if known else req
                self.pending_writes += not known

    def token_at(self, block: int, pos: int):
        v = self.slots[block][pos % self.bs]
        if isinstance(v, Request):  # a token that was pending when written: known by now
            assert pos < v.num_tokens, f"{v.request_id}: position {pos} read before its token was sampled"
            return v.token_ids[pos]
        return v


def check_invariants(sched: Scheduler, out, overlap: bool) -> None:
    kv, pool = sched.kv, sched.kv.pool
    # The step's own limits.
    assert out.num_batched_tokens == sum(s.num_new_tokens for s in out.seqs)
    assert out.num_batched_tokens <= sched.max_num_batched_tokens
    assert len(sched.running) <= sched.max_num_seqs
    assert len({s.request.request_id for s in out.seqs}) == len(out.seqs)
    # Ref counts = holders among live requests; free queue = exactly the ref-0 blocks.
    holders: Counter[int] = Counter()
    for rid, table in kv.blocks.items():
        assert rid in sched.requests and sched.requests[rid].status == RequestStatus.RUNNING
        assert len(set(table)) == len(table)
        holders.update(table)
    for b in range(pool.num_blocks):
        assert pool.ref_cnt[b] >= 0
        assert pool.ref_cnt[b] == holders[b], f"block {b}"
        assert (pool.ref_cnt[b] == 0) == (b in pool.free_queue), f"block {b}"
    for h, b in pool.cached.items():
        assert pool.block_hash[b] == h
    # Running requests hold enough blocks; waiting ones hold none and restart from 0.
    assert len(sched.running) + sched.num_waiting == len(sched.requests)
    for req in sched.running:
        assert req.status == RequestStatus.RUNNING
        assert req.num_computed_tokens <= req.num_tokens + req.num_pending
        # overlapped: one step in flight (its token) plus the one being read; else none
        assert req.num_pending <= (2 if overlap else 0)
        assert len(kv.block_table(req.request_id)) * kv.block_size >= req.num_computed_tokens
    for _, _, req in sched._waiting:
        assert req.status == RequestStatus.WAITING
        assert req.request_id not in kv.blocks
        assert req.num_computed_tokens == 0
    # The array form of the block tables: one row per holder, its table then zeros; rows of
    # requests gone are free and zeroed (the FakeRunner reads the step's rows of it).
    assert set(kv.table_row) == set(kv.blocks)
    rows = list(kv.table_row.values())
    assert len(set(rows)) == len(rows) and not set(rows) & set(kv._free_rows)
    assert sorted(rows + kv._free_rows) == list(range(len(rows) + len(kv._free_rows)))
    for rid, table in kv.blocks.items():
        row = kv.table[kv.table_row[rid]]
        assert row[: len(table)].tolist() == table and not row[len(table) :].any()
    for r in kv._free_rows:
        assert not kv.table[r].any()


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlapped"])
@pytest.mark.parametrize("ending", ["drain", "abort"])
@pytest.mark.parametrize("policy", ["fcfs", "priority"])
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_random_workload_invariants(seed, policy, ending, overlap):
    """Random arrivals, aborts and preemptions. Overlapped: step N+1 is scheduled and "run" before
    step N's sampled tokens are appended (the engine's async_scheduling order)."""
    rng = random.Random(seed)
    num_blocks, max_model_len = 20, 64  # 80 token slots: preemption is frequent
    kv = KVCacheManager(num_blocks, BS)
    sched = Scheduler(kv, make_policy(policy), max_num_seqs=6, max_num_batched_tokens=24,
                      max_model_len=max_model_len)  # fmt: skip
    runner = FakeRunner(num_blocks, BS)
    prefixes = [[rng.randrange(1000) for _ in range(rng.randrange(5, 22))] for _ in range(3)]
    first_step: dict[str, int] = {}
    arrival_order: list[str] = []
    added: list[Request] = []
    num_added = num_aborted = 0

    in_flight: list = []

    def step(i: int) -> None:
        out = sched.schedule()
        runner.execute(out, kv.pool)
        for s in out.seqs:
            first_step.setdefault(s.request.request_id, i)
        assert not set(out.preempted) & {s.request.request_id for s in out.seqs}
        sampled = {s.request.request_id: rng.randrange(1000) for s in out.seqs if s.sample}
        if not overlap:
            sched.update(out, sampled)
        else:
            sched.on_launched(out)
            if in_flight:
                sched.on_sampled(*in_flight.pop())
            if not out.is_empty:
                in_flight.append((out, sampled))
        check_invariants(sched, out, overlap)

    for i in range(200):
        if num_added < 70 and rng.random() < 0.35:
            if added and rng.random() < 0.2:  # the same prompt again
                prompt = rng.choice(added).prompt_token_ids
            else:
                prompt = rng.choice(prefixes) + [rng.randrange(1000) for _ in range(rng.randrange(1, 14))]
            max_tokens = min(rng.randrange(1, 20), max_model_len - len(prompt))
            rid = f"r{num_added}"
            req = make_req(rid, prompt, max_tokens, rng.randrange(3), arrival=1.0 + num_added)
            sched.add_request(req)
            added.append(req)
            arrival_order.append(rid)
            num_added += 1
        if sched.requests and rng.random() < 0.04:
            rid = rng.choice(sorted(sched.requests))
            assert sched.finish_request(rid, RequestStatus.FINISHED_ABORTED).status.finished
            num_aborted += 1
        step(i)

    if ending == "abort":
        assert sched.running  # something left to abort
        for rid in list(sched.requests):
            sched.finish_request(rid, RequestStatus.FINISHED_ABORTED)
        if in_flight:  # tokens of aborted requests are dropped
            assert sched.on_sampled(*in_flight.pop()) == []
        check_invariants(sched, sched.schedule(), overlap)
    else:
        for i in range(200, 2200):
            if not sched.has_unfinished():
                break
            step(i)
        if in_flight:  # only surplus tokens of requests that ended meanwhile
            assert sched.on_sampled(*in_flight.pop()) == []
    assert not sched.has_unfinished()
    assert not sched.running and sched.num_waiting == 0
    assert kv.pool.num_free == num_blocks
    assert kv.usage() == 0.0
    assert kv.blocks == {}
    assert num_added >= 30 and num_aborted > 0
    assert (runner.pending_writes > 0) == overlap
    assert sched.num_preemptions > 0
    assert kv.prefix_hits > 0
    assert any(r.num_cached_tokens > 0 for r in added)  # first admissions served from the cache
    if policy == "fcfs":  # admission in arrival order, preemptions included
        steps = [first_step[r] for r in arrival_order if r in first_step]
        assert steps == sorted(steps)
