"""What decides a CPU's tier (reference.native_half_matmul, docs/ARCHITECTURE.md): SmolLM2-135M's shapes on
this CPU, two threads unless OMP_NUM_THREADS says otherwise.

    python benchmarks/cpu_tier_probe.py products   # 30 layers' four products: bf16 F.linear, oneDNN
                                                   # packed bf16, oneDNN packed float32 (ms)
    python benchmarks/cpu_tier_probe.py mask       # decode SDPA over 64 float32 mirror rows padded to
                                                   # 450 positions: bool vs additive mask, and rows
                                                   # sorted by length in 2 / 4 / 8 calls (ms, 30 layers)
    python benchmarks/cpu_tier_probe.py lengths --model DIR
                                                   # the offline benchmark's decode steps: positions
                                                   # the mirror's SDPA reads over those it needs,
                                                   # padded to the longest row, in the best 2 / 4
                                                   # contiguous groups of rows, 4 groups if sorted

Memory bandwidth first (a float32 sum and a copy over 256 MB), then the part asked for.
"""

from __future__ import annotations

import argparse
import functools

import cpu_ops
import torch
import torch.nn.functional as F

LAYERS = 30
timed = functools.partial(cpu_ops.timed, n=5)  # ms a call
SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}


def bandwidth() -> None:
    x = torch.randn(64 << 20)
    y = torch.empty_like(x)
    print(f"float32 sum {x.numel() * 4 / timed(x.sum) / 1e6:.1f} GB/s, "
          f"copy {2 * x.numel() * 4 / timed(lambda: y.copy_(x)) / 1e6:.1f} GB/s (read + write)")  # fmt: skip


def products() -> None:
    w = {k: [torch.randn(s).bfloat16() for _ in range(LAYERS)] for k, s in SHAPES.items()}
    packed16 = {k: [torch.ops.mkldnn._reorder_linear_weight(x, 64) for x in ws] for k, ws in w.items()}
    packed32 = {k: [torch.ops.mkldnn._reorder_linear_weight(x.float(), 64) for x in ws] for k, ws in w.items()}

    def onednn(x, p):
        return torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")

    kinds = {"bf16 F.linear": lambda x, k, i: F.linear(x, w[k][i]),
             "bf16 oneDNN": lambda x, k, i: onednn(x, packed16[k][i]),
             "f32 oneDNN": lambda x, k, i: onednn(x.float(), packed32[k][i]).bfloat16()}  # fmt: skip
    for rows in (1, 4, 16, 64, 256):
        xs = {k: torch.randn(rows, s[1]).bfloat16() for k, s in SHAPES.items()}
        got = {name: timed(lambda fn=fn, xs=xs: [fn(xs[k], k, i) for i in range(LAYERS) for k in SHAPES])
               for name, fn in kinds.items()}  # fmt: skip
        print(f"{rows:4d} rows: " + ", ".join(f"{n} {t:.2f} ms" for n, t in got.items()))


def mask() -> None:
    n, kvh, g, d, pad = 64, 3, 3, 64, 450
    k = [torch.randn(n, kvh, pad + 64, d) for _ in range(LAYERS)]
    v = [torch.randn(n, kvh, pad + 64, d) for _ in range(LAYERS)]
    q = torch.randn(n, kvh, g, d)
    lens = torch.randint(64, pad + 1, (n,), generator=torch.Generator().manual_seed(0))
    lens[0] = pad
    bool_mask = (torch.arange(pad)[None, :] < lens[:, None])[:, None, None, :]
    float_mask = torch.zeros(bool_mask.shape).masked_fill_(~bool_mask, float("-inf"))

    def one(m):
        return lambda: [F.scaled_dot_product_attention(q, k[i][:, :, :pad], v[i][:, :, :pad], attn_mask=m) for i in range(LAYERS)]

    print(f"bool mask {timed(one(bool_mask)):.1f} ms, additive float mask {timed(one(float_mask)):.1f} ms")
    s = lens.sort().values  # (as if the rows were stored sorted by length: the same data, shorter calls)
    for groups in (2, 4, 8):
        cuts = [n * j // groups for j in range(groups + 1)]

        def run(cuts=cuts):
            for i in range(LAYERS):
                for a, b in zip(cuts, cuts[1:]):
                    m = int(s[b - 1])
                    F.scaled_dot_product_attention(q[a:b], k[i][a:b, :, :m], v[i][a:b, :, :m], attn_mask=float_mask[a:b, ..., :m])

        print(f"rows sorted by length, {groups} calls a layer: {timed(run):.1f} ms")


def padded(lens: list[int], groups: int) -> int:
    """Fewest positions SDPA reads over `lens` cut into at most `groups` contiguous runs, each padded
    to its longest row."""
    n, inf = len(lens), float("inf")
    best = [[inf] * (n + 1) for _ in range(groups + 1)]
    best[0][0] = 0
    for g in range(1, groups + 1):
        for j in range(1, n + 1):
            m = 0
            for i in range(j - 1, -1, -1):
                m = max(m, lens[i])
                best[g][j] = min(best[g][j], best[g - 1][i] + (j - i) * m)
    return int(min(best[g][n] for g in range(1, groups + 1)))


def lengths(model: str) -> None:
    from offline_throughput import workload  # (this script's folder is on the path, as for cpu_ops)

    from arcserve import LLM, SamplingParams
    from arcserve.kernels import cpu_attention

    steps = []
    plan = cpu_attention.DecodeMirror.plan

    def recording(self, *args, **kw):
        got = plan(self, *args, **kw)
        if got is not None:
            steps.append([int(x) for x in self.lens])
        return got

    cpu_attention.DecodeMirror.plan = recording
    llm = LLM(model=model, dtype="bfloat16", max_model_len=2048, seed=0, enforce_eager=True)
    reqs = workload(0, 64, 64, 256, llm.get_tokenizer().vocab_size)
    llm.generate([{"prompt_token_ids": p} for p, _ in reqs],
                 [SamplingParams(temperature=0.6, max_tokens=o, ignore_eos=True) for _, o in reqs], use_tqdm=False)  # fmt: skip
    steps = [s for s in steps if len(s) >= 8]
    need = sum(sum(s) for s in steps)
    print(f"{len(steps)} decode steps of 8 or more rows; positions read over those needed: "
          f"one call {sum(len(s) * max(s) for s in steps) / need:.3f}, "
          f"2 contiguous groups {sum(padded(s, 2) for s in steps) / need:.3f}, "
          f"4 contiguous groups {sum(padded(s, 4) for s in steps) / need:.3f}, "
          f"4 groups of rows sorted by length {sum(padded(sorted(s), 4) for s in steps) / need:.3f}")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["products", "mask", "lengths"])
    p.add_argument("--model", default=None, help="lengths: the model folder (SmolLM2-135M-Instruct)")
    a = p.parse_args()
    print(torch.__version__, "oneDNN bf16:", torch.ops.mkldnn._is_mkldnn_bf16_supported(),
          {k: v for k, v in torch.cpu.get_capabilities().items() if "amx" in k or k == "avx512_bf16"})  # fmt: skip
    bandwidth()
    if a.what == "lengths":
        lengths(a.model)
    else:
        {"products": products, "mask": mask}[a.what]()


if __name__ == "__main__":
    main()
