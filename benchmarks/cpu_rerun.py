"""The offline benchmark's workload several times in one process (one `LLM`), by seed: does a run go
faster once the process is warm? A seed run again hits the prefix cache with every prompt (all
but each prompt's last token), so compare runs of different seeds, or pass
--no-prefix-caching.

    python benchmarks/cpu_rerun.py --model ~/.cache/arcserve/models/SmolLM2-135M-Instruct --seeds 0 1 0 2
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from offline_throughput import workload, workload_args  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    workload_args(p)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 0], help="one run per seed, in this order")
    p.add_argument("--no-prefix-caching", action="store_true")
    a = p.parse_args()

    from arcserve import LLM, SamplingParams

    llm = LLM(model=a.model, dtype=a.dtype, max_model_len=a.max_model_len, seed=0,
              enable_prefix_caching=not a.no_prefix_caching)  # fmt: skip
    vocab = llm.get_tokenizer().vocab_size

    def params(olen: int) -> SamplingParams:
        return SamplingParams(temperature=0.6, max_tokens=olen, ignore_eos=True)

    first = workload(a.seeds[0], a.num_requests, a.min_len, a.max_len, vocab)  # offline_throughput's warm-up
    llm.generate([{"prompt_token_ids": q} for q, _ in first[:4]], [params(16)] * 4, use_tqdm=False)
    for seed in a.seeds:
        reqs = workload(seed, a.num_requests, a.min_len, a.max_len, vocab)
        t = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": q} for q, _ in reqs], [params(o) for _, o in reqs], use_tqdm=False)
        took = time.perf_counter() - t
        n = sum(len(o.outputs[0].token_ids) for o in outs)
        print(f"seed {seed}: {took:.2f} s, {n} output tokens, {n / took:.1f} out tok/s", flush=True)


if __name__ == "__main__":
    main()
