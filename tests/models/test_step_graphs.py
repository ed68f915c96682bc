"""The captured-graph data path (static buffers, padding tokens and tiles, graph choice) gives the
same greedy tokens as transformers. On a GPU the graphs are real; on the CPU (Triton interpreter)
each "replay" runs the same forward eagerly over the same static buffers, which checks everything
but the capture itself."""

import pytest
import torch
from conftest import ARCHS, DEVICE
from test_oracle import expected, prompts_with_shared_prefix, run  # noqa: F401 F811 (fixture)

from arcserve import LLM
from arcserve.engine.step_graphs import StepGraphs, decode_sizes, mixed_sizes


class EagerReplay:
    def __init__(self, sg: StepGraphs, key, out: torch.Tensor) -> None:
        self.sg, self.key, self.out = sg, key, out
        self.meta = sg._meta(*key)
        self.replays = 0

    def replay(self) -> None:
        self.out.copy_(self.sg._forward(*self.key, self.meta))
        self.replays += 1


def test_graph_sizes():
    assert decode_sizes(256)[:6] == [1, 2, 4, 8, 16, 24] and decode_sizes(256)[-1] == 256
    assert decode_sizes(5) == [1, 2, 4, 5]
    assert mixed_sizes(2048) == [8, 16, 32, 64, 128, 256, 512, 1024, 2048] and mixed_sizes(300) == [8, 16, 32, 64, 128, 256, 300]
    assert mixed_sizes(4096) == [8, 16, 32, 64, 128, 256, 512, 1024, 2048, 3072, 4096]


# On the CPU (Triton's interpreter, ~50 s a case) one case per loop mode, each on another family: the
# loop mode does not depend on the family, nor the family's ops on it; a GPU runs all four.
CASES = [("llama", False), ("qwen3", True)] + ([("llama", True), ("qwen3", False)] if DEVICE.type != "cpu" else [])


@pytest.mark.parametrize("arch,overlap", CASES, ids=[f"{a}-{'overlapped' if o else 'sync'}" for a, o in CASES])
def test_graph_path_matches_transformers(tiny_dirs, expected, arch, overlap):  # noqa: F811
    """Overlapped: each step's graph takes the previous step's sampled tokens on the device."""
    llm = LLM(str(tiny_dirs[arch]), dtype="float32", kernels="triton", device=DEVICE.type, max_num_seqs=6,
              max_num_batched_tokens=300, enable_prefix_caching=False, async_scheduling=overlap)  # fmt: skip
    runner = llm.llm_engine.runner
    if DEVICE.type == "cpu":
        sg = StepGraphs(runner.model, runner.kv_caches, runner.block_size, runner.max_model_len, 6, 300)
        for key in [("decode", b) for b in sg.decode] + [("mixed", t) for t in sg.mixed]:
            out = torch.empty(sg._shape(*key)[0], runner.model.cfg.hidden_size, device=DEVICE)
            sg.graphs[key] = (EagerReplay(sg, key, out), out)
            # a split, where there is one, takes every decode tile but only a mixed step's chunk tiles
            plan = sg.graphs[key][0].meta.cache["triton"]
            chunk_tiles = -(-key[1] // plan["block_q"])
            assert plan["split_tiles"] == (plan["num_tiles"] if key[0] == "decode" else chunk_tiles) <= plan["num_tiles"]
        runner.graphs = sg
        # the LM head over the decode graphs' sizes, as on accelerators (a decode step's extra rows
        # are then the graph's own padding rows, runner._logits)
        runner.lm_head_rows = lambda n: next((b for b in sg.decode if b >= n), n)
    prompts = prompts_with_shared_prefix(ARCHS.index(arch))
    assert run(llm, prompts) == expected[arch]  # 7 prompts, max 6 running: mixed and padded decode steps
    if DEVICE.type == "cpu":
        used = {k for k, (g, _) in runner.graphs.graphs.items() if g.replays}
        assert {k[0] for k in used} == {"decode", "mixed"}
        assert any(k[1] > 1 for k in used if k[0] == "decode")
