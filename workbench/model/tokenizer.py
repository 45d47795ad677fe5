"""load_tokenizer(): a model directory's transformers tokenizer, as ``AutoTokenizer`` loads it.

``AutoTokenizer`` first loads the model's transformers config class to choose the tokenizer
class; for a Llama config that imports torch.distributed and sympy: about 1 s, and half a
second more when the process exits. The embedded models (:data:`EMBEDDED_MODELS`) name
``PreTrainedTokenizerFast`` in their tokenizer_config.json, and that is the class
AutoTokenizer makes of them, so they are loaded by it directly (tests/model/test_tokenizer.py
holds the two equal). Every other directory goes through AutoTokenizer.
"""

from __future__ import annotations

import importlib.resources
import json
import os
import pathlib

from workbench.model.loader import EMBEDDED_MODELS

#: The class the embedded models' tokenizer_config.json names (checked at each load).
EMBEDDED_TOKENIZER_CLASS = "PreTrainedTokenizerFast"


def load_tokenizer(path: str | os.PathLike):
    """The tokenizer of ``path``, a model directory or a hub id (see the module docstring)."""
    if _embedded(pathlib.Path(path)):
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(str(path))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def _embedded(path: pathlib.Path) -> bool:
    """``path`` is an embedded model's directory whose tokenizer_config.json names
    :data:`EMBEDDED_TOKENIZER_CLASS`."""
    data = pathlib.Path(str(importlib.resources.files("workbench.data")))
    if path.resolve() not in {(data / name).resolve() for name in EMBEDDED_MODELS}:
        return False
    config = path / "tokenizer_config.json"
    return config.is_file() and json.loads(config.read_text()).get("tokenizer_class") == EMBEDDED_TOKENIZER_CLASS
