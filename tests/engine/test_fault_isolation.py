"""A fault inside an engine step fails only the requests of that step (and of the step in flight
beside it): they are aborted with their blocks freed, every other request finishes with exactly
the output it gets alone, and the engine keeps serving new requests."""

from __future__ import annotations

import pytest
from conftest import DEVICE

from arcserve import EngineArgs, LLMEngine, SamplingParams
from arcserve.engine.async_engine import step_isolated
from arcserve.engine.engine import _fault_hook_from_env

FAULT = 7  # the token id whose presence in a prompt makes its step raise (the test hook)


def make_engine(model_dir, overlap: bool) -> LLMEngine:
    return LLMEngine(EngineArgs(model=str(model_dir), dtype="float32", device=DEVICE.type, max_model_len=128,
                                block_size=16, num_kv_blocks=24, max_num_seqs=2, async_scheduling=overlap))  # fmt: skip


def alone(engine: LLMEngine, prompt: list[int], params: SamplingParams) -> list[int]:
    engine.add_request("alone", {"prompt_token_ids": prompt}, params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                return out.outputs[0].token_ids
    raise AssertionError("no output")


@pytest.mark.parametrize("overlap", [False, True])
def test_a_failing_step_fails_only_its_requests(llama_dir, monkeypatch, overlap):
    monkeypatch.setenv("ARCSERVE_FAULT_TOKEN", str(FAULT))
    engine = make_engine(llama_dir, overlap)
    assert engine.fault_hook is not None
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    healthy = {"a": [11, 12, 13, 14], "w1": [21, 22, 23], "w2": [31, 32, 33, 34, 35]}
    expected = {rid: alone(engine, p, params) for rid, p in healthy.items()}

    # max_num_seqs 2: "a" runs; "f" (fault token in its prompt) joins it after a few steps; w1 and
    # w2 wait behind them and are in neither step when it fails
    engine.add_request("a", {"prompt_token_ids": healthy["a"]}, params)
    finished, failed, errors = {}, [], []
    for i in range(300):
        if i == 3:
            engine.add_request("f", {"prompt_token_ids": [40, FAULT, 41]}, params)
            engine.add_request("w1", {"prompt_token_ids": healthy["w1"]}, params)
            engine.add_request("w2", {"prompt_token_ids": healthy["w2"]}, params)
        outs, ids, err = step_isolated(engine)
        failed += ids
        if err is not None:
            errors.append(err)
            # the failed step's requests are gone and hold nothing; the waiting ones are untouched
            assert not any(r.request_id in ("a", "f") for r in engine.scheduler.running)
            assert engine.scheduler.stats().num_waiting == 2
        finished.update({o.request_id: o for o in outs if o.finished})
        if not engine.has_unfinished_requests():
            break
    assert sorted(failed) == ["a", "f"]  # "a" shared the step with "f"
    assert len(errors) == 1 and "injected fault" in str(errors[0])
    assert {rid: o.outputs[0].token_ids for rid, o in finished.items()} == {k: expected[k] for k in ("w1", "w2")}
    st = engine.scheduler.stats()
    assert (st.num_running, st.num_waiting, st.kv_cache_usage) == (0, 0, 0.0)
    # the engine serves on: the same request again gets its output
    assert alone(engine, healthy["a"], params) == expected["a"]


def test_a_failing_scheduler_fails_the_running_requests(llama_dir):
    """If the scheduler itself raises, which running request it touched is unknown: all running
    requests fail, waiting ones stay."""
    engine = make_engine(llama_dir, False)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    want = alone(engine, [51, 52, 53], params)
    for rid in ("r1", "r2", "w"):
        engine.add_request(rid, {"prompt_token_ids": [51, 52, 53]}, params)
    engine.step()  # r1 and r2 run, w waits (max_num_seqs 2)
    real = engine.scheduler.schedule
    calls = []

    def broken():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("scheduler bug")
        return real()

    engine.scheduler.schedule = broken
    outs, ids, err = step_isolated(engine)
    assert (outs, ids, str(err)) == ([], ["r1", "r2"], "scheduler bug")
    got = {}
    while engine.has_unfinished_requests():
        got.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
    assert got == {"w": want}
    assert engine.scheduler.stats().kv_cache_usage == 0.0


def test_outputs_read_before_a_failure_are_delivered(llama_dir):
    """Overlapped steps read the previous step before scheduling the next when penalties need the
    history. If the next step then fails, a request that finished in the step just read still gets
    its final output (it is in neither failing step), and only the other request fails."""
    engine = make_engine(llama_dir, True)
    short = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, presence_penalty=0.5)
    want = alone(engine, [61, 62, 63], short)
    engine.add_request("short", {"prompt_token_ids": [61, 62, 63]}, short)
    long = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    engine.add_request("long", {"prompt_token_ids": [71, 72]}, long)
    short_req = engine.scheduler.requests["short"]

    def hook(sched):
        if short_req.is_finished:
            raise RuntimeError("fault after the read")

    engine.fault_hook = hook
    finals, failed, errors = {}, [], []
    for _ in range(20):
        outs, ids, err = step_isolated(engine)
        finals.update({o.request_id: o.outputs[0].token_ids for o in outs if o.finished})
        failed += ids
        errors += [err] if err is not None else []
        if not engine.has_unfinished_requests():
            break
    assert [str(e) for e in errors] == ["fault after the read"]
    assert finals == {"short": want} and failed == ["long"]
    assert engine.scheduler.stats().kv_cache_usage == 0.0


def test_a_failing_proposer_fails_the_requests_it_drafted_for(llama_dir, monkeypatch):
    """Speculative decoding in synchronous steps: if proposing drafts raises, the requests it
    proposed for fail (not none, which would retry the same failing step forever)."""
    engine = LLMEngine(EngineArgs(model=str(llama_dir), dtype="float32", device=DEVICE.type, max_model_len=128,
                                  num_kv_blocks=24, async_scheduling=False,
                                  speculative_config={"method": "ngram", "num_speculative_tokens": 3}))  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    for rid in ("s1", "s2"):
        engine.add_request(rid, {"prompt_token_ids": [5, 6, 7, 5, 6, 7, 5, 6]}, params)
    engine.step()  # prefill: nothing proposed yet

    def broken(wanted, running):
        raise RuntimeError("proposer bug")

    monkeypatch.setattr(engine.proposer, "propose", broken)
    outs, ids, err = step_isolated(engine)
    assert (ids, str(err)) == (["s1", "s2"], "proposer bug")
    assert not engine.has_unfinished_requests() and engine.scheduler.stats().kv_cache_usage == 0.0


def test_a_fault_that_outlives_its_step_fails_everything_not_forever(llama_dir):
    """A waiting request that breaks the scheduler every time: the first failure blames the running
    requests, then, with none left to blame or three failures in a row, every unfinished request
    fails, so the engine never loops on the same fault; afterwards it serves normally."""
    engine = make_engine(llama_dir, False)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    want = alone(engine, [51, 52, 53], params)
    for rid in ("r1", "r2", "poison"):
        engine.add_request(rid, {"prompt_token_ids": [51, 52, 53]}, params)
    engine.step()  # r1 and r2 run, "poison" waits
    real = engine.scheduler.schedule

    def broken():
        if "poison" in engine.scheduler.requests and engine.scheduler.requests["poison"] not in engine.scheduler.running:
            raise RuntimeError("scheduler bug on poison")
        return real()

    engine.scheduler.schedule = broken
    failed = []
    for _ in range(5):
        outs, ids, err = step_isolated(engine)
        failed += ids
        if not engine.has_unfinished_requests():
            break
    assert sorted(failed) == ["poison", "r1", "r2"]
    assert engine.scheduler.stats().kv_cache_usage == 0.0
    assert alone(engine, [51, 52, 53], params) == want


def test_fault_hook_is_off_unless_asked(monkeypatch):
    monkeypatch.delenv("ARCSERVE_FAULT_TOKEN", raising=False)
    assert _fault_hook_from_env() is None


def test_an_engine_process_that_dies_while_starting_is_reported(llama_dir):
    """The server waits for its engine process to load the model; if that process dies before it
    answers (killed, out of memory), startup fails with a clear error instead of waiting forever."""
    import multiprocessing as mp
    import os
    import signal
    import threading
    import time

    from arcserve.engine.core_process import AsyncLLMProcess

    result: dict = {}

    def start():
        try:
            AsyncLLMProcess(EngineArgs(model=str(llama_dir), dtype="float32", max_model_len=128, num_kv_blocks=16))
            result["started"] = True
        except ValueError as e:
            result["error"] = str(e)

    t = threading.Thread(target=start, daemon=True)
    t.start()
    deadline = time.monotonic() + 30
    child = None
    while child is None and time.monotonic() < deadline:
        child = next((p for p in mp.active_children() if p.name == "arcserve-engine-core"), None)
        time.sleep(0.005)
    assert child is not None
    os.kill(child.pid, signal.SIGKILL)  # before it can have loaded torch and the model
    t.join(timeout=20)
    assert not t.is_alive(), "startup still waits for a dead engine process"
    assert "engine process exited while starting" in result.get("error", ""), result


def test_a_dead_engine_fails_every_stream_opened_before_and_opens_none_after(llama_dir):
    """When the engine dies, every stream already open gets the error (no reader is left waiting:
    streams have no timeout), and a request that comes after is refused before a stream opens."""
    import asyncio

    from arcserve.engine.async_engine import AsyncLLM, EngineDeadError

    front = AsyncLLM(make_engine(llama_dir, False), start=False)  # no engine thread: only what _die does

    async def run():
        params = SamplingParams(max_tokens=4)
        open_ = [front.add_request({"prompt_token_ids": [51, 52]}, params, f"r{i}") for i in range(3)]
        front._die(RuntimeError("device lost"))
        for s in open_:
            with pytest.raises(EngineDeadError, match="device lost"):
                await asyncio.wait_for(s.__anext__(), 5)
        with pytest.raises(EngineDeadError, match="device lost"):
            front.add_request({"prompt_token_ids": [51, 52]}, params, "late")
        assert not front._streams

    asyncio.run(run())

    # The engine dies between a request's first look at it and the opening of its stream (here:
    # while it is admitted): the request is refused, not left on a stream no one fails.
    front = AsyncLLM(make_engine(llama_dir, False), start=False)
    front.admit = lambda n: front._die(RuntimeError("device lost meanwhile"))

    async def run_racing():
        with pytest.raises(EngineDeadError, match="device lost meanwhile"):
            front.add_request({"prompt_token_ids": [51, 52]}, SamplingParams(max_tokens=4), "racing")
        assert not front._streams

    asyncio.run(run_racing())
