"""`python -m arcserve.cli serve` in a subprocess answers a completion; the real SmolLM2-135M-Instruct
served over HTTP gives a sensible chat answer."""

from __future__ import annotations

import ssl
import time

import httpx
import openai
import pytest

from .helpers import cli_server, serve


def test_cli_serve_subprocess(llama_dir, tmp_path):
    log = tmp_path / "serve.log"
    flags = ("--max-model-len", "256", "--num-kv-blocks", "256", "--log-level", "warning")
    with cli_server(llama_dir, log, *flags) as (proc, base):
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=60)
        name = str(llama_dir)  # --served-model-name defaults to the model argument
        assert [m.id for m in client.models.list().data] == [name]
        r = client.completions.create(model=name, prompt="The quick brown fox", max_tokens=8, temperature=0,
                                      extra_body={"ignore_eos": True})  # fmt: skip
        assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 8
        assert len(r.choices[0].text) > 0
        assert httpx.get(f"{base}/metrics", timeout=10).status_code == 200
    text = log.read_text(errors="replace")
    assert proc.returncode == 0 and "Traceback" not in text, (proc.returncode, text)  # graceful SIGTERM


def test_cli_serve_vllm_flags(llama_dir, tmp_path):
    """vLLM's spellings: --model as a flag, several --served-model-name (responses carry the first),
    a readable --max-model-len, an inline --chat-template, --chat-template-content-format, log levels
    in capitals, --enable-chunked-prefill, --no-... forms, --disable-fastapi-docs,
    --enable-request-id-headers, --return-tokens-as-token-ids; its VLLM_API_KEY variable sets the key."""
    from transformers import AutoTokenizer

    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    flags = ("--model", str(llama_dir), "--served-model-name", "main", "alias", "--max-model-len", "0.25K",
             "--num-gpu-blocks-override", "256", "--chat-template", template, "--chat-template-content-format",
             "openai", "--log-level", "WARNING", "--enable-chunked-prefill", "--no-trust-remote-code",
             "--no-enforce-eager", "--disable-uvicorn-access-log", "--disable-fastapi-docs",
             "--enable-request-id-headers", "--return-tokens-as-token-ids")  # fmt: skip
    with cli_server(llama_dir, tmp_path / "serve.log", *flags, env={"VLLM_API_KEY": "vk"}) as (_, base):
        refused = httpx.get(f"{base}/v1/models", headers={"X-Request-Id": "abc"}, timeout=10)
        assert refused.status_code == 401 and refused.headers["x-request-id"] == "abc"
        assert httpx.get(f"{base}/openapi.json", timeout=10).status_code == 404
        assert len(httpx.get(f"{base}/health", timeout=10).headers["x-request-id"]) == 32
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="vk", max_retries=0, timeout=60)
        models = client.models.list().data
        assert [m.id for m in models] == ["main", "alias"] and models[0].model_extra["max_model_len"] == 256
        r = client.chat.completions.create(model="alias", messages=[{"role": "user", "content": "hi there"}],
                                           max_tokens=1, temperature=0)  # fmt: skip
        assert r.model == "main"
        tok = AutoTokenizer.from_pretrained(llama_dir)
        # "openai": the content as parts, a string as one text part
        assert r.usage.prompt_tokens == len(tok.encode(f"<user>{[{'type': 'text', 'text': 'hi there'}]}"))
        parts = [{"type": "text", "text": "hi"}, {"type": "text", "text": "there"}]
        r = client.chat.completions.create(model="main", messages=[{"role": "user", "content": parts}], max_tokens=1)
        assert r.usage.prompt_tokens == len(tok.encode(f"<user>{parts}"))
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="other", prompt="x", max_tokens=1)
        lp = client.completions.create(model="main", prompt="hi", max_tokens=2, logprobs=1).choices[0].logprobs
        assert all(t.startswith("token_id:") for t in lp.tokens)  # --return-tokens-as-token-ids


def test_cli_serve_checks_its_address_before_loading(llama_dir, capsys):
    """A port that is taken fails at once (the socket is bound before the model loads, as vLLM
    does), one out of range when the flags are read."""
    import socket

    from arcserve.cli import main

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        t0 = time.monotonic()
        assert main(["serve", str(llama_dir), "--port", str(taken.getsockname()[1]), "--num-kv-blocks", "4"]) == 2
        assert time.monotonic() - t0 < 5 and "cannot listen on 127.0.0.1:" in capsys.readouterr().err
    for bad in ("70000", "-1"):
        with pytest.raises(SystemExit):
            main(["serve", str(llama_dir), "--port", bad])
        assert "must be a number in [0, 65535]" in capsys.readouterr().err


def test_cli_serve_logging_flags(llama_dir, tmp_path):
    """vLLM's logging flags: the periodic stats line unless --disable-log-stats, each request logged with
    --enable-log-requests (prompt and ids cut to --max-log-len), uvicorn's level apart from ours."""
    env = {"ARCSERVE_LOG_STATS_INTERVAL": "0.2"}
    body = {"prompt": "The quick brown fox", "max_tokens": 4, "temperature": 0}
    for flags in (("--enable-log-requests", "--max-log-len", "5"),
                  ("--disable-log-stats", "--disable-log-requests", "--uvicorn-log-level", "error")):  # fmt: skip
        log = tmp_path / f"serve{len(flags)}.log"
        with cli_server(llama_dir, log, "--max-model-len", "256", "--num-kv-blocks", "64", *flags, env=env) as (_, base):
            assert httpx.post(f"{base}/v1/completions", json={"model": str(llama_dir), **body}, timeout=60).status_code == 200
            time.sleep(0.6)  # a few stats intervals
        text = log.read_text(errors="replace")
        logged = flags[0] == "--enable-log-requests"
        assert ("Avg generation throughput: " in text) == logged, text
        assert ("CPU KV cache usage: " in text) == logged
        assert ("Received request " in text) == logged
        assert ("Application startup complete" in text) == logged  # --uvicorn-log-level error hides uvicorn's INFO lines
        if logged:
            line = next(x for x in text.splitlines() if "Received request " in x)
            assert "prompt: 'The q', " in line and "prompt_token_ids: [" in line and "max_tokens=4" in line
            ids = line.split("prompt_token_ids: [")[1].split("]")[0].split(",")
            assert len(ids) == 5


def test_cli_serve_root_path(llama_dir, tmp_path):
    """--root-path: behind a proxy that serves the API under /llm and strips the prefix, the routes
    answer as usual (open ones open, the others behind the key) and the OpenAPI spec names /llm as the
    server, so clients generated from it call through the proxy (uvicorn's and Starlette's rules)."""
    flags = ("--max-model-len", "256", "--num-kv-blocks", "64", "--log-level", "warning", "--root-path", "/llm",
             "--api-key", "k")  # fmt: skip
    with cli_server(llama_dir, tmp_path / "serve.log", *flags) as (_, base):
        key = {"Authorization": "Bearer k"}
        body = {"prompt": "The quick", "max_tokens": 2}
        assert httpx.get(f"{base}/health", timeout=10).status_code == 200
        assert httpx.get(f"{base}/metrics", timeout=10).status_code == 200
        assert httpx.post(f"{base}/v1/completions", json=body, timeout=10).status_code == 401
        r = httpx.post(f"{base}/v1/completions", json=body, headers=key, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
        spec = httpx.get(f"{base}/openapi.json", timeout=10).json()
        assert spec["servers"] == [{"url": "/llm"}]


def test_cli_serve_https(llama_dir, tmp_path):
    """--ssl-keyfile / --ssl-certfile serve HTTPS (a test CA's certificate for 127.0.0.1); plain HTTP
    is then refused, and one of the two files alone is an error."""
    import trustme

    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    key_file, cert_file, ca_file = tmp_path / "key.pem", tmp_path / "cert.pem", tmp_path / "ca.pem"
    cert.private_key_pem.write_to_path(str(key_file))
    cert.cert_chain_pems[0].write_to_path(str(cert_file))
    ca.cert_pem.write_to_path(str(ca_file))
    flags = ("--max-model-len", "256", "--num-kv-blocks", "64", "--log-level", "warning",
             "--ssl-keyfile", str(key_file), "--ssl-certfile", str(cert_file))  # fmt: skip
    with cli_server(llama_dir, tmp_path / "serve.log", *flags, ca=str(ca_file)) as (_, base):
        assert base.startswith("https://")
        trusting = ssl.create_default_context(cafile=str(ca_file))
        r = httpx.post(f"{base}/v1/completions", json={"prompt": "The quick", "max_tokens": 2}, verify=trusting,
                       timeout=60)  # fmt: skip
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
        with pytest.raises(httpx.HTTPError):
            httpx.get(base.replace("https://", "http://") + "/health", timeout=5)
        with pytest.raises(httpx.ConnectError):  # a client that does not trust the test CA
            httpx.get(f"{base}/health", timeout=5)
    from arcserve.cli import main

    assert main(["serve", str(llama_dir), "--ssl-keyfile", str(key_file)]) == 2  # no certificate


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
