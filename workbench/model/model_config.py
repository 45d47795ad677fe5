"""ModelConfig: the facts about a Llama-family checkpoint that the engine needs, read from config.json.

config.json is read as plain JSON (both the classic ``rope_theta`` + ``rope_scaling`` layout and
transformers 5's ``rope_parameters`` layout), so no transformers model class is imported.
"""

from __future__ import annotations

import html
import json
import pathlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # a config is read without torch (a simulation reads one and loads no weights)
    import torch

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "MistralForCausalLM",
)
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")

_MODEL_TYPE_TO_ARCH = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mistral": "MistralForCausalLM",
}
#: Accepted dtype names (a torch.dtype is accepted by its name) -> the torch attribute name.
_DTYPES = {
    "float32": "float32",
    "float": "float32",
    "float16": "float16",
    "half": "float16",
    "bfloat16": "bfloat16",
}
#: Bytes per element of each dtype (what a KV block's size needs).
_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}


def _parse_dtype(name: Any, what: str) -> str:
    key = str(name).removeprefix("torch.")
    if key not in _DTYPES:
        raise ValueError(f"{what} must be one of {sorted(set(_DTYPES))}, got {name!r}.")
    return _DTYPES[key]


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def _rope_settings(cfg: dict) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) with rope_scaling None for plain RoPE, else a dict with
    ``rope_type`` and its parameters. Raises ValueError for a type this model does not support."""
    params = cfg.get("rope_parameters")
    scaling = cfg.get("rope_scaling")
    theta = cfg.get("rope_theta")
    if isinstance(params, dict) and params:
        theta = params.get("rope_theta", theta)
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    if theta is None:
        theta = 10000.0
    if scaling:
        scaling = dict(scaling)
        rope_type = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
        scaling.pop("type", None)
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"rope_scaling type {rope_type!r} is not supported; supported types: "
                f"{', '.join(SUPPORTED_ROPE_TYPES)}."
            )
        if scaling.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError(
                f"partial_rotary_factor={scaling['partial_rotary_factor']} is not supported (only 1.0)."
            )
        scaling.pop("partial_rotary_factor", None)
        if rope_type == "default":
            scaling = None
        else:
            scaling = {"rope_type": rope_type, **scaling}
            required = {"linear": ("factor",),
                        "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                                   "original_max_position_embeddings")}[rope_type]
            missing = [k for k in required if k not in scaling]
            if missing:
                raise ValueError(f"rope_scaling of type {rope_type!r} lacks {', '.join(missing)}.")
    else:
        scaling = None
    return float(theta), scaling


def _layer_types(cfg: dict, architecture: str, num_layers: int, window: int | None) -> tuple[str, ...]:
    """Per layer "full_attention" or "sliding_attention", following transformers' semantics:
    Mistral slides on every layer when ``sliding_window`` is set; Qwen2/Qwen3 only with
    ``use_sliding_window`` and from layer ``max_window_layers`` on (unless ``layer_types`` says)."""
    if architecture == "LlamaForCausalLM" or window is None:
        return ("full_attention",) * num_layers
    if architecture == "MistralForCausalLM":
        return ("sliding_attention",) * num_layers
    if not cfg.get("use_sliding_window", False):
        return ("full_attention",) * num_layers
    given = cfg.get("layer_types")
    if given is not None:
        if len(given) != num_layers:
            raise ValueError(
                f"layer_types has {len(given)} entries but num_hidden_layers is {num_layers}."
            )
        return tuple(given)
    start = cfg.get("max_window_layers", 0)
    return tuple("sliding_attention" if i >= start else "full_attention" for i in range(num_layers))


@dataclass(repr=False)
class ModelConfig:
    """What the native model, the loader and the KV-cache sizing need to know about a checkpoint.

    ``max_model_len`` <= ``max_position_embeddings`` always; ``num_heads`` is a multiple of
    ``num_kv_heads``; ``sliding_window`` is None unless some layer uses it (see ``layer_types``).
    """

    path: pathlib.Path
    architecture: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_model_len: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    sliding_window: int | None
    #: The weights' dtype by name ("float32", "float16", "bfloat16"); :attr:`dtype` is the torch.dtype.
    dtype_name: str
    eos_token_ids: list[int]
    bos_token_id: int | None
    max_position_embeddings: int = 0
    o_bias: bool = False
    mlp_bias: bool = False
    layer_types: tuple[str, ...] = ()
    model_type: str = ""
    hf_config: dict = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_pretrained(
        cls,
        path: str | pathlib.Path,
        *,
        dtype: str | torch.dtype = "auto",
        max_model_len: int | None = None,
        device: str | torch.device | None = None,
    ) -> "ModelConfig":
        """Read ``path``/config.json (and generation_config.json for extra EOS ids).

        ``dtype="auto"`` takes the checkpoint's ``torch_dtype``/``dtype`` (float32 when absent),
        except that half types become float32 on CPU (``device`` None means cuda when available).
        """
        path = pathlib.Path(path)
        config_file = path / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(f"No config.json in model directory {str(path)!r}.")
        cfg = json.loads(config_file.read_text())
        architectures = cfg.get("architectures") or []
        architecture = architectures[0] if architectures else _MODEL_TYPE_TO_ARCH.get(cfg.get("model_type"))
        if architecture not in SUPPORTED_ARCHITECTURES:
            name = architecture or f"model_type {cfg.get('model_type')!r}"
            raise ValueError(
                f"Model architecture {name} (in {str(config_file)!r}) is not supported; supported "
                f"architectures: {', '.join(SUPPORTED_ARCHITECTURES)}."
            )
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act {act!r} is not supported (only 'silu').")

        hidden_size = int(cfg["hidden_size"])
        num_heads = int(cfg["num_attention_heads"])
        num_kv_heads = int(cfg.get("num_key_value_heads") or num_heads)
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({num_heads}) must be a multiple of num_key_value_heads "
                f"({num_kv_heads})."
            )
        head_dim = int(cfg.get("head_dim") or hidden_size // num_heads)
        num_layers = int(cfg["num_hidden_layers"])

        max_pos = int(cfg.get("max_position_embeddings", 2048))
        if max_model_len is None:
            max_model_len = max_pos
        elif max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {max_model_len}.")
        elif max_model_len > max_pos:
            raise ValueError(
                f"max_model_len ({max_model_len}) is larger than the model's "
                f"max_position_embeddings ({max_pos}) in {str(config_file)!r}."
            )

        rope_theta, rope_scaling = _rope_settings(cfg)
        window = cfg.get("sliding_window")
        if architecture in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and not cfg.get("use_sliding_window"):
            window = None
        layer_types = _layer_types(cfg, architecture, num_layers, window)
        if "sliding_attention" not in layer_types:
            window = None

        if dtype == "auto":
            ckpt_dtype = cfg.get("torch_dtype") or cfg.get("dtype") or "float32"
            resolved = _parse_dtype(ckpt_dtype, "config.json torch_dtype")
            if device is None:
                import torch

                device = "cuda" if torch.cuda.is_available() else "cpu"
            if str(device).split(":")[0] == "cpu" and resolved in ("float16", "bfloat16"):
                resolved = "float32"
        else:
            resolved = _parse_dtype(dtype, "dtype")

        eos = _as_id_list(cfg.get("eos_token_id"))
        gen_file = path / "generation_config.json"
        if gen_file.is_file():
            for tok in _as_id_list(json.loads(gen_file.read_text()).get("eos_token_id")):
                if tok not in eos:
                    eos.append(tok)

        attention_bias = bool(cfg.get("attention_bias", False))
        if architecture == "Qwen2ForCausalLM":
            qkv_bias, o_bias = True, False
        elif architecture == "MistralForCausalLM":
            qkv_bias = o_bias = False
        else:
            qkv_bias = o_bias = attention_bias

        return cls(
            path=path,
            architecture=architecture,
            hidden_size=hidden_size,
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            intermediate_size=int(cfg["intermediate_size"]),
            vocab_size=int(cfg["vocab_size"]),
            max_model_len=int(max_model_len),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            qk_norm=architecture == "Qwen3ForCausalLM",
            sliding_window=int(window) if window is not None else None,
            dtype_name=resolved,
            eos_token_ids=eos,
            bos_token_id=cfg.get("bos_token_id"),
            max_position_embeddings=max_pos,
            o_bias=o_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)) if architecture == "LlamaForCausalLM" else False,
            layer_types=layer_types,
            model_type=cfg.get("model_type", ""),
            hf_config=cfg,
        )

    def layer_sliding_window(self, layer: int) -> int | None:
        """The attention window of ``layer`` (None = full causal attention)."""
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None

    @property
    def dtype(self) -> torch.dtype:
        """The weights' torch.dtype (imports torch: a real model's runner asks for it)."""
        import torch

        return getattr(torch, self.dtype_name)

    def kv_cache_bytes_per_block(self, block_size: int) -> int:
        """Bytes one KV block takes over all layers: K and V, ``block_size`` tokens each."""
        itemsize = _ITEMSIZE[self.dtype_name]
        return 2 * self.num_layers * block_size * self.num_kv_heads * self.head_dim * itemsize

    def summary(self) -> dict[str, Any]:
        """The headline facts, machine-independent (the directory's name, not its full path)."""
        rope = "default" if self.rope_scaling is None else self.rope_scaling["rope_type"]
        return {
            "model": self.path.name,
            "architecture": self.architecture,
            "dtype": self.dtype_name,
            "layers": self.num_layers,
            "hidden_size": self.hidden_size,
            "heads": f"{self.num_heads} q / {self.num_kv_heads} kv x {self.head_dim}",
            "intermediate_size": self.intermediate_size,
            "vocab_size": self.vocab_size,
            "max_model_len": self.max_model_len,
            "rope": f"{rope}, theta={self.rope_theta:g}",
            "sliding_window": self.sliding_window,
            "tie_word_embeddings": self.tie_word_embeddings,
        }

    def __repr__(self) -> str:
        return "ModelConfig(" + ", ".join(f"{k}={v!r}" for k, v in self.summary().items()) + ")"

    def _repr_html_(self) -> str:
        rows = "".join(
            f"<tr><th style='text-align:left'>{html.escape(k)}</th><td>{html.escape(str(v))}</td></tr>"
            for k, v in self.summary().items()
        )
        return f"<table><caption>ModelConfig</caption>{rows}</table>"
