"""Streamed outputs that arrive while the previous one is unread are joined (async_engine.OutputQueue),
and the engine thread wakes the event loop once per step for all streams: a consumer that falls
behind reads fewer, longer deltas that add up to exactly what it would have read one by one."""

from __future__ import annotations

import asyncio

import pytest

from arcserve import EngineArgs, SamplingParams
from arcserve.engine.async_engine import AsyncLLM, OutputQueue, _put_all, join_deltas
from arcserve.engine.engine import LLMEngine
from arcserve.outputs import CompletionOutput, Logprob, RequestOutput


def delta(index_tokens: dict, finished=False, prompt_logprobs=None, extra=None) -> RequestOutput:
    outs = [
        CompletionOutput(index=i, text="".join(f"<{t}>" for t in toks), token_ids=list(toks),
                         cumulative_logprob=-float(sum(toks)), logprobs=[{t: Logprob(-1.0, 1)} for t in toks],
                         finish_reason="length" if finished else None)  # fmt: skip
        for i, toks in index_tokens.items()
    ]
    return RequestOutput("r", "p", [1, 2], outs, finished, prompt_logprobs=prompt_logprobs, extra=extra or {})


def test_join_deltas_concatenates_per_sequence_and_keeps_the_later_state():
    a = delta({0: [5, 6], 1: [9]}, prompt_logprobs=[None, {2: Logprob(-0.5, 1)}], extra={"x": 1})
    b = delta({1: [10, 11], 0: [7]}, finished=True, extra={"y": 2})
    j = join_deltas(a, b)
    assert [o.index for o in j.outputs] == [0, 1]
    assert j.outputs[0].token_ids == [5, 6, 7] and j.outputs[0].text == "<5><6><7>"
    assert j.outputs[1].token_ids == [9, 10, 11] and j.outputs[1].text == "<9><10><11>"
    assert [list(d) for d in j.outputs[1].logprobs] == [[9], [10], [11]]
    assert j.outputs[0].cumulative_logprob == -7.0 and j.outputs[0].finish_reason == "length"
    assert j.finished and j.prompt_logprobs == a.prompt_logprobs and j.extra == {"x": 1, "y": 2}
    # a sequence only in the earlier delta stays; one only in the later comes in
    j2 = join_deltas(delta({0: [1]}), delta({1: [2]}))
    assert [(o.index, o.token_ids) for o in j2.outputs] == [(0, [1]), (1, [2])]
    # the inputs are left as they were
    assert a.outputs[0].token_ids == [5, 6] and b.outputs[0].token_ids == [10, 11]


def test_output_queue_joins_unread_deltas_only():
    async def run():
        q = OutputQueue(deltas=True)
        for toks in ([1], [2], [3]):
            q.put_nowait(delta({0: toks}))
        assert q.qsize() == 1
        assert (await q.get()).outputs[0].token_ids == [1, 2, 3]
        q.put_nowait(delta({0: [4]}))
        err = RuntimeError("x")
        q.put_nowait(err)  # an error is never joined, nor is what follows it joined into it
        q.put_nowait(delta({0: [5]}))
        assert [q.get_nowait() for _ in range(3)][1] is err
        final = OutputQueue(deltas=False)  # outputs that are not deltas stay apart
        final.put_nowait(delta({0: [1]}))
        final.put_nowait(delta({0: [2]}))
        assert final.qsize() == 2

    asyncio.run(run())


def test_a_put_that_fails_fails_only_its_stream():
    """A step's outputs go to their queues in one callback: one that cannot be queued turns into an
    error for its own stream, and the other streams still get theirs."""

    async def run():
        bad, good = OutputQueue(deltas=True), OutputQueue(deltas=True)
        bad.put_nowait(delta({0: [1]}))
        broken = delta({0: [2]})
        broken.outputs = None  # join_deltas cannot read it
        _put_all([(bad, broken), (good, delta({0: [3]}))])
        assert good.get_nowait().outputs[0].token_ids == [3]
        assert bad.get_nowait().outputs[0].token_ids == [1]
        assert isinstance(bad.get_nowait(), TypeError) and bad.empty()

    asyncio.run(run())


@pytest.mark.parametrize("n", [1, 2])
def test_a_late_reader_gets_joined_deltas_equal_to_the_final_output(llama_dir, n):
    """The engine runs ahead while the caller does not read: the stream's deltas, joined, equal the
    non-streamed output of the same seeded request (tokens, text, logprobs, finish)."""
    engine = LLMEngine(EngineArgs(model=str(llama_dir), dtype="float32", max_model_len=256, num_kv_blocks=64))
    front = AsyncLLM(engine)
    params = SamplingParams(n=n, max_tokens=24, temperature=0.8, seed=7, logprobs=2, ignore_eos=True)

    async def run():
        final = [o async for o in front.generate("the quick brown fox", params, "final", stream=False)][-1]
        s = front.add_request("the quick brown fox", params, "late", stream=True)
        while not s.q.qsize() or not s.q._queue[-1].finished:  # let every step land unread
            await asyncio.sleep(0.01)
        chunks = [o async for o in s]
        return final, chunks

    try:
        final, chunks = asyncio.run(run())
    finally:
        front.shutdown()
    assert len(chunks) == 1 and chunks[0].finished
    got = {o.index: o for o in chunks[0].outputs}
    for o in final.outputs:
        g = got[o.index]
        assert g.token_ids == o.token_ids and len(o.token_ids) == 24
        assert g.text == o.text and g.finish_reason == o.finish_reason == "length"
        assert [sorted(d) for d in g.logprobs] == [sorted(d) for d in o.logprobs]
