"""In-process A/B of the CPU's compiled one-row decode attention (cpu_compiled.decode_attention)
against SDPA over the decode mirror: one LLM, one request of 32 random prompt tokens decoding
128 greedy tokens per round, the two arms alternating with their order flipped every round (this
VM's speed drifts within minutes). The SDPA arm is the same engine with decode_attention declining
every step (the mirror's general path: index_copy_ appends, SDPA).

    python benchmarks/cpu_attention_ab.py --model ~/.cache/arcserve/models/SmolLM2-135M-Instruct --rounds 8

Prints ms per token of each round and arm, their medians, and whether the greedy tokens agree
(they may not: the two sums round differently, which flips near ties).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--rounds", type=int, default=8)
    a = p.parse_args()

    from arcserve import LLM, SamplingParams
    from arcserve.kernels import cpu_compiled

    compiled = {"on": True}
    kernel = cpu_compiled.decode_attention
    cpu_compiled.decode_attention = lambda *args: kernel(*args) if compiled["on"] else None  # get_ops binds this

    llm = LLM(model=a.model, dtype="bfloat16", seed=0)
    rng = random.Random(0)
    prompt = {"prompt_token_ids": [rng.randrange(100, llm.get_tokenizer().vocab_size - 100) for _ in range(32)]}
    greedy = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    for on in (True, False):  # warm-up (the engine compiled its kernels at startup; this warms the caches)
        compiled["on"] = on
        llm.generate(prompt, greedy, use_tqdm=False)
    took: dict[bool, list[float]] = {True: [], False: []}
    tokens = {}
    for r in range(a.rounds):
        for on in (True, False) if r % 2 == 0 else (False, True):
            compiled["on"] = on
            t = time.perf_counter()
            out = llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0]
            took[on].append((time.perf_counter() - t) / 128 * 1e3)
            tokens[on] = out.token_ids
    for on, name in ((True, "compiled"), (False, "SDPA")):
        rounds = " / ".join(f"{x:.2f}" for x in took[on])
        print(f"{name:>8}: {rounds}  median {statistics.median(took[on]):.2f} ms per token")
    same = sum(x == y for x, y in zip(tokens[True], tokens[False]))
    print(f"greedy tokens equal at {same} of 128 positions")


if __name__ == "__main__":
    main()
