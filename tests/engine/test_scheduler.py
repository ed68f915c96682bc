"""Scheduler behaviour without a model (chunked prefill, mixed batches, limits, preemption by
recompute, policies) and the priority policy end to end through LLM with a tiny model."""

from __future__ import annotations

import random

import pytest

from arcserve.engine.kv_cache import KVCacheManager
from arcserve.engine.policy import FCFSPolicy, PriorityPolicy, SchedulingPolicy, make_policy
from arcserve.engine.request import Request, RequestStatus
from arcserve.engine.scheduler import Scheduler, SchedulerOutput
from arcserve.sampling_params import SamplingParams

BS = 4
_arrival = iter(range(1, 1 << 30))


def make_req(rid: str, tokens: list[int], max_tokens: int = 4, priority: int = 0) -> Request:
    params = SamplingParams(max_tokens=max_tokens)
    params._eos_token_ids = frozenset()  # as LLMEngine.add_request does (no EOS: stop on length)
    return Request(rid, tokens, params, max_tokens, float(next(_arrival)), priority)


def make_sched(policy="fcfs", num_blocks=64, max_num_seqs=8, max_batched=64, max_model_len=128) -> Scheduler:
    return Scheduler(
        KVCacheManager(num_blocks, BS), make_policy(policy), max_num_seqs, max_batched, max_model_len
    )


def step(sched: Scheduler, token: int = 7) -> SchedulerOutput:
    out = sched.schedule()
    sched.update(out, {s.request.request_id: token for s in out.seqs if s.sample})
    return out


def plan(out: SchedulerOutput) -> list[tuple[str, int, int, bool]]:
    return [(s.request.request_id, s.start_pos, s.num_new_tokens, s.sample) for s in out.seqs]


def run_to_end(sched: Scheduler, max_steps: int = 3000) -> tuple[list[str], dict[str, int]]:
    """Step until nothing is left; returns the finish order and each request's first scheduled step."""
    finished, first = [], {}
    for i in range(max_steps):
        if not sched.has_unfinished():
            return finished, first
        out = sched.schedule()
        assert not out.is_empty, "nothing scheduled with requests pending"
        assert out.num_batched_tokens <= sched.max_num_batched_tokens
        assert len(sched.running) <= sched.max_num_seqs
        for s in out.seqs:
            first.setdefault(s.request.request_id, i)
        got = sched.update(out, {s.request.request_id: 7 for s in out.seqs if s.sample})
        finished += [r.request_id for r in got if r.is_finished]
    raise AssertionError(f"not finished after {max_steps} steps: {list(sched.requests)}")


def prompt(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


# ---- chunked prefill and mixed batches --------------------------------------------------------


def test_chunked_prefill():
    sched = make_sched(max_batched=16)
    sched.add_request(make_req("a", prompt(40), max_tokens=2))
    assert plan(step(sched)) == [("a", 0, 16, False)]
    assert plan(step(sched)) == [("a", 16, 16, False)]
    req = sched.requests["a"]
    assert req.num_output_tokens == 0 and req.num_computed_tokens == 32
    assert plan(step(sched)) == [("a", 32, 8, True)]
    assert req.num_output_tokens == 1
    assert plan(step(sched)) == [("a", 40, 1, True)]
    assert req.status == RequestStatus.FINISHED_LENGTH and not sched.has_unfinished()


def test_new_prefill_shares_step_with_decodes():
    sched = make_sched(max_batched=16)
    sched.add_request(make_req("a", prompt(10), max_tokens=8))
    sched.add_request(make_req("b", prompt(5, 100), max_tokens=8))
    assert plan(step(sched)) == [("a", 0, 10, True), ("b", 0, 5, True)]
    sched.add_request(make_req("c", prompt(40, 200)))
    out = step(sched)
    # Both decodes first, then c's chunk fills the rest of the budget.
    assert plan(out) == [("a", 10, 1, True), ("b", 5, 1, True), ("c", 0, 14, False)]
    assert out.num_batched_tokens == 16
    assert plan(step(sched)) == [("a", 11, 1, True), ("b", 6, 1, True), ("c", 14, 14, False)]
    assert plan(step(sched)) == [("a", 12, 1, True), ("b", 7, 1, True), ("c", 28, 12, True)]


def test_decodes_scheduled_before_prefill_chunks():
    sched = make_sched(max_batched=16)
    sched.add_request(make_req("d", prompt(3), max_tokens=8))
    sched.add_request(make_req("p", prompt(40, 100)))
    assert plan(step(sched)) == [("d", 0, 3, True), ("p", 0, 13, False)]
    # Put the request in the middle of its prefill first in the running list: the decode must still
    # go first (else the prefill chunk would take the whole budget and starve it).
    sched.running.reverse()
    assert plan(step(sched)) == [("d", 3, 1, True), ("p", 13, 15, False)]


def test_max_num_seqs():
    sched = make_sched(max_num_seqs=2)
    for i in range(5):
        sched.add_request(make_req(f"r{i}", prompt(5, 10 * i), max_tokens=3))
    out = step(sched)
    assert [s.request.request_id for s in out.seqs] == ["r0", "r1"]
    assert len(sched.running) == 2 and sched.num_waiting == 3
    finished, first = run_to_end(sched)
    assert sorted(finished) == [f"r{i}" for i in range(5)]
    assert first["r2"] > 0 and first["r4"] > first["r2"]


# ---- preemption -------------------------------------------------------------------------------


def test_preemption_fcfs_evicts_latest_and_readmits_with_cache_hits():
    sched = make_sched("fcfs", num_blocks=5)
    kv = sched.kv
    sched.add_request(make_req("a", prompt(4), max_tokens=2))
    sched.add_request(make_req("b", prompt(4, 10), max_tokens=3))
    sched.add_request(make_req("c", prompt(8, 20), max_tokens=3))
    assert plan(step(sched)) == [("a", 0, 4, True), ("b", 0, 4, True), ("c", 0, 8, True)]
    assert kv.pool.num_free == 1
    c = sched.requests["c"]
    c_blocks = list(kv.block_table("c"))

    # Each decode needs a new block; one is free. a takes it, b preempts c (the latest arrival).
    out = step(sched)
    assert out.preempted == ["c"]
    assert plan(out) == [("a", 4, 1, True), ("b", 4, 1, True)]
    assert c.status == RequestStatus.WAITING and c.num_computed_tokens == 0 and c.num_preemptions == 1
    assert "c" not in kv.blocks and sched.num_preemptions == 1
    assert c.output_token_ids == [7]  # its sampled token is kept; it is recomputed, not resampled
    assert kv.block_table("b")[1] == c_blocks[1]  # c's tail block went first ...
    assert kv.pool.block_hash[c_blocks[0]] is not None  # ... its head block is still cached
    assert "a" not in sched.requests  # a finished (max_tokens=2), freeing its blocks

    # Re-admission: c's first block comes from the cache, the rest is recomputed in one chunk.
    out = step(sched)
    assert plan(out) == [("b", 5, 1, True), ("c", 4, 5, True)]
    assert kv.block_table("c")[0] == c_blocks[0]
    assert list(sched.requests) == ["c"]  # b finished (max_tokens=3)
    finished, _ = run_to_end(sched)
    assert finished == ["c"]
    assert c.num_output_tokens == 3 and c.status == RequestStatus.FINISHED_LENGTH
    assert kv.pool.num_free == 5


def test_preemption_priority_evicts_largest_priority_value():
    sched = make_sched("priority", num_blocks=5)
    sched.add_request(make_req("a", prompt(4), max_tokens=4, priority=5))
    step(sched)
    sched.add_request(make_req("b", prompt(4, 10), max_tokens=4, priority=0))
    sched.add_request(make_req("c", prompt(8, 20), max_tokens=4, priority=1))
    assert plan(step(sched)) == [("a", 4, 1, True), ("b", 0, 4, True), ("c", 0, 8, True)]
    assert sched.kv.pool.num_free == 0
    # a (already scheduled this step, no new block needed) is the victim when b needs a block:
    # its chunk is taken back out of the step.
    out = step(sched)
    assert out.preempted == ["a"]
    assert plan(out) == [("b", 4, 1, True), ("c", 8, 1, True)]
    assert out.num_batched_tokens == 2
    a = sched.requests["a"]
    assert a.status == RequestStatus.WAITING and a.num_computed_tokens == 0
    finished, _ = run_to_end(sched)
    assert finished[-1] == "a" and sorted(finished) == ["a", "b", "c"]
    assert a.num_output_tokens == 4


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_no_deadlock_when_demand_exceeds_cache(policy):
    rng = random.Random(7)
    num_blocks, max_model_len = 8, 32  # 32 token slots for ~12 x 30
    sched = make_sched(
        policy, num_blocks=num_blocks, max_num_seqs=4, max_batched=16, max_model_len=max_model_len
    )
    reqs = []
    for i in range(12):
        n = rng.randrange(6, 15)
        req = make_req(f"r{i}", [rng.randrange(1000) for _ in range(n)], max_model_len - n, rng.randrange(3))
        sched.add_request(req)
        reqs.append(req)
    finished, first = run_to_end(sched)
    assert sorted(finished) == sorted(r.request_id for r in reqs)
    assert all(r.status == RequestStatus.FINISHED_LENGTH and r.num_tokens == max_model_len for r in reqs)
    assert sched.num_preemptions > 0
    assert sched.kv.pool.num_free == num_blocks and sched.kv.usage() == 0.0
    key = (lambda r: r.seq_no) if policy == "fcfs" else (lambda r: (r.priority, r.seq_no))
    order = [first[r.request_id] for r in sorted(reqs, key=key)]
    assert order == sorted(order)  # never first-scheduled ahead of an earlier (policy-wise) request


# ---- policies ---------------------------------------------------------------------------------


def test_priority_policy_order_with_one_seq():
    sched = make_sched("priority", max_num_seqs=1)
    for i, prio in enumerate([3, 1, 2, 1, 0]):
        sched.add_request(make_req(f"r{i}", prompt(6, 10 * i), max_tokens=2, priority=prio))
    finished, _ = run_to_end(sched)
    assert finished == ["r4", "r1", "r3", "r2", "r0"]


class ShortestPromptFirst(SchedulingPolicy):
    name = "spf"

    def key(self, req: Request):
        return (req.num_prompt_tokens, req.arrival_time, req.seq_no)


def test_custom_policy():
    policy = ShortestPromptFirst()
    assert make_policy(policy) is policy
    assert isinstance(make_policy("fcfs"), FCFSPolicy) and isinstance(make_policy("priority"), PriorityPolicy)
    with pytest.raises(ValueError, match="scheduling_policy"):
        make_policy("sjf")

    sched = Scheduler(KVCacheManager(64, BS), make_policy(policy), 1, 64, 128)
    for i, n in enumerate([9, 3, 6, 3]):
        sched.add_request(make_req(f"r{i}", prompt(n, 20 * i), max_tokens=2))
    finished, _ = run_to_end(sched)
    assert finished == ["r1", "r3", "r2", "r0"]

    # Its key also picks the victim: the longest prompt is preempted, though it arrived first.
    sched = Scheduler(KVCacheManager(4, BS), policy, 4, 64, 16)
    sched.add_request(make_req("long", prompt(7), max_tokens=4))
    sched.add_request(make_req("short", prompt(4, 50), max_tokens=4))
    step(sched)  # long: 2 blocks, short: 1 block, 1 free
    step(sched)  # short's decode takes the free block
    out = step(sched)  # long's 9th token needs a third block
    assert out.preempted == ["long"]
    assert plan(out) == [("short", 5, 1, True)]  # FCFS would have preempted short instead


POLICY_FILE = """
from arcserve.engine.policy import SchedulingPolicy

class LongestPromptFirst(SchedulingPolicy):
    def __init__(self):
        self.seen = []

    def key(self, req):
        self.seen.append(req.request_id)
        return (-req.num_prompt_tokens, req.seq_no)
"""


def test_policy_from_a_file_or_module(tmp_path):
    """A policy named "FILE.py:Class" or "package.module:Class" (the CLI's --scheduling-policy takes
    the same); what is wrong with it is said before anything runs."""
    f = tmp_path / "lpf.py"
    f.write_text(POLICY_FILE)
    policy = make_policy(f"{f}:LongestPromptFirst")
    assert type(policy).__name__ == "LongestPromptFirst" and make_policy(type(policy)).seen == []
    assert isinstance(make_policy("arcserve.engine.policy:PriorityPolicy"), PriorityPolicy)
    sched = Scheduler(KVCacheManager(64, BS), policy, 1, 64, 128)
    for i, n in enumerate([3, 9, 6]):
        sched.add_request(make_req(f"r{i}", prompt(n, 20 * i), max_tokens=2))
    assert run_to_end(sched)[0] == ["r1", "r2", "r0"]
    (tmp_path / "broken.py").write_text("def key(:\n")
    (tmp_path / "other.py").write_text("class NotAPolicy: pass\n")
    for spec, message in [
        (f"{tmp_path}/nope.py:X", "no file"),
        (f"{tmp_path}/broken.py:X", "loading .*broken.py raised SyntaxError"),
        (f"{f}:Missing", "has no SchedulingPolicy subclass 'Missing' \\(it has LongestPromptFirst\\)"),
        (f"{tmp_path}/other.py:NotAPolicy", "has no SchedulingPolicy subclass 'NotAPolicy'"),
        ("no_such_module_xyz:P", "cannot import no_such_module_xyz"),
        (3, "scheduling_policy must be one of"),
    ]:
        with pytest.raises(ValueError, match=message):
            make_policy(spec)


class _Touchy(SchedulingPolicy):
    """Raises for long prompts; keys of another type for prompts of 7 tokens; fails when asked to
    requeue a preempted request."""

    def key(self, req: Request):
        if req.num_prompt_tokens > 12:
            raise RuntimeError("too long for me")
        if req.num_computed_tokens:
            raise RuntimeError("no second chances")
        return "seven" if req.num_prompt_tokens == 7 else (req.num_prompt_tokens, req.seq_no)


def test_a_failing_policy_refuses_the_request_and_changes_nothing(llama_dir):
    """Researchers' policy code that raises, or gives keys that do not compare with the queue's, refuses
    that request (ValueError naming the policy) and leaves no trace; a policy that fails while
    requeueing a preempted request fails that step's requests, and the engine drains."""
    from arcserve import EngineArgs, LLMEngine

    engine = LLMEngine(EngineArgs(model=str(llama_dir), dtype="float32", scheduling_policy=_Touchy(),
                                  num_kv_blocks=6, block_size=4, max_model_len=24))  # fmt: skip
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    engine.add_request("ok", prompt(5), sp)
    for rid, n, message in [("long", 13, "too long for me"), ("mixed", 7, "TypeError")]:
        with pytest.raises(ValueError, match=f"request_id '{rid}': the scheduling policy \\(_Touchy\\) failed on it.*{message}"):
            engine.add_request(rid, prompt(n, 30), sp)
        assert engine.get_num_unfinished_requests() == 1 and rid not in engine.scheduler.requests
    engine.add_request("long", prompt(9, 40), sp)  # the id is free again
    outs, failed = {}, []
    for _ in range(50):
        if not engine.has_unfinished_requests():
            break
        try:
            outs.update({o.request_id: o for o in engine.step() if o.finished})
        except RuntimeError as e:
            assert "no second chances" in str(e)
            failed += engine.fail_step()[1]
    assert not engine.has_unfinished_requests() and failed  # 6 blocks of 4 cannot hold both: a preemption
    assert engine.scheduler.requests == {} and engine.kv.usage() == 0.0
    assert sorted(set(outs) | set(failed)) == ["long", "ok"]


def test_priority_with_a_custom_policy(llama_dir):
    """priority is taken by any policy but FCFS (a researcher's own reads req.priority)."""
    from arcserve import LLM

    class Mine(PriorityPolicy):
        pass

    llm = LLM(str(llama_dir), dtype="float32", scheduling_policy=Mine(), max_num_seqs=1)
    sp = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": prompt(5, 10 * i)} for i in range(3)], sp, priority=[2, 0, 1],
                        use_tqdm=False)  # fmt: skip
    firsts = [o.metrics.first_token_time for o in outs]
    assert firsts[1] < firsts[2] < firsts[0]
    with pytest.raises(ValueError, match="priority must be an integer"):
        llm.generate("x", sp, priority=["high"], use_tqdm=False)


def test_cli_takes_a_policy_file(llama_dir, tmp_path, capsys):
    from arcserve.cli import main

    f = tmp_path / "lpf.py"
    f.write_text(POLICY_FILE)
    args = ["generate", str(llama_dir), "--prompt", "hi", "--max-tokens", "2", "--dtype", "float32"]
    assert main([*args, "--scheduling-policy", f"{f}:LongestPromptFirst"]) == 0
    capsys.readouterr()
    assert main([*args, "--scheduling-policy", f"{f}:Nope"]) == 2
    assert "has no SchedulingPolicy subclass 'Nope'" in capsys.readouterr().err


# ---- statistics -------------------------------------------------------------------------------


def test_prefix_cache_stats_count_each_admission_once():
    """stats() prefix counters: tokens looked up / found once per admitted request."""
    sched = make_sched()
    p = prompt(9)
    sched.add_request(make_req("a", p, max_tokens=1))
    step(sched)
    sched.add_request(make_req("b", p, max_tokens=1))
    assert plan(step(sched)) == [("b", 8, 1, True)]
    assert sched.requests == {} and sched.num_waiting == 0
    st = sched.stats()
    assert (st.prefix_cache_queries, st.prefix_cache_hits) == (9 + 9, 0 + 8)


# ---- end to end -------------------------------------------------------------------------------


def test_llm_priority_end_to_end(llama_dir):
    from arcserve import LLM

    llm = LLM(str(llama_dir), dtype="float32", scheduling_policy="priority", max_num_seqs=1)
    priority = [2, 0, 3, 1]
    prompts = [{"prompt_token_ids": prompt(5 + i, 10 + 40 * i)} for i in range(4)]
    sp = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    outs = llm.generate(prompts, sp, priority=priority, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == [p["prompt_token_ids"] for p in prompts]
    assert all(o.finished and len(o.outputs[0].token_ids) == 3 for o in outs)
    by_prio = [outs[i].metrics for i in sorted(range(4), key=lambda i: priority[i])]
    firsts = [m.first_token_time for m in by_prio]
    assert None not in firsts and firsts == sorted(firsts) and len(set(firsts)) == 4
    # One sequence at a time: each request finishes before the next (by priority) starts.
    for prev, nxt in zip(by_prio, by_prio[1:]):
        assert prev.finished_time <= nxt.first_scheduled_time
    assert not llm.llm_engine.has_unfinished_requests()
    assert llm.llm_engine.kv.usage() == 0.0
