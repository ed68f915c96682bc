"""Does the library's product at a new row count block the host until the device drains? Queues
~20 ms of large matrix products, then times the host side of F.linear over a 151,936 x 1,024 LM
head (Qwen3-0.6B's) at row counts that ran before, at new ones, and at those again. The reason
ModelRunner.lm_head_rows pads the LM head's rows to sizes graph capture has run.

    python benchmarks/gpu_new_shape_block.py
"""
import time

import torch
import torch.nn.functional as F

dev = torch.device(torch.accelerator.current_accelerator().type)
w = torch.randn(151936, 1024, device=dev, dtype=torch.bfloat16) * 0.02
a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
warm_rows = [1, 2, 4, 8, 16, 24, 32, 64, 128, 256]
for m in warm_rows:
    F.linear(torch.randn(m, 1024, device=dev, dtype=torch.bfloat16), w)
torch.accelerator.synchronize()


def busy(ms: float) -> None:
    n = max(1, int(ms / 1.4))  # ~1.4 ms per 8192^3 bf16 product
    for _ in range(n):
        a @ a


for label, rows in (("warm", [16, 32, 64, 128, 256, 24]), ("new", [22, 36, 51, 65, 78, 93, 107, 126, 139, 154]),
                    ("new again", [22, 36, 51, 65])):
    for m in rows:
        x = torch.randn(m, 1024, device=dev, dtype=torch.bfloat16)
        torch.accelerator.synchronize()
        busy(20.0)
        t0 = time.perf_counter()
        F.linear(x, w)
        t1 = time.perf_counter()
        torch.accelerator.synchronize()
        t2 = time.perf_counter()
        print(f"{label:9s} rows {m:4d}: F.linear host {1e3 * (t1 - t0):7.2f} ms, then device drained after {1e3 * (t2 - t1):6.2f} ms")
