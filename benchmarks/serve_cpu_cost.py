"""CPU time the HTTP server process spends per streamed token (any device).

Starts `arcserve serve` (a tiny Qwen3-like model with dummy weights unless --model is given),
drives it with `arcserve bench serve`, and reads the CPU time of the server process (the event
loop: HTTP, SSE chunks, the outputs arriving from the engine process; the engine's own process is
not counted) and of the client from /proc before and after the run. When the server process
saturates a core, streaming latency (TTFT, TPOT) follows its per-token cost, not the device's.

    python benchmarks/serve_cpu_cost.py [--model DIR] [--num-prompts 200 --input-len 128
                                        --output-len 128 --request-rate 16]

Linux only (/proc).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from model_shapes import TINY, write_model_dir  # noqa: E402


def cpu_seconds(pid: int) -> float:
    """utime + stime of the process itself (not its children)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--port", type=int, default=8377)
    p.add_argument("--num-prompts", type=int, default=200)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--request-rate", default="16")
    p.add_argument("--serve-args", default="", help="extra arguments for arcserve serve")
    a = p.parse_args()

    model = a.model or str(write_model_dir(Path(tempfile.mkdtemp()), TINY))
    serve = [sys.executable, "-m", "arcserve.cli", "serve", model, "--load-format", "dummy", "--port", str(a.port),
             "--max-model-len", "4096", "--log-level", "warning", *a.serve_args.split()]  # fmt: skip
    server = subprocess.Popen(serve, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{a.port}"
        for _ in range(600):
            try:
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if server.poll() is not None:
                sys.exit(f"server exited: {server.stderr.read()}")
            time.sleep(0.5)
        out = tempfile.mktemp(suffix=".json")
        vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
        bench = [sys.executable, "-m", "arcserve.cli", "bench", "serve", "--base-url", url,
                 "--num-prompts", str(a.num_prompts), "--input-len", str(a.input_len), "--output-len",
                 str(a.output_len), "--range-ratio", "0", "--request-rate", a.request_rate, "--vocab-size",
                 str(vocab), "--seed", "0", "--save-result", out]  # fmt: skip
        s0 = cpu_seconds(server.pid)
        t0 = time.perf_counter()
        client = subprocess.Popen(bench, stdout=subprocess.PIPE, text=True)
        c_cpu = 0.0
        while client.poll() is None:
            try:
                c_cpu = cpu_seconds(client.pid)
            except FileNotFoundError:
                break
            time.sleep(0.05)
        wall = time.perf_counter() - t0
        s_cpu = cpu_seconds(server.pid) - s0
        report = client.stdout.read()
        r = json.loads(Path(out).read_text())
        tokens = r.get("total_output_tokens") or a.num_prompts * a.output_len
        print(report)
        print(f"server process: {s_cpu:.2f} CPU s over {wall:.1f} s ({s_cpu / wall:.2f} cores), "
              f"{1e6 * s_cpu / tokens:.1f} us per streamed token; client: ~{1e6 * c_cpu / tokens:.1f} us per token")  # fmt: skip
    finally:
        server.terminate()
        server.wait(timeout=60)


if __name__ == "__main__":
    main()
