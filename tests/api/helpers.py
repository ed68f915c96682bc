"""Helpers of the API tests: real uvicorn servers on 127.0.0.1 (engine + AsyncLLM + app in this process),
SSE and Prometheus parsing, and a transformers oracle."""

from __future__ import annotations

import contextlib
import os
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

HOST = "127.0.0.1"
MODEL = "tiny"
API_KEY = "secret"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def wait_for_health(base: str, timeout: float, alive=lambda: True, verify=True) -> None:
    """Poll GET /health until it answers 200 (bounded by `timeout` seconds); verify: httpx's (a CA
    file for HTTPS servers)."""
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        if not alive():
            raise RuntimeError(f"server at {base} stopped before it became healthy")
        try:
            if httpx.get(f"{base}/health", timeout=2, verify=verify).status_code == 200:
                return
        except httpx.HTTPError as e:
            last = e
        time.sleep(0.05)
    raise TimeoutError(f"{base}/health did not answer within {timeout} s ({last!r})")


def parse_metrics(text: str) -> dict[tuple[str, tuple], float]:
    """Prometheus text -> {(sample name, sorted label items): value}."""
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


@dataclass
class Server:
    base: str  # http://127.0.0.1:PORT
    name: str
    engine: object  # LLMEngine
    front: object  # AsyncLLM
    api_key: str | None

    @property
    def v1(self) -> str:
        return f"{self.base}/v1"

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def client(self, api_key: str | None = None, timeout: float = 60) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=self.v1, api_key=api_key or self.api_key or "x", max_retries=0, timeout=timeout
        )

    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def post(self, path: str, timeout: float = 60, **kw) -> httpx.Response:
        headers = {**self.headers(), **kw.pop("headers", {})}
        return httpx.post(f"{self.base}{path}", headers=headers, timeout=timeout, **kw)

    def metrics(self) -> dict[tuple[str, tuple], float]:
        r = httpx.get(f"{self.base}/metrics", timeout=10)
        assert r.status_code == 200
        return parse_metrics(r.text)

    def metric(self, name: str, **labels) -> float:
        labels = {"model_name": self.name, **labels}
        return self.metrics()[(name, tuple(sorted(labels.items())))]

    def wait_idle(self, timeout: float = 10) -> dict:
        """Poll /metrics until no request runs or waits and no KV block is held; returns the last figures."""
        key = (("model_name", self.name),)
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            busy = (m[("arcserve:num_requests_running", key)], m[("arcserve:num_requests_waiting", key)],
                    m[("arcserve:kv_cache_usage_perc", key)])  # fmt: skip
            if busy == (0, 0, 0):
                return m
            if time.monotonic() > deadline:
                raise AssertionError(f"server not idle after {timeout} s: running, waiting, kv = {busy}")
            time.sleep(0.05)


@contextlib.contextmanager
def serve(model_dir, name: str = MODEL, api_key: str | None = None, max_waiting_requests: int | None = None,
          process: bool = False, app_kw: dict | None = None, **engine_kw) -> Iterator[Server]:  # fmt: skip
    """A real uvicorn server on 127.0.0.1 in a thread; the engine in a thread of this process, or in
    its own process (process=True, as `arcserve serve` runs it). app_kw: more build_app options."""
    import uvicorn

    from arcserve import EngineArgs
    from arcserve.api.server import build_app
    from arcserve.engine.async_engine import AsyncLLM
    from arcserve.engine.engine import LLMEngine

    kw = {"dtype": "float32", "max_model_len": 256, "num_kv_blocks": 256, **engine_kw}
    if process:
        from arcserve.engine.core_process import AsyncLLMProcess

        front = AsyncLLMProcess(EngineArgs(model=str(model_dir), **kw), max_waiting_requests, threads=1)
        engine = front.engine
    else:
        engine = LLMEngine(EngineArgs(model=str(model_dir), **kw))
        front = AsyncLLM(engine, max_waiting_requests=max_waiting_requests)
    app = build_app(front, name, api_key=api_key, **(app_kw or {}))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host=HOST, port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, name=f"uvicorn-{port}", daemon=True)
    thread.start()
    try:
        wait_for_health(f"http://{HOST}:{port}", 30, thread.is_alive)
        yield Server(f"http://{HOST}:{port}", name, engine, front, api_key)
    finally:
        server.should_exit = True
        thread.join(timeout=15)
        front.shutdown()
        assert not thread.is_alive(), "uvicorn did not stop"


def sse_lines(lines, limit: int = 10_000) -> list:
    """The JSON payloads of SSE lines up to `data: [DONE]` (which must come)."""
    import json

    out = []
    for line in lines:
        if not line:
            continue
        assert line.startswith("data: "), line
        payload = line[len("data: ") :]
        if payload == "[DONE]":
            return out
        out.append(json.loads(payload))
        assert len(out) < limit, "stream did not end"
    raise AssertionError("stream ended without data: [DONE]")


def sse_data(response: httpx.Response) -> list:
    return sse_lines(response.iter_lines())


@dataclass
class HF:
    model: object
    tok: object

    def greedy(self, ids: list[int], n: int) -> list[int]:
        import torch

        x = torch.tensor([ids])
        with torch.no_grad():
            g = self.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,
                                    pad_token_id=0)  # fmt: skip
        return g[0, len(ids) :].tolist()

    def logprobs(self, ids: list[int], new: list[int]):
        """[len(new), vocab] log-softmax of the model's next-token logits at each generated position."""
        import torch

        x = torch.tensor([ids + new])
        with torch.no_grad():
            logits = self.model(x).logits[0, len(ids) - 1 : len(ids) + len(new) - 1]
        return logits.float().log_softmax(-1)

    def chat_ids(self, messages: list[dict]) -> list[int]:
        """The tiny models' chat template written out by hand (independent of apply_chat_template)."""
        text = "".join(f"<s>{m['role']}\n{m['content']}</s>\n" for m in messages) + "<s>assistant\n"
        return self.tok.encode(text, add_special_tokens=False)


@contextlib.contextmanager
def cli_server(model_dir, log_path, *flags: str, env: dict | None = None,
               ca: str | None = None) -> Iterator[tuple[subprocess.Popen, str]]:  # fmt: skip
    """`python -m arcserve.cli serve MODEL_DIR --host 127.0.0.1 --port P --dtype float32 FLAGS` in its own
    process (no API key from the environment; `env` adds variables), output to log_path. Yields
    (process, base URL) once /health answers (over HTTPS, checked against the CA file `ca`, when
    given); on exit SIGTERM (graceful shutdown), SIGKILL after 20 s."""
    port = free_port()
    cmd = [sys.executable, "-m", "arcserve.cli", "serve", str(model_dir), "--host", HOST, "--port", str(port),
           "--dtype", "float32", *flags]  # fmt: skip
    env = {**{k: v for k, v in os.environ.items() if k not in ("ARCSERVE_API_KEY", "VLLM_API_KEY")}, **(env or {})}
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        base = f"{'https' if ca else 'http'}://{HOST}:{port}"
        wait_for_health(base, 90, lambda: proc.poll() is None, ssl.create_default_context(cafile=ca) if ca else True)
        yield proc, base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
