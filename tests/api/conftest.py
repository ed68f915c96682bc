"""Fixtures of the API tests: the shared tiny-llama server, its openai client, the transformers oracle."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from .helpers import HF, Server, serve


@pytest.fixture(scope="session")
def server(llama_dir) -> Iterator[Server]:
    """The shared tiny-llama server, no API key, no waiting limit."""
    with serve(llama_dir) as s:
        yield s


@pytest.fixture(scope="session")
def client(server) -> openai.OpenAI:
    return server.client()


@pytest.fixture(scope="session")
def hf(llama_dir) -> HF:
    """transformers' view of the tiny llama (oracle for tokens, texts and logprobs)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    return HF(model, AutoTokenizer.from_pretrained(llama_dir))
