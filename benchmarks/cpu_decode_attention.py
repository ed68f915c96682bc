"""One-token decode attention on the CPU, one sequence, SmolLM2-135M's heads (9 query heads, 3 KV
heads of 64), bf16 model on a CPU without native half products (the float32 decode mirror): the
attention op of a layer as the model calls it (cpu_attention.paged_attention: the mirror append,
then SDPA or the compiled one-row kernel), 30 layers in turn so each layer's rows come back cold.

    python benchmarks/cpu_decode_attention.py [--lengths 40 100 160 500 1000]

Prints us per layer for SDPA and for cpu_compiled.decode_attention at each context length, and
the largest difference between their outputs.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=[40, 100, 160, 500, 1000])
    p.add_argument("--steps", type=int, default=40, help="timed steps of 30 layers per length and path")
    a = p.parse_args()

    from arcserve.kernels import cpu_attention, cpu_compiled, reference
    from arcserve.kernels.reference import AttentionMetadata

    reference.native_half_matmul = lambda dtype: False  # as on an AVX2-only CPU, whatever this one has
    layers, heads, kvh, d, bs, dtype = 30, 9, 3, 64, 16, torch.bfloat16
    nb = -(-max(a.lengths) - a.steps - 4) // bs + 2
    torch.manual_seed(0)
    kc = [torch.randn(nb, bs, kvh, d).to(dtype) for _ in range(layers)]
    vc = [torch.randn(nb, bs, kvh, d).to(dtype) for _ in range(layers)]
    table = torch.arange(nb, dtype=torch.int32)[None]
    print(f"{'context':>8} {'SDPA us/layer':>14} {'compiled us/layer':>18} {'max |diff|':>11}")
    paths = {"sdpa": None, "compiled": cpu_compiled.decode_attention}
    size = cpu_attention.DecodeMirror.largest_bytes(layers, kvh, d, dtype, 1, nb * bs)
    for length in a.lengths:
        # one row of nb * bs positions per path, written up front as the engine's mirror is
        mirrors = {name: cpu_attention.DecodeMirror(layers, kvh, d, dtype, torch.device("cpu"), size, max_rows=1,
                                                    max_len=nb * bs, prefault=True) for name in paths}  # fmt: skip
        took, outs = dict.fromkeys(paths, 0.0), {}
        # Steps alternate between the paths (this VM's speed drifts); the first step, untimed, fills
        # the rows; a pass before the timed ones compiles the kernels the layouts need.
        for timed in (False, True):
            for m in mirrors.values():
                m.reset()
            for step in range(a.steps + 1):
                n = length + step
                g = torch.Generator().manual_seed(step)
                qkv = [torch.randn(layers, 1, h, d, generator=g).to(dtype) for h in (heads, kvh, kvh)]
                for name, one_row in paths.items():
                    meta = AttentionMetadata(
                        query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
                        seq_lens=torch.tensor([n], dtype=torch.int32), block_tables=table,
                        slot_mapping=torch.tensor([n - 1]),
                        host={"query_start_loc": np.array([0, 1]), "seq_lens": np.array([n]),
                              "seq_ids": np.array([0]), "decode_mirror": mirrors[name]},
                    )  # fmt: skip
                    t = time.perf_counter()
                    for i in range(layers):
                        outs[name] = cpu_attention.paged_attention(
                            qkv[0][i], qkv[1][i], qkv[2][i], kc[i], vc[i], meta, 0.125, None, i, one_row
                        )  # fmt: skip
                    if timed and step >= 1:
                        took[name] += time.perf_counter() - t
        per = {name: t / a.steps / layers * 1e6 for name, t in took.items()}
        diff = (outs["sdpa"].float() - outs["compiled"].float()).abs().max().item()
        print(f"{length:>8} {per['sdpa']:>14.1f} {per['compiled']:>18.1f} {diff:>11.2e}", flush=True)


if __name__ == "__main__":
    main()
