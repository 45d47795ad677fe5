"""EngineConfig: every knob of the engine in one place (vLLM's names where vLLM has one)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class EngineConfig:
    """Configuration of an :class:`~workbench.engine.LLMEngine`.

    ``None`` means "derive it": ``model`` -> the embedded default model in data/;
    ``device`` -> "cuda" when available else "cpu"; ``attention_backend`` -> "triton"
    on CUDA, "cpu" on CPU (the batched CPU path; "torch" is the plain reference); ``max_model_len`` -> the model config's
    ``max_position_embeddings``; ``num_kv_blocks`` -> from ``kv_cache_memory_bytes``
    (CPU) or ``gpu_memory_utilization`` (CUDA); ``max_num_batched_tokens`` ->
    ``max(2048, max_model_len)`` without chunked prefill, 512 with it.
    """

    model: str | None = None
    tokenizer: str | None = None
    dtype: str = "auto"
    device: str | None = None
    load_format: str = "auto"  # "auto" (safetensors) or "dummy" (seeded random weights)
    seed: int = 0
    max_model_len: int | None = None
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_bytes: int = 256 * 1024**2
    gpu_memory_utilization: float = 0.9
    max_num_kv_blocks: int = 2**18  # cap when sizing from memory: each block is a Python object
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    policy: Any = "fcfs"  # a name ("fcfs", "priority", "spf") or a SchedulingPolicy object
    attention_backend: str | None = None  # "torch", "triton" or "cpu"
    max_history: int = 10_000
    log_stats: bool = False
    log_stats_interval: float = 5.0

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}.")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}.")
        if self.max_num_kv_blocks < 1:
            raise ValueError(f"max_num_kv_blocks must be >= 1, got {self.max_num_kv_blocks}.")
        if self.max_num_seqs is not None and self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}.")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}."
            )
        if self.load_format not in ("auto", "dummy", "safetensors"):
            raise ValueError(
                f"load_format must be 'auto', 'safetensors' or 'dummy', got {self.load_format!r}."
            )
        if self.dtype not in ("auto", "float32", "float16", "bfloat16"):
            raise ValueError(
                f"dtype must be 'auto', 'float32', 'float16' or 'bfloat16', got {self.dtype!r}."
            )
        if self.device is not None and self.device.split(":")[0] not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {self.device!r}.")
        if self.attention_backend not in (None, "torch", "triton", "cpu"):
            raise ValueError(
                "attention_backend must be 'torch', 'triton' or 'cpu', got "
                f"{self.attention_backend!r}."
            )
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}."
            )


def default_max_num_seqs(device_type: str) -> int:
    """Sequences per step when not configured: 256 on CUDA (vLLM's), 64 on CPU."""
    return 256 if device_type == "cuda" else 64


def default_max_num_batched_tokens(device_type: str, enable_chunked_prefill: bool,
                                   max_model_len: int) -> int:
    """Token budget per step when not configured. CUDA: 8192 (vLLM's for offline use with
    chunked prefill), at least ``max_model_len`` without it. CPU: 512 with chunked prefill,
    ``max(2048, max_model_len)`` without."""
    if device_type == "cuda":
        return 8192 if enable_chunked_prefill else max(8192, max_model_len)
    return 512 if enable_chunked_prefill else max(2048, max_model_len)
