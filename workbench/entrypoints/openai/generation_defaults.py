"""The model's sampling defaults from its ``generation_config.json`` (vLLM's
``--generation-config``): "auto" reads the model's folder, "vllm" uses none, a folder path
reads that folder. A request's own values always win."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger("workbench.entrypoints.openai")

#: generation_config.json key -> SamplingParams field (vLLM's set).
_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


def load_generation_defaults(source: str, model_dir: str | Path) -> dict[str, Any]:
    """SamplingParams defaults from ``source`` ("auto", "vllm" or a folder); {} if none."""
    if source == "vllm":
        return {}
    folder = Path(model_dir if source == "auto" else source)
    path = folder / "generation_config.json"
    if not path.is_file():
        if source != "auto":
            raise FileNotFoundError(f"generation_config: no generation_config.json in {folder}")
        return {}
    config = json.loads(path.read_text())
    defaults = {field: config[key] for key, field in _FIELDS.items() if key in config}
    if defaults:
        logger.info("Default sampling parameters have been overridden by the model's "
                    "generation config: %s", defaults)
    return defaults
