"""Real uvicorn servers on 127.0.0.1 for the API tests (engine + AsyncLLM + app in this process)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

HOST = "127.0.0.1"
MODEL = "tiny"
API_KEY = "secret"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def wait_for_health(base: str, timeout: float, alive=lambda: True) -> None:
    """Poll GET /health until it answers 200 (bounded by `timeout` seconds)."""
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        if not alive():
            raise RuntimeError(f"server at {base} stopped before it became healthy")
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
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
        return openai.OpenAI(base_url=self.v1, api_key=api_key or self.api_key or "x", max_retries=0, timeout=timeout)

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
          **engine_kw) -> Iterator[Server]:  # fmt: skip
    import uvicorn

    from arcserve import EngineArgs
    from arcserve.api.server import build_app
    from arcserve.engine.async_engine import AsyncLLM
    from arcserve.engine.engine import LLMEngine

    kw = {"dtype": "float32", "max_model_len": 256, "num_kv_blocks": 256, **engine_kw}
    engine = LLMEngine(EngineArgs(model=str(model_dir), **kw))
    front = AsyncLLM(engine, max_waiting_requests=max_waiting_requests)
    app = build_app(front, name, api_key=api_key)
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


@pytest.fixture(scope="session")
def server(llama_dir) -> Iterator[Server]:
    """The shared tiny-llama server, no API key, no waiting limit."""
    with serve(llama_dir) as s:
        yield s


@pytest.fixture(scope="session")
def client(server) -> openai.OpenAI:
    return server.client()
