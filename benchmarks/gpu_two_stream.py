"""Decode forward of a batch as one graph against the same batch in two halves on two streams
(one graph, the halves' kernels free to run side by side): does running a second chain beside the
first hide the per-launch time of the small products? Qwen3-0.6B shape, dummy weights, bf16, context
lengths uniform in [lo, hi] over random blocks. An experiment (arcserve does not split batches).

    PYTHONPATH=. python3 benchmarks/gpu_two_stream.py [--batches 64 128 256] [--parts 2 4]
                                                      [--lo 200 --hi 1600] [--profile DIR/prefix]

--profile also traces five replays of the one-graph forward per batch (kernel time against the
replays' span, the largest kernels). Results: docs/BENCHMARKS.md, H100 section, session 17.
"""

from __future__ import annotations

import argparse
import functools
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from model_shapes import make_shape_dirs  # noqa: E402

from arcserve import LLM  # noqa: E402
from arcserve.engine.step_graphs import StepGraphs  # noqa: E402
from arcserve.platform import (  # noqa: E402
    capture,
    current_stream,
    graph_pool,
    new_graph,
    new_stream,
    on_stream,
    profiler_activity,
    synchronize,
)


def per_stream_counters() -> None:
    """The kernels that merge their programs' work share one counter buffer per device (launches
    one after another on a stream leave it zeroed); kernels on two streams at once need one each."""
    from arcserve.kernels import triton_attention, triton_ops

    bufs = {}

    def counters(n: int, device) -> torch.Tensor:
        key = current_stream(device).stream_id
        if key not in bufs or bufs[key].numel() < n:
            bufs[key] = torch.zeros(max(n, 1 << 16), dtype=torch.int32, device=device)
        return bufs[key]

    triton_ops.zeroed_counters = triton_attention.zeroed_counters = counters


def decode_inputs(ids, positions, slots, seq_lens, tables) -> dict:
    """A decode batch as runner._host_inputs gives it to StepGraphs.stage (every token on the host)."""
    n, none = len(ids), np.zeros(0, dtype=np.int64)
    return {"ids": ids, "positions": positions, "slots": slots, "qsl": np.arange(n + 1), "seq_lens": seq_lens,
            "tables": tables, "feed_dst": none, "feed_src": none}  # fmt: skip


def profile_replay(g, dev, n: int, wall_ms: float, path: str) -> None:
    """Kernels of 5 replays: their summed durations against the replays' span (the rest is gaps
    between kernels), the largest kernels by name."""
    import json

    from torch.profiler import profile

    with profile(activities=[profiler_activity(dev)]) as prof:
        for _ in range(5):
            g.replay()
        synchronize(dev)
    prof.export_chrome_trace(path)
    ev = [e for e in json.load(open(path))["traceEvents"] if e.get("cat") == "kernel"]
    ev.sort(key=lambda e: e["ts"])
    span = (ev[-1]["ts"] + ev[-1]["dur"] - ev[0]["ts"]) / 5
    busy = sum(e["dur"] for e in ev) / 5
    per: dict = {}
    for e in ev:
        k = e["name"][:60]
        d, c = per.get(k, (0.0, 0))
        per[k] = (d + e["dur"] / 5, c + 1)
    gaps = sorted(b["ts"] - (a["ts"] + a["dur"]) for a, b in zip(ev, ev[1:]))
    print(f"  batch {n}: replay {wall_ms:.3f} ms wall; kernels {len(ev) // 5} a replay, span {span / 1e3:.3f} ms, "
          f"busy {busy / 1e3:.3f} ms; gap median {gaps[len(gaps) // 2]:.2f} us")  # fmt: skip
    for k, (d, c) in sorted(per.items(), key=lambda kv: -kv[1][0])[:8]:
        print(f"    {k:60s} {d:8.1f} us  {c // 5:4d} calls  {d / max(1, c // 5):6.2f} us/call")


def timed(g, dev, reps: int = 30) -> float:
    g.replay()
    synchronize(dev)
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        g.replay()
        synchronize(dev)
        ts.append(time.perf_counter() - t)
    return float(np.median(ts)) * 1e3


def graph_of_parts(model, kv, bs: int, pool, side: list, batch: tuple, parts: int, streams: bool):
    """One graph of the batch's decode forward in `parts` parts, one after another on one stream or
    (streams) each on its own stream, forked before the first and joined after the last.
    Returns (graph, each part's output)."""
    dev = model.device
    n = len(batch[0])
    sizes = [n // parts] * parts
    sizes[-1] += n - sum(sizes)
    sgs, metas, lo = [], [], 0
    for s in sizes:
        sg = StepGraphs(model, kv, bs, 4096, s, 256)
        sg.stage(("decode", s), decode_inputs(*(x[lo : lo + s] for x in batch)), None)
        sgs.append(sg)
        metas.append(sg._meta("decode", s))
        lo += s
    for sg, m, s in zip(sgs, metas, sizes):
        sg._forward("decode", s, m)  # warm-up / compile
    synchronize(dev)
    g = new_graph(dev)
    outs = []
    with capture(g, dev, pool):
        main_s = current_stream(dev)
        if streams:  # fork every side stream before the first part is issued
            for j in range(1, parts):
                side[j].wait_stream(main_s)
        for j, (sg, m, s) in enumerate(zip(sgs, metas, sizes)):
            if streams and j:
                with on_stream(side[j]):
                    outs.append(sg._forward("decode", s, m))
            else:
                outs.append(sg._forward("decode", s, m))
        if streams:
            for j in range(1, parts):
                main_s.wait_stream(side[j])
    return g, outs


@torch.inference_mode()
def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batches", type=int, nargs="+", default=[64, 128, 256])
    p.add_argument("--lo", type=int, default=200)
    p.add_argument("--hi", type=int, default=1600)
    p.add_argument("--parts", type=int, nargs="+", default=[2])
    p.add_argument(
        "--profile", default=None, help="write a per-kernel timeline of one-graph replays (json) here"
    )
    a = p.parse_args()
    per_stream_counters()
    d = make_shape_dirs(tempfile.mkdtemp())["qwen3-0.6b"]
    B = max(a.batches)
    llm = LLM(model=str(d), load_format="dummy", dtype="bfloat16", max_model_len=4096, max_num_seqs=B,
              enforce_eager=True, max_num_batched_tokens=256)  # fmt: skip
    runner = llm.llm_engine.runner
    model, kv, bs = runner.model, runner.kv_caches, runner.block_size
    dev = model.device
    nblocks = kv[0][0].shape[0]
    rng = np.random.default_rng(0)
    torch.manual_seed(0)
    for k, v in kv:  # real data, not zeros
        k.normal_()
        v.normal_()
    pool = graph_pool(dev)
    side = [new_stream(dev) for _ in range(max(a.parts))]
    print(
        f"{'batch':>5s} {'parts':>5s} {'one graph ms':>12s} {'parts, one stream':>17s} {'parts, streams':>14s}"
    )
    for n in a.batches:
        ctx = rng.integers(a.lo, a.hi + 1, n)
        nb = -(-ctx // bs)
        assert nb.sum() <= nblocks, (nb.sum(), nblocks)
        perm = rng.permutation(nblocks)[: nb.sum()]
        tables = np.zeros((n, nb.max()), dtype=np.int64)
        for i, off in enumerate(np.cumsum(nb) - nb):
            tables[i, : nb[i]] = perm[off : off + nb[i]]
        pos = ctx - 1
        slots = tables[np.arange(n), pos // bs] * bs + pos % bs
        ids = rng.integers(1000, 150000, n)

        batch = (ids, pos, slots, ctx, tables)
        graph_of = functools.partial(graph_of_parts, model, kv, bs, pool, side, batch)

        g1, (o1,) = graph_of(1, False)
        t1 = timed(g1, dev)
        if a.profile:
            profile_replay(g1, dev, n, t1, f"{a.profile}.{n}.json")
        ref = o1.float().clone()
        for parts in a.parts:
            gs, os_ = graph_of(parts, False)
            ts_ = timed(gs, dev)
            gm, om = graph_of(parts, True)
            tm = timed(gm, dev)
            got_s, got_m = (torch.cat([o.float() for o in outs]) for outs in (os_, om))
            assert torch.equal(got_s, got_m), "same kernels on two streams gave other values"
            err = ((got_s - ref).norm() / ref.norm()).item()  # other split counts: rounding only
            print(
                f"{n:5d} {parts:5d} {t1:12.3f} {ts_:17.3f} {tm:14.3f}   (vs one graph: rel. diff {err:.1e})"
            )
            del gs, gm


if __name__ == "__main__":
    main()
