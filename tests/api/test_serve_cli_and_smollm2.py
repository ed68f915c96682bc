"""`python -m arcserve.cli serve` in a subprocess answers a completion; the real SmolLM2-135M-Instruct
served over HTTP gives a sensible chat answer."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx
import openai

from .helpers import HOST, free_port, serve, wait_for_health


def test_cli_serve_subprocess(llama_dir, tmp_path):
    port = free_port()
    log = tmp_path / "serve.log"
    cmd = [sys.executable, "-m", "arcserve.cli", "serve", str(llama_dir), "--port", str(port), "--host", HOST,
           "--dtype", "float32", "--max-model-len", "256", "--num-kv-blocks", "256", "--log-level", "warning"]  # fmt: skip
    with open(log, "wb") as out:
        env = {k: v for k, v in os.environ.items() if k != "ARCSERVE_API_KEY"}  # no key required
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        base = f"http://{HOST}:{port}"
        wait_for_health(base, 90, lambda: proc.poll() is None)
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=60)
        name = str(llama_dir)  # --served-model-name defaults to the model argument
        assert [m.id for m in client.models.list().data] == [name]
        r = client.completions.create(model=name, prompt="The quick brown fox", max_tokens=8, temperature=0,
                                      extra_body={"ignore_eos": True})  # fmt: skip
        assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 8
        assert len(r.choices[0].text) > 0
        assert httpx.get(f"{base}/metrics", timeout=10).status_code == 200
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
    text = log.read_text(errors="replace")
    assert proc.returncode == 0 and "Traceback" not in text, (proc.returncode, text)  # graceful SIGTERM


def test_smollm2_chat_answer(smollm2_dir):
    with serve(smollm2_dir, name="SmolLM2-135M-Instruct", max_model_len=512, num_kv_blocks=64) as s:
        client = s.client(timeout=120)
        t0 = time.monotonic()
        r = client.chat.completions.create(
            model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": "What is the capital of France?"}],
            temperature=0, max_tokens=40,
        )  # fmt: skip
        answer = r.choices[0].message.content
        assert "Paris" in answer, answer
        assert r.choices[0].finish_reason == "stop"  # ended by <|im_end|>, not by length
        assert r.usage.completion_tokens < 40 and time.monotonic() - t0 < 60
        # streamed, the same answer
        stream = client.chat.completions.create(
            model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": "What is the capital of France?"}],
            temperature=0, max_tokens=40, stream=True,
        )  # fmt: skip
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == answer
