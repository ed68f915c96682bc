"""Where a GPU step's time goes (Qwen3-0.6B shape, dummy weights, bf16): host time to issue the work
against device time, per piece. Prints profiler tables of a cached-prefix request and of a batch-1
decode forward, cProfile of the cached-prefix request, then the table of pieces.

    python benchmarks/gpu_profile.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from model_shapes import make_shape_dirs  # noqa: E402

from arcserve import LLM, SamplingParams  # noqa: E402
from arcserve.engine.request import Request  # noqa: E402
from arcserve.engine.runner import scratch_meta  # noqa: E402
from arcserve.platform import profiler_activity, synchronize  # noqa: E402


def timed(fn, n: int = 20, dev=None) -> tuple[float, float]:
    """(host ms to issue, ms until the device is done), medians over n runs."""
    fn()
    synchronize(dev)
    host, total = [], []
    for _ in range(n):
        synchronize(dev)
        t = time.perf_counter()
        fn()
        host.append(time.perf_counter() - t)
        synchronize(dev)
        total.append(time.perf_counter() - t)
    return float(np.median(host)) * 1e3, float(np.median(total)) * 1e3


@torch.inference_mode()
def main() -> None:
    d = make_shape_dirs("/tmp/arcserve-shapes")["qwen3-0.6b"]
    llm = LLM(str(d), load_format="dummy", dtype="bfloat16", max_model_len=8192, max_num_batched_tokens=8192)
    eng = llm.llm_engine
    r, m, dev = eng.runner, eng.model, eng.device
    rows = []

    from arcserve.kernels import triton_ops

    x = torch.randn(1, 1024, device=dev, dtype=torch.bfloat16)
    w = torch.ones(1024, device=dev, dtype=torch.bfloat16)
    h, t = timed(lambda: [triton_ops.rms_norm(x, w, 1e-6) for _ in range(100)], 5, dev)
    rows.append(("triton launch (rms_norm 1x1024), per launch", h / 100, t / 100))
    h, t = timed(lambda: [torch.nn.functional.rms_norm(x, (1024,), w, 1e-6) for _ in range(100)], 5, dev)
    rows.append(("torch F.rms_norm 1x1024, per call", h / 100, t / 100))

    for T, lens in (("prefill 2048", [2048]), ("prefill 32 over 4096 cached", None)):
        if lens:
            meta_fn = lambda lens=lens: scratch_meta(lens, 16, dev)  # noqa: E731
            n = sum(lens)
        else:
            n = 32

            def meta_fn():
                meta = scratch_meta([4128], 16, dev)
                qsl = np.array([0, 32])
                meta.host = {"query_start_loc": qsl, "seq_lens": np.array([4128])}
                meta.query_start_loc = torch.tensor([0, 32], dtype=torch.int32, device=dev)
                meta.slot_mapping = meta.slot_mapping[-32:]
                return meta

        ids = torch.randint(0, 100000, (n,), device=dev)
        pos = torch.arange(n, device=dev) + (0 if lens else 4096)
        h, t = timed(lambda ids=ids, pos=pos, meta_fn=meta_fn: m.forward(ids, pos, meta_fn(), r.kv_caches), 10, dev)
        rows.append((f"eager forward, {T}", h, t))

    for b in (1, 64, 256):
        if r.graphs is not None and ("decode", b) in r.graphs.graphs:
            g = r.graphs.graphs[("decode", b)][0]
            h, t = timed(g.replay, 20, dev)
            rows.append((f"decode graph replay, batch {b}", h, t))
            hid = torch.randn(b, 1024, device=dev, dtype=torch.bfloat16)
            h, t = timed(lambda hid=hid: m.logits(hid), 20, dev)
            rows.append((f"logits, {b} rows", h, t))
            logits = torch.randn(b, m.cfg.vocab_size, device=dev)
            for label, kw in (("temp 0.6", {}), ("temp 0.6 + seed", {"seed": 1}), ("top_p 0.9 top_k 50", {"top_p": 0.9, "top_k": 50}), ("greedy", None)):
                sp = SamplingParams(temperature=0, max_tokens=8) if kw is None else SamplingParams(temperature=0.6, max_tokens=8, **kw)
                reqs = [Request(f"r{i}", [1, 2, 3], sp, 8) for i in range(b)]
                if kw and "seed" in kw:
                    for q in reqs:
                        q.seed = 1
                h, t = timed(lambda reqs=reqs, logits=logits: r.sampler(logits, reqs), 20, dev)
                rows.append((f"sampler {label}, {b} rows", h, t))

    # A request whose 4,096-token prefix is cached (gpu_bench.py prefix): the whole call against the
    # replay of the mixed graph its 32 new tokens take (the static inputs still hold that step).
    import random

    rng = random.Random(3)
    sp = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0)
    prefix = [rng.randrange(1000, 150000) for _ in range(4096)]

    def cached_call():  # a new 32-token suffix every time: 4,096 cached tokens, 32 new
        llm.generate({"prompt_token_ids": prefix + [rng.randrange(1000, 150000) for _ in range(32)]}, sp, use_tqdm=False)

    cached_call()  # cold: caches the prefix
    h, t = timed(cached_call, 10, dev)
    rows.append(("generate(), 32 new tokens over a cached 4,096 prefix", h, t))
    key = r.graphs.pick(np.array([32])) if r.graphs is not None else None
    if key is not None:  # the bucket its step takes (the static inputs still hold that step)
        cached_call()
        h, t = timed(r.graphs.graphs[key][0].replay, 20, dev)
        rows.append((f"  its mixed graph replay ({key[1]}-token bucket)", h, t))
        acts = [torch.profiler.ProfilerActivity.CPU, profiler_activity(dev)]
        with torch.profiler.profile(activities=acts) as prof:
            cached_call()
            synchronize(dev)
        print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25, max_name_column_width=60))
        import cProfile
        import pstats

        pr = cProfile.Profile()
        pr.enable()
        for _ in range(5):
            cached_call()
        pr.disable()
        pstats.Stats(pr).sort_stats("tottime").print_stats(20)

    # Device time per kernel of one eager batch-1 decode forward (what a decode graph replays).
    ids = torch.randint(0, 100000, (1,), device=dev)
    pos = torch.tensor([100], device=dev)
    meta = scratch_meta([101], 16, dev)
    meta.host = {"query_start_loc": np.array([0, 1]), "seq_lens": np.array([101])}
    meta.query_start_loc = torch.tensor([0, 1], dtype=torch.int32, device=dev)
    meta.slot_mapping = meta.slot_mapping[-1:]
    m.forward(ids, pos, meta, r.kv_caches)
    synchronize(dev)
    acts = [torch.profiler.ProfilerActivity.CPU, profiler_activity(dev)]
    with torch.profiler.profile(activities=acts) as prof:
        m.forward(ids, pos, meta, r.kv_caches)
        m.logits(torch.randn(1, 1024, device=dev, dtype=torch.bfloat16))
        synchronize(dev)
    print(prof.key_averages().table(sort_by="device_time_total", row_limit=20, max_name_column_width=60))

    print(f"{'piece':55s} {'host ms':>9s} {'total ms':>9s}")
    for name, h, t in rows:
        print(f"{name:55s} {h:9.3f} {t:9.3f}")


if __name__ == "__main__":
    main()
