"""What a fresh process's first requests wait for on the CPU: startup, then one request at a time
decoding alone at growing context lengths (arcserve only).

On CPUs that emulate half products, a lone decoding sequence takes compiled one-token kernels
(arcserve/kernels/cpu_compiled.py); a kernel compiled at its first use holds the request that
needs it. This prints the startup time and each request's wall time, next to its decode speed
(ms per token after the first), so a compile shows up as a request far slower than its neighbours.
Run it twice to see a warm inductor disk cache; delete the cache (`/tmp/torchinductor_$USER`) to
see a machine's first run.

    python benchmarks/cpu_first_steps.py --model ~/.cache/arcserve/models/SmolLM2-135M-Instruct
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--prompts", type=int, nargs="+", default=[32, 32, 100, 240, 500, 1000, 2000],
                    help="prompt lengths, one request each, in this order")  # fmt: skip
    ap.add_argument("--max-tokens", type=int, default=40)
    a = ap.parse_args()

    t0 = time.perf_counter()
    from arcserve import LLM, SamplingParams

    llm = LLM(model=a.model, dtype=a.dtype)
    rows = [{"phase": "startup", "wall_s": round(time.perf_counter() - t0, 2)}]
    print(json.dumps(rows[0]), flush=True)
    rng = np.random.default_rng(0)
    params = SamplingParams(max_tokens=a.max_tokens, ignore_eos=True, temperature=0)
    for n in a.prompts:
        ids = rng.integers(100, 20000, n).tolist()
        t = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
        m = out.metrics
        per_token = (m.finished_time - m.first_token_time) / max(1, len(out.outputs[0].token_ids) - 1) * 1e3
        rows.append({"phase": f"prompt {n}", "wall_s": round(time.perf_counter() - t, 2),
                     "decode_ms_per_token": round(per_token, 2)})  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)


if __name__ == "__main__":
    main()
