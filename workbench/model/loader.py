"""Finding a model (embedded default, local directory or Hugging Face hub id) and loading its weights."""

from __future__ import annotations

import importlib.resources
import json
import logging
import os
import pathlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # finding a model needs no torch (a simulation finds one and loads none)
    import torch

    from workbench.model.llama import LlamaForCausalLM
    from workbench.model.model_config import ModelConfig

logger = logging.getLogger(__name__)

DEFAULT_MODEL_DIR = "tiny-shakespeare"
#: Models shipped in ``workbench.data``, loadable by their name: the default and its draft
#: model for speculative decoding (same tokenizer).
EMBEDDED_MODELS = (DEFAULT_MODEL_DIR, "tiny-shakespeare-draft")
HUB_ALLOW_PATTERNS = ["*.json", "model*.safetensors", "*.txt", "*.model", "*.jinja"]
HUB_TIMEOUT_S = 10.0
LOAD_FORMATS = ("auto", "safetensors", "dummy")


class ModelLoadError(OSError):
    """A model could not be found or fetched; the message starts "Could not load model 'X': "."""

    def __init__(self, model: str, reason: str):
        self.model = model
        super().__init__(f"Could not load model {model!r}: {reason}")


def default_model_path() -> pathlib.Path:
    """The embedded default model (data/tiny-shakespeare, installed as ``workbench.data``)."""
    path = pathlib.Path(str(importlib.resources.files("workbench.data") / DEFAULT_MODEL_DIR))
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"The embedded default model is missing: no config.json in {str(path)!r}. It is built by "
            "the project's training script; or pass model= a local Hugging Face directory or hub id."
        )
    return path


#: The LoRA adapters shipped for the embedded model, in data/loras/<name>/ (PEFT format).
EMBEDDED_LORAS = ("errors", "timon")


def embedded_lora_path(name: str) -> pathlib.Path:
    """The directory of a LoRA adapter shipped for the embedded model (:data:`EMBEDDED_LORAS`)."""
    if name not in EMBEDDED_LORAS:
        raise ValueError(f"No embedded LoRA adapter {name!r}; there are {list(EMBEDDED_LORAS)}.")
    return pathlib.Path(str(importlib.resources.files("workbench.data") / "loras" / name))


def _hub_offline() -> bool:
    from huggingface_hub import constants

    flags = (os.environ.get("HF_HUB_OFFLINE"), os.environ.get("TRANSFORMERS_OFFLINE"))
    return constants.HF_HUB_OFFLINE or any(
        (v or "").strip().upper() in ("1", "ON", "YES", "TRUE") for v in flags
    )


def _looks_local(model: str) -> bool:
    """A path rather than a hub id ("name" or "org/name")."""
    return model.startswith(("/", ".", "~")) or "\\" in model or model.count("/") > 1


def resolve_model_path(model: str | os.PathLike | None) -> pathlib.Path:
    """A local directory holding the model's files.

    None -> :func:`default_model_path`; an existing directory -> itself; a name of
    :data:`EMBEDDED_MODELS` -> its directory in ``workbench.data``; anything else is a
    Hugging Face hub id, taken from the local cache when complete there, else downloaded
    (config, tokenizer and ``model*.safetensors`` files only). Offline (``HF_HUB_OFFLINE=1``) or
    with the hub unreachable this raises :class:`ModelLoadError` within about ``HUB_TIMEOUT_S``.
    """
    if model is None:
        return default_model_path()
    model = os.fspath(model)
    if model in EMBEDDED_MODELS and not pathlib.Path(model).is_dir():
        return pathlib.Path(str(importlib.resources.files("workbench.data") / model))
    local = pathlib.Path(model).expanduser()
    if local.is_dir():
        return local.absolute()
    if local.exists() or _looks_local(model):
        raise ModelLoadError(model, "no such local directory (and it is not a Hugging Face hub id).")

    from huggingface_hub import HfApi, snapshot_download
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError

    try:
        return pathlib.Path(snapshot_download(model, allow_patterns=HUB_ALLOW_PATTERNS, local_files_only=True))
    except Exception as error:  # not cached (or incompletely): go online unless forbidden
        cache_error = error
    if _hub_offline():
        raise ModelLoadError(
            model,
            "not a local directory and not in the Hugging Face cache, and HF_HUB_OFFLINE=1 forbids "
            "downloading it. Download it once with a network, or pass a local directory.",
        ) from cache_error
    try:
        # An explicit, bounded metadata call first: snapshot_download's own look-up has no timeout.
        info = HfApi().model_info(model, timeout=HUB_TIMEOUT_S)
        path = snapshot_download(
            model, revision=info.sha, allow_patterns=HUB_ALLOW_PATTERNS, etag_timeout=HUB_TIMEOUT_S
        )
    except (RepositoryNotFoundError, GatedRepoError) as error:
        raise ModelLoadError(
            model, "no such repository on the Hugging Face hub, or it is gated/private (set HF_TOKEN)."
        ) from error
    except HfHubHTTPError as error:
        raise ModelLoadError(model, f"the Hugging Face hub answered with an error: {error}") from error
    except Exception as error:  # connection refused, DNS failure, timeout, proxy error
        raise ModelLoadError(
            model,
            f"the Hugging Face hub could not be reached ({type(error).__name__}: {error}) and the "
            "model is not in the local cache. Check the network, or set HF_HUB_OFFLINE=1 and pass "
            "a local directory.",
        ) from error
    return pathlib.Path(path)


def safetensors_files(path: pathlib.Path) -> list[pathlib.Path]:
    """The checkpoint's safetensors files: those named by model.safetensors.index.json, else
    model.safetensors, else every ``*.safetensors`` except Mistral's ``consolidated*`` copies."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [path / n for n in names]
        absent = [str(f) for f in files if not f.is_file()]
        if absent:
            raise FileNotFoundError(f"{index} names shard(s) that are missing: {', '.join(absent)}.")
        return files
    if (path / "model.safetensors").is_file():
        return [path / "model.safetensors"]
    files = sorted(f for f in path.glob("*.safetensors") if not f.name.startswith("consolidated"))
    if not files:
        raise FileNotFoundError(
            f"No *.safetensors weights in {str(path)!r} (only safetensors checkpoints are supported; "
            "load_format='dummy' builds random weights instead)."
        )
    return files


def iterate_safetensors(path: pathlib.Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of the checkpoint in ``path``, one shard open at a time."""
    from safetensors import safe_open

    for file in safetensors_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def load_weights(model: LlamaForCausalLM, model_config: ModelConfig, *, load_format: str, seed: int) -> None:
    """Fill ``model``'s parameters (allocated at their shapes) as :func:`load_model` does, then
    store its CPU weights in the layout their products read best
    (:mod:`workbench.model.weight_layout`) and give them their oneDNN copies for several rows
    where those pay (``model.pack_weights()``)."""
    from workbench.model.weight_layout import store_for_cpu_products

    if load_format == "dummy":
        model.init_dummy_weights(seed)
    else:
        model.load_weights(iterate_safetensors(pathlib.Path(model_config.path)))
    store_for_cpu_products(model)
    model.pack_weights()


def load_model(
    model_config: ModelConfig,
    *,
    device: torch.device | str,
    load_format: str = "auto",
    seed: int = 0,
) -> LlamaForCausalLM:
    """Build the native model for ``model_config`` on ``device`` in ``model_config.dtype``.

    "auto"/"safetensors": weights from the model directory (sharded or not; every tensor must
    match); "dummy": :meth:`LlamaForCausalLM.init_dummy_weights` with ``seed``.
    """
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {load_format!r}.")
    from workbench.model.llama import MODEL_CLASSES

    model = MODEL_CLASSES[model_config.architecture](model_config, device=device)
    load_weights(model, model_config, load_format=load_format, seed=seed)
    logger.info(
        "Loaded %s (%s, %s weights) on %s: %.1fM parameters.", model_config.architecture,
        model_config.dtype, load_format, device, sum(p.numel() for p in model.parameters()) / 1e6,
    )
    return model.eval()
