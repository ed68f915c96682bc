"""Overlapped steps (async_scheduling): the engine schedules and launches step N+1 before it reads
step N's sampled tokens, which reach step N+1 on the device. The outputs must be those of the
synchronous loop for every kind of request (greedy, seeded sampling, n > 1, stop strings and token
ids, min_tokens, logprobs, prompt logprobs, penalties, bad words, max_tokens 1), under chunked prefill,
preemption, prefix-cache hits and aborts, and no KV block may leak."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE

from arcserve import EngineArgs, LLMEngine, SamplingParams


def make_engine(model_dir, overlap: bool, **kw) -> LLMEngine:
    args = dict(model=str(model_dir), dtype="float32", device=DEVICE.type, max_model_len=128, block_size=16,
                num_kv_blocks=12, max_num_seqs=6, max_num_batched_tokens=32, async_scheduling=overlap)  # fmt: skip
    args.update(kw)
    return LLMEngine(EngineArgs(**args))


def prompts(tok) -> list[list[int]]:
    shared = tok.encode("The history of the quick brown fox who jumped over the lazy dog, told twice")
    texts = ["Paris is", "def add(a, b):", "Once upon a time", "1, 2, 3, 4,", "The quick", "Hello there"]
    return [tok.encode(t) for t in texts] + [shared + tok.encode(t) for t in (" again", " once more")]


def drive(engine: LLMEngine, script: dict[int, list], aborts: dict[int, list[str]]) -> dict:
    """Add requests and abort them at given step numbers; returns the finished outputs by id."""
    done, step = {}, 0
    while step <= max(script) or engine.has_unfinished_requests():
        for rid, prompt, params in script.get(step, []):
            engine.add_request(rid, {"prompt_token_ids": prompt}, params)
        for rid in aborts.get(step, []):
            engine.abort_request(rid)
        for out in engine.step():
            if out.finished:
                assert out.request_id not in done
                done[out.request_id] = out
        step += 1
        assert step < 2000
    return done


def summary(out) -> list:
    rows = []
    for c in out.outputs:
        lps = None if c.logprobs is None else [{t: round(e.logprob, 4) for t, e in d.items()} for d in c.logprobs]
        rows.append((c.index, c.token_ids, c.text, c.finish_reason, c.stop_reason, lps))
    plp = None if out.prompt_logprobs is None else [
        None if d is None else {t: round(e.logprob, 4) for t, e in d.items()} for d in out.prompt_logprobs
    ]  # fmt: skip
    return [rows, plp, out.num_cached_tokens > 0]


@pytest.fixture(scope="module")
def workload(llama_dir):
    """A script of requests whose stops are taken from a plain greedy run, so they do fire."""
    ref = make_engine(llama_dir, False, num_kv_blocks=64)
    tok = ref.tokenizer
    ps = prompts(tok)
    base = drive(ref, {0: [("g", ps[2], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))]}, {})
    g = base["g"].outputs[0]
    stop_str, stop_tok = g.text[len(g.text) // 3 : len(g.text) // 3 + 4], g.token_ids[12]
    assert stop_str.strip() and g.token_ids.index(stop_tok) > 4
    greedy = dict(temperature=0, ignore_eos=True)
    script = {
        0: [
            ("greedy", ps[0], SamplingParams(max_tokens=30, **greedy)),
            ("topp", ps[1], SamplingParams(temperature=0.8, top_p=0.9, seed=1, max_tokens=25, ignore_eos=True)),
            ("n2", ps[3], SamplingParams(n=2, temperature=1.0, top_k=20, seed=2, max_tokens=15, ignore_eos=True)),
        ],
        1: [
            ("stopstr", ps[2], SamplingParams(stop=[stop_str], max_tokens=40, **greedy)),
            ("stoptok", ps[2], SamplingParams(stop_token_ids=[stop_tok], max_tokens=40, **greedy)),
            ("one", ps[4], SamplingParams(max_tokens=1, **greedy)),
        ],
        3: [
            ("logprobs", ps[5], SamplingParams(logprobs=3, prompt_logprobs=2, max_tokens=10, **greedy)),
            ("penalty", ps[0], SamplingParams(temperature=0.7, presence_penalty=0.5, repetition_penalty=1.3,
                                              frequency_penalty=0.2, seed=3, max_tokens=20, ignore_eos=True)),
            ("minp", ps[1], SamplingParams(temperature=1.2, min_p=0.05, seed=4, max_tokens=20, min_tokens=15,
                                           stop_token_ids=[stop_tok, g.token_ids[3]])),
        ],
        6: [
            ("shared1", ps[6], SamplingParams(max_tokens=12, **greedy)),
            ("aborted", ps[4], SamplingParams(max_tokens=40, repetition_penalty=1.2, **greedy)),
            # penalized, ended by a stop string (one step late when steps overlap)
            ("penstop", ps[3], SamplingParams(stop=["e", " "], max_tokens=40, presence_penalty=0.8, **greedy)),
        ],
        9: [
            ("shared2", ps[7], SamplingParams(max_tokens=12, **greedy)),
            # a bad word of several tokens: its rows read the output so far on the host
            ("badword", ps[2], SamplingParams(bad_words=[tok.decode(g.token_ids[6:9])], max_tokens=16, **greedy)),
        ],
    }
    return script, {12: ["aborted"]}, (stop_str, stop_tok)


def trace(engine: LLMEngine) -> list[tuple[str, int]]:
    """Log ("launch", k, penalized, history), ("sample", k) (a sampling issued after its launch) and
    ("read", k) events of the engine's steps. penalized: a row samples for a penalized request;
    history: for a request with a bad word of several tokens."""
    events: list[tuple[str, int]] = []
    launch, finish, sample = engine.runner.launch, engine._finish, engine.runner.sample
    counter = iter(range(10**6))

    def traced_launch(out, **kw):
        handle = launch(out, **kw)
        handle.step_no = next(counter)
        rows = [s.request.params for s in out.seqs if s.sample]
        penalized = any(p.needs_penalties for p in rows)
        history = any(len(w) > 1 for p in rows for w in p._bad_words_token_ids)
        events.append(("launch", handle.step_no, penalized, history))
        return handle

    def traced_sample(handle):
        if hasattr(handle, "step_no"):  # (a sampling issued by launch itself comes before its number)
            events.append(("sample", handle.step_no))
        return sample(handle)

    def traced_finish(handle):
        events.append(("read", handle.step_no))
        return finish(handle)

    engine.runner.launch, engine.runner.sample, engine._finish = traced_launch, traced_sample, traced_finish
    return events


def test_overlapped_steps_give_the_synchronous_outputs(llama_dir, workload):
    script, aborts, (stop_str, stop_tok) = workload
    results, events = {}, {}
    for overlap in (False, True):
        engine = make_engine(llama_dir, overlap)
        assert engine.async_scheduling is overlap
        events[overlap] = trace(engine)
        done = drive(engine, script, aborts)
        assert "aborted" not in done
        # Nothing leaks: every request ended, every block is free (cached prefixes stay, unreferenced).
        assert not engine.scheduler.requests and not engine.outputs.groups
        assert engine.scheduler.kv.usage() == 0.0 and engine.scheduler.kv.blocks == {}
        assert engine.scheduler.num_preemptions > 0  # the small cache forced some
        results[overlap] = {rid: summary(o) for rid, o in done.items()}
    sync, overlapped = results[False], results[True]
    assert sorted(sync) == sorted(overlapped)
    for rid in sync:
        assert overlapped[rid] == sync[rid], rid
    # The stops fired (not the length limit) and the stop string was trimmed.
    assert sync["stopstr"][0][0][3:5] == ("stop", stop_str) and stop_str not in sync["stopstr"][0][0][2]
    assert sync["stoptok"][0][0][3:5] == ("stop", stop_tok)
    assert len(sync["one"][0][0][1]) == 1 and len(sync["minp"][0][0][1]) >= 15
    assert sync["shared2"][2]  # a prefix-cache hit
    assert sync["penstop"][0][0][3] == "stop" and len(sync["penstop"][0][0][1]) > 1

    # Synchronous: every step is read before the next is launched. Overlapped: step k+1 launches
    # before step k is read; a step that samples for a request with a bad word of several tokens
    # (it needs the output so far on the host) issues its sampling only after step k is read, the
    # others at launch, penalized ones included (their counts are kept on the device).
    def order(ev):
        at = {(e[0], e[1]): i for i, e in enumerate(ev)}
        penalized = {e[1] for e in ev if e[0] == "launch" and e[2]}
        history = {e[1] for e in ev if e[0] == "launch" and e[3]}
        n = sum(1 for e in ev if e[0] == "launch")
        early = [k for k in range(n - 1) if at[("launch", k + 1)] < at[("read", k)]]
        late = {e[1] for e in ev if e[0] == "sample"}
        assert all(at[("read", k - 1)] < at[("sample", k)] < at[("read", k)] for k in late)
        return n, early, penalized, history, late

    n, early, _, _, late = order(events[False])
    assert early == [] and n > 20 and not late
    n, early, penalized, history, late = order(events[True])
    assert early == list(range(n - 1)) and history and late == history - {0}
    assert len(penalized - history) > 5 and not (penalized - history) & late


def test_overlapped_seeded_sampling_matches_alone(llama_dir):
    """A seeded request samples the same tokens alone, in a batch, overlapped or not."""
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=123, max_tokens=24, ignore_eos=True)
    outs = []
    for overlap, mates in ((False, 0), (True, 0), (True, 4), (False, 4)):
        engine = make_engine(llama_dir, overlap, num_kv_blocks=64)
        script = {0: [("s", [5, 6, 7, 8], params)]}
        script[1] = [(f"m{i}", [9 + i, 3], SamplingParams(temperature=1.0, max_tokens=30)) for i in range(mates)]
        outs.append(drive(engine, script, {})["s"].outputs[0].token_ids)
    assert len(set(outs[0])) > 5 and all(o == outs[0] for o in outs)


def test_overlapped_engine_is_reusable_after_idle(llama_dir):
    """A stop found one step late leaves a surplus step in flight; the next requests start cleanly.
    The stop tokens come from a plain greedy run, so each request does end on them."""
    engine = make_engine(llama_dir, True, num_kv_blocks=64)
    ref = make_engine(llama_dir, False, num_kv_blocks=64)
    for round_ in range(3):
        prompt = [4 + round_, 5, 6]
        base = drive(ref, {0: [("b", prompt, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))]}, {})
        toks = base["b"].outputs[0].token_ids
        stop = next(t for t in toks[4:] if toks.index(t) >= 4)  # first seen after a few steps
        params = SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop], ignore_eos=True)
        script = {0: [(f"r{round_}", prompt, params)]}
        got = drive(engine, script, {})[f"r{round_}"].outputs[0]
        want = drive(ref, script, {})[f"r{round_}"].outputs[0]
        assert got.token_ids == want.token_ids and got.finish_reason == want.finish_reason == "stop"
        assert engine._in_flight is not None  # the surplus step, launched before the stop was read
        assert engine.scheduler.kv.usage() == 0.0


def test_async_scheduling_default_follows_the_device(llama_dir):
    engine = LLMEngine(EngineArgs(model=str(llama_dir), dtype="float32", device=DEVICE.type, max_model_len=64))
    assert engine.async_scheduling is (DEVICE.type != "cpu")
    assert torch.device(DEVICE.type) == engine.device


@pytest.mark.parametrize("new_plp", [1, None])
def test_reused_id_while_its_step_is_in_flight(llama_dir, new_plp):
    """A request aborted while its prompt chunk is in flight, and a new request under the same id:
    the in-flight step's prompt logprobs belong to the old request, never to the new one (they
    landed on it, or crashed the step when it asked for none)."""
    engine = make_engine(llama_dir, True, num_kv_blocks=64, max_num_batched_tokens=8)
    ref = make_engine(llama_dir, False, num_kv_blocks=64)
    old, new = list(range(5, 45)), [7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29]
    engine.add_request("x", {"prompt_token_ids": old}, SamplingParams(max_tokens=3, prompt_logprobs=1, temperature=0))
    engine.step()  # its first chunk launched, still in flight
    assert engine._in_flight is not None
    engine.abort_request("x")
    params = SamplingParams(max_tokens=3, prompt_logprobs=new_plp, temperature=0)
    got = drive(engine, {0: [("x", new, params)]}, {})["x"]
    want = drive(ref, {0: [("x", new, params)]}, {})["x"]
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    if new_plp is None:
        assert got.prompt_logprobs is None
    else:
        assert len(got.prompt_logprobs) == len(new) and got.prompt_logprobs[0] is None
        assert all(t in e for e, t in zip(got.prompt_logprobs[1:], new[1:]))  # the new prompt's tokens
        # (the same entries; values to float32 rounding: 8-token chunks against the whole prompt sum
        # in another order, and on an AVX-512 EPYC one entry's fourth decimal differed)
        for g, w in zip(got.prompt_logprobs[1:], want.prompt_logprobs[1:]):
            assert g.keys() == w.keys() and all(abs(g[t].logprob - w[t].logprob) < 1e-3 for t in g)
    assert engine.scheduler.kv.usage() == 0.0


def test_lm_head_rows_pad_to_the_decode_graph_sizes_on_accelerators():
    """Accelerators run the LM head over the next decode-graph batch size (whose library products
    graph capture has run, see ModelRunner.lm_head_rows); the CPU over exactly the sampled rows."""
    from arcserve.engine.runner import ModelRunner

    runner = ModelRunner.__new__(ModelRunner)  # only the two fields lm_head_rows reads
    runner.max_num_seqs = 256
    runner.device = torch.device("cuda")
    got = {n: runner.lm_head_rows(n) for n in (1, 2, 3, 5, 9, 16, 17, 100, 249, 256, 257, 300)}
    assert got == {1: 1, 2: 2, 3: 4, 5: 8, 9: 16, 16: 16, 17: 24, 100: 104, 249: 256, 256: 256, 257: 320, 300: 320}
    runner.device = torch.device("cpu")
    assert [runner.lm_head_rows(n) for n in (1, 3, 100, 300)] == [1, 3, 100, 300]


def test_padded_lm_head_rows_leave_every_output_unchanged(llama_dir, workload, monkeypatch):
    """Logits over padded rows (copies of the last one), the first n kept: the same outputs for
    every kind of request, in decode steps (no gather) and in mixed ones (gathered rows)."""
    script, aborts, _ = workload
    results = {}
    for pad in (0, 3):
        engine = make_engine(llama_dir, True)
        padded = []
        monkeypatch.setattr(engine.runner, "lm_head_rows", lambda n, pad=pad, asked=padded: asked.append(n) or n + pad)
        results[pad] = {rid: summary(o) for rid, o in drive(engine, script, aborts).items()}
        assert padded  # the runner asked for every step
    assert results[3] == results[0]
