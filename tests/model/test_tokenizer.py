"""load_tokenizer(): the embedded models' tokenizer loaded by its class equals AutoTokenizer's;
every other directory goes through AutoTokenizer."""

import shutil

import pytest
import transformers
from transformers import AutoTokenizer

from workbench.model.loader import EMBEDDED_MODELS, resolve_model_path
from workbench.model import tokenizer as tokenizer_module
from workbench.model.tokenizer import load_tokenizer

TEXTS = ["ROMEO:\nBut soft, what light", "<|bos|>x<|eos|> y", "", "  spaced\t\ttabs  \n\n", "ünïcödé ✓"]


@pytest.mark.parametrize("name", EMBEDDED_MODELS)
def test_an_embedded_tokenizer_equals_autotokenizers(name):
    path = resolve_model_path(name)
    ours, auto = load_tokenizer(path), AutoTokenizer.from_pretrained(str(path))
    assert type(ours) is type(auto)
    assert {k: str(v) for k, v in vars(ours).items()} == {k: str(v) for k, v in vars(auto).items()}
    assert ours.init_kwargs == auto.init_kwargs and ours.chat_template == auto.chat_template
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == (auto.bos_token_id, auto.eos_token_id,
                                                                        auto.pad_token_id)
    assert ours.all_special_ids == auto.all_special_ids and ours.get_vocab() == auto.get_vocab()
    for text in TEXTS:
        ids = ours(text).input_ids
        assert ids == auto(text).input_ids
        assert ours.decode(ids) == auto.decode(ids)
        assert ours.decode(ids, skip_special_tokens=True) == auto.decode(ids, skip_special_tokens=True)
    chat = [{"role": "user", "content": "Wherefore?"}]
    assert ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == \
        auto.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)


def test_other_directories_go_through_autotokenizer(tmp_path, monkeypatch):
    copy = shutil.copytree(resolve_model_path(None), tmp_path / "model",
                           ignore=shutil.ignore_patterns("*.safetensors"))
    calls = []
    real = AutoTokenizer.from_pretrained.__func__

    def spy(cls, path, *args, **kwargs):
        calls.append(path)
        return real(cls, path, *args, **kwargs)

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", classmethod(spy))
    embedded = load_tokenizer(resolve_model_path(None))
    assert calls == []
    assert load_tokenizer(copy).get_vocab() == embedded.get_vocab() and calls == [str(copy)]
    # An embedded directory whose tokenizer_config.json named another class would go through it too.
    monkeypatch.setattr(tokenizer_module, "EMBEDDED_TOKENIZER_CLASS", "LlamaTokenizerFast")
    load_tokenizer(resolve_model_path(None))
    assert calls == [str(copy), str(resolve_model_path(None))]
