"""load_tokenizer's short way past AutoConfig gives what AutoTokenizer gives, where it is taken."""

import json
import shutil

import pytest
from tiny_models import CORPUS

from arcserve.models.hf_files import generic_tokenizer_class, load_tokenizer

TEXTS = CORPUS + ["", " leading space", "<s>special</s> inside", "\n\n\t tabs", "ü" * 7]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 🙂"}]


def same_tokenizer(a, b) -> None:
    assert type(a) is type(b)
    assert a.get_vocab() == b.get_vocab()
    assert {k: str(v) for k, v in a.added_tokens_decoder.items()} == {
        k: str(v) for k, v in b.added_tokens_decoder.items()
    }
    assert a.all_special_tokens == b.all_special_tokens
    assert (a.bos_token_id, a.eos_token_id, a.pad_token_id, a.unk_token_id) == (
        b.bos_token_id, b.eos_token_id, b.pad_token_id, b.unk_token_id,
    )  # fmt: skip
    assert a.chat_template == b.chat_template and a.model_max_length == b.model_max_length
    for text in TEXTS:
        for special in (True, False):
            ids = a.encode(text, add_special_tokens=special)
            assert ids == b.encode(text, add_special_tokens=special), text
            assert a.decode(ids) == b.decode(ids) and a.decode(ids, skip_special_tokens=True) == b.decode(
                ids, skip_special_tokens=True
            )
    kw = dict(tokenize=False, add_generation_prompt=True)
    assert a.apply_chat_template(CHAT, **kw) == b.apply_chat_template(CHAT, **kw)


@pytest.mark.parametrize("arch", ["llama", "mistral", "smollm2"])
def test_generic_folders_load_as_auto_tokenizer_does(request, tiny_dirs, arch):
    from transformers import AutoTokenizer

    folder = request.getfixturevalue("smollm2_dir") if arch == "smollm2" else tiny_dirs[arch]
    assert generic_tokenizer_class(str(folder)) is not None  # the short way is taken for these
    same_tokenizer(load_tokenizer(str(folder)), AutoTokenizer.from_pretrained(folder))


def test_folders_the_short_way_leaves_to_auto_tokenizer(tiny_dirs, tmp_path):
    # qwen2: a model type whose declared class transformers overrides with its own (Qwen2Tokenizer)
    assert generic_tokenizer_class(str(tiny_dirs["qwen2"])) is None
    # qwen3: its model type has a tokenizer class of its own
    assert generic_tokenizer_class(str(tiny_dirs["qwen3"])) is None
    folder = tmp_path / "m"
    shutil.copytree(tiny_dirs["llama"], folder)
    cfg_path = folder / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    for change in ({"auto_map": {"AutoTokenizer": [None, "tok.MyTokenizer"]}}, {"tokenizer_class": "LlamaTokenizer"}):
        cfg_path.write_text(json.dumps({**cfg, **change}))
        assert generic_tokenizer_class(str(folder)) is None, change
    cfg_path.write_text(json.dumps(cfg))
    assert generic_tokenizer_class(str(folder)) is not None
    (folder / "tokenizer.json").unlink()  # only the tokenizers library's file makes the generic class
    assert generic_tokenizer_class(str(folder)) is None
    assert generic_tokenizer_class(str(tmp_path / "absent")) is None
    with pytest.raises(ValueError, match="Could not load a tokenizer from"):
        load_tokenizer(str(tmp_path / "absent"))
