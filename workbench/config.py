"""The engine's configuration: EngineArgs (every knob once, vLLM's names where vLLM has one,
with vLLM's argparse round trip), also named EngineConfig, and teaching_config (a small engine
on which serving effects show within seconds).

``workbench serve``, ``workbench generate`` and the notebook magics share one set of flags::

    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    engine = LLMEngine.from_engine_args(EngineArgs.from_cli_args(parser.parse_args(argv)))
"""

from __future__ import annotations

import argparse
import json
import logging
import typing
from collections.abc import Collection
from dataclasses import dataclass, field, fields, replace
from typing import Any

from workbench.pooling.config import PoolerConfig, pooling_supports_chunking, resolve_runner
from workbench.utils.json_config import config_from_json
from workbench.utils.reprs import html_table

logger = logging.getLogger("workbench")


#: vLLM's ``collect_detailed_traces`` choices.
DETAILED_TRACE_MODULES = ("model", "worker", "all")


#: The structured-output backends (vLLM's names; outlines and lm-format-enforcer are not here).
STRUCTURED_OUTPUTS_BACKENDS = ("auto", "xgrammar", "guidance")


@dataclass(frozen=True)
class StructuredOutputsConfig:
    """vLLM's engine-wide structured-outputs options. ``backend``: "xgrammar", "guidance"
    (llguidance) or "auto" (xgrammar, falling back to guidance for a constraint xgrammar
    refuses, as vLLM); ``disable_fallback``: never fall back; ``disable_any_whitespace``: JSON
    without free whitespace (xgrammar and guidance only, vLLM's rule);
    ``disable_additional_properties``: JSON objects keep to the schema's properties (guidance
    only, vLLM's rule). :meth:`parse` reads the ``--structured-outputs-config`` JSON."""

    backend: str = "auto"
    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False

    def __post_init__(self) -> None:
        if self.backend not in STRUCTURED_OUTPUTS_BACKENDS:
            raise ValueError(f"structured_outputs_config.backend must be one of "
                             f"{list(STRUCTURED_OUTPUTS_BACKENDS)}, got {self.backend!r}.")
        if self.disable_any_whitespace and self.backend not in ("xgrammar", "guidance"):
            raise ValueError("disable_any_whitespace is only supported for xgrammar and "
                             "guidance backends.")
        if self.disable_additional_properties and self.backend != "guidance":
            raise ValueError("disable_additional_properties is only supported for the "
                             "guidance backend.")

    @classmethod
    def parse(cls, value: Any) -> StructuredOutputsConfig:
        """A config from None (the defaults), a dict, its JSON text or a config."""
        if isinstance(value, cls):
            return value
        return cls() if value is None else config_from_json(cls, value, "structured_outputs_config")


def option(default: Any, help: str, **cli: Any) -> Any:
    """A config field with its help text (``EngineArgs.add_cli_args`` turns it into a flag;
    ``cli`` adds argparse settings such as ``choices``)."""
    return field(default=default, metadata={"help": help, **cli})


_SCALARS = (int, float, str)


def _flag_type(hint: object) -> type:
    """int / float / str for a field annotated ``T`` or ``T | None``; str otherwise (Any)."""
    args = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
    return args[0] if len(args) == 1 and args[0] in _SCALARS else str


#: vLLM's ``SpeculativeConfig.method`` values this engine runs.
SPECULATIVE_METHODS = ("ngram", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's speculative decoding options (``speculative_config``).

    ``method``: ``"ngram"`` (prompt lookup over the request's own prompt and output) or
    ``"draft_model"`` (``model``: a smaller model with the target's tokenizer and vocabulary,
    a directory, hub id or the embedded ``"tiny-shakespeare-draft"``). Each step proposes up to
    ``num_speculative_tokens`` (k) tokens per decoding request, which the target verifies in
    one forward pass. N-gram: the longest suffix of ``prompt_lookup_min..prompt_lookup_max``
    tokens that occurred before proposes the k tokens that followed it (either bound given
    alone sets both; neither: 5). Invariant: every field is valid once constructed.
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    model: str | None = None

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config.method must be one of {list(SPECULATIVE_METHODS)}, "
                             f"got {self.method!r}.")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"speculative_config.num_speculative_tokens must be an integer >= 1, got {k!r}.")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if lo is None and hi is None:
            lo = hi = 5
        lo, hi = (hi if lo is None else lo), (lo if hi is None else hi)
        for name, value in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"speculative_config.{name} must be an integer >= 1, got {value!r}.")
        if lo > hi:
            raise ValueError(f"speculative_config.prompt_lookup_min ({lo}) must be <= "
                             f"prompt_lookup_max ({hi}).")
        object.__setattr__(self, "prompt_lookup_min", lo)
        object.__setattr__(self, "prompt_lookup_max", hi)
        if self.method == "draft_model" and not self.model:
            raise ValueError("speculative_config.model is required with method 'draft_model' "
                             "(a directory, hub id or 'tiny-shakespeare-draft').")
        if self.method == "ngram" and self.model is not None:
            raise ValueError("speculative_config.model must not be set with method 'ngram' "
                             f"(got {self.model!r}): n-gram proposals need no model.")

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict | str | None) -> SpeculativeConfig | None:
        """A SpeculativeConfig from itself, a dict or a JSON object string (None stays None);
        unknown keys raise, naming them."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        return config_from_json(cls, value, "speculative_config")

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def __str__(self) -> str:
        """The JSON its ``--speculative-config`` flag takes."""
        return json.dumps({k: v for k, v in self.to_dict().items() if v is not None})


#: vLLM's ``kv_role`` values: a producer sends its prompts' KV, a consumer receives, both does both.
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
#: The KV connectors this engine has (vLLM's ``kv_connector`` names its own).
KV_CONNECTORS = ("InProcessConnector",)


@dataclass(frozen=True)
class KVTransferConfig:
    """vLLM's ``kv_transfer_config``: which KV connector moves prompts' KV blocks between
    engines (prefill/decode disaggregation) and this engine's ``kv_role``. ``engine_id`` names
    the engine to its peers (a request's ``remote_engine_id``); ``kv_connector_extra_config``
    holds the connector's own options (the in-process one: its modelled link, see
    :mod:`workbench.distributed.kv_transfer.link`). Invariant: valid once constructed."""

    kv_connector: str = "InProcessConnector"
    kv_role: str = "kv_both"
    engine_id: str | None = None
    kv_connector_extra_config: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kv_connector not in KV_CONNECTORS:
            raise ValueError(f"kv_transfer_config.kv_connector must be one of {list(KV_CONNECTORS)}, "
                             f"got {self.kv_connector!r}.")
        if self.kv_role not in KV_ROLES:
            raise ValueError(f"kv_transfer_config.kv_role must be one of {list(KV_ROLES)}, got {self.kv_role!r}.")
        if self.engine_id is not None and (not isinstance(self.engine_id, str) or not self.engine_id):
            raise ValueError(f"kv_transfer_config.engine_id must be a non-empty string, got {self.engine_id!r}.")
        if not isinstance(self.kv_connector_extra_config, dict):
            raise ValueError("kv_transfer_config.kv_connector_extra_config must be a dict, got "
                             f"{type(self.kv_connector_extra_config).__name__}.")

    @property
    def is_kv_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_kv_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    @classmethod
    def parse(cls, value: KVTransferConfig | dict | str | None) -> KVTransferConfig | None:
        """From itself, a dict or a JSON object string (None stays None); unknown keys raise."""
        if value is None or isinstance(value, KVTransferConfig):
            return value
        return config_from_json(cls, value, "kv_transfer_config")

    def __str__(self) -> str:
        return json.dumps({f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None})


@dataclass(repr=False)
class EngineArgs:
    """Configuration of an :class:`~workbench.engine.llm_engine.LLMEngine`: every option once,
    each field's help text also its ``workbench serve`` / ``generate`` flag's help.

    One class under two names, because vLLM users know both: ``EngineArgs`` (the options and
    their command-line round trip, ``LLMEngine.from_engine_args``) and ``EngineConfig`` (what
    an engine was built from, ``LLMEngine(EngineConfig(...))``, ``engine.config``). It prints
    as ``EngineConfig(...)``, the engine's configuration. ``None`` means "derive it" as each
    field's help says; ``from_cli_args(parse_args(argv))`` of ``add_cli_args``' flags gives
    back every value a flag can spell.
    """

    model: str | None = option(
        None, "Hugging Face directory or hub id (default: the embedded tiny model in data/)")
    tokenizer: str | None = option(None, "tokenizer directory or hub id (default: the model's)")
    dtype: str = option("auto", "weights and activations dtype ('auto': the checkpoint's)",
                        choices=["auto", "float32", "float16", "bfloat16"])
    device: str | None = option(None, "'cpu' or 'cuda[:N]' (default: cuda when available)")
    load_format: str = option("auto", "'auto'/'safetensors' (the weights) or 'dummy' (seeded "
                              "random weights, real shapes)",
                              choices=["auto", "safetensors", "dummy"])
    seed: int = option(0, "seed of the engine's sampler and of dummy weights")
    max_model_len: int | None = option(
        None, "context length (default: the model config's max_position_embeddings)")
    block_size: int = option(16, "tokens per KV-cache block")
    num_kv_blocks: int | None = option(
        None, "KV-cache blocks (default: from kv_cache_memory_bytes on CPU, "
        "gpu_memory_utilization on CUDA)")
    kv_cache_memory_bytes: int = option(256 * 1024**2, "CPU: bytes for the KV cache")
    gpu_memory_utilization: float = option(
        0.9, "CUDA: fraction of GPU memory for weights, activations and KV cache")
    max_num_kv_blocks: int = option(
        2**18, "cap on KV-cache blocks sized from memory (each block is a Python object)")
    max_num_seqs: int | None = option(
        None, "most requests in one step (default, as vLLM: 256 on CUDA, 128 on CPU)")
    max_num_batched_tokens: int | None = option(
        None, "token budget of one step (default, as vLLM: 2048 on CPU, 8192 on CUDA; at least "
        "max_model_len without chunked prefill)")
    enable_prefix_caching: bool = option(True, "reuse cached KV blocks of shared prefixes")
    enable_chunked_prefill: bool = option(True, "split long prompts over several steps")
    policy: Any = option("fcfs", "scheduling policy: a name or a SchedulingPolicy object",
                         choices=["fcfs", "priority", "spf"])
    attention_backend: str | None = option(
        None, "'triton', 'cpu' (the batched CPU path) or 'torch' (the plain reference); "
        "default: triton on CUDA, cpu on CPU",
        choices=["torch", "triton", "cpu"])
    batch_invariant: bool = option(
        False, "compute every request's logits (and logprobs) bitwise the same whatever else is "
        "in its batch, however its prompt is chunked or cached (fixed-order kernels; slower)")
    speculative_config: SpeculativeConfig | None = option(
        None, "speculative decoding, vLLM's JSON, e.g. '{\"method\": \"ngram\", "
        "\"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4, \"prompt_lookup_min\": 2}' or "
        "'{\"method\": \"draft_model\", \"model\": \"tiny-shakespeare-draft\", "
        "\"num_speculative_tokens\": 3}' (a dict in Python); default: off")
    async_scheduling: bool = option(
        False, "schedule step N+1 while step N executes (vLLM's AsyncScheduler and its batch "
        "queue of two: the runner executes on a worker thread); greedy tokens are unchanged")
    keep_warm_s: float = option(
        10.0, "CPU: while the engine waits for requests, keep torch's worker threads awake (they "
        "spin: about one core) this many seconds after the last step (a parked thread can add "
        "~10 ms to the next step on a VM; see workbench/engine/idle.py); 0: let them park at once")
    max_logprobs: int = option(20, "largest logprobs / prompt_logprobs a request may ask for "
                               "(-1: no limit; a request's -1 asks for the whole vocabulary)")
    logits_processors: list[Any] | None = option(
        None, "custom batch-level logits processors (vLLM v1's LogitsProcessor interface): "
        "fully qualified class names, package.module:Class or package.module.Class, or the "
        "classes; loaded at start-up, applied to every step", nargs="+")
    reasoning_parser: str | None = option(
        None, "split replies into reasoning and content with this parser ('deepseek_r1', "
        "'qwen3': <think>...</think>); structured outputs then start after the reasoning")
    max_history: int = option(10_000, "StepRecords kept in engine.history")
    multiprocess_mode: bool = option(
        False, "serve with the engine core in a child process over ZMQ (AsyncLLM, the server), as "
        "vLLM V1; VLLM_ENABLE_V1_MULTIPROCESSING=1 turns it on too. Off: the steppable "
        "in-process engine")
    log_stats: bool = option(
        True, "stat logging (vLLM's default for an engine: disable_log_stats=False): the periodic "
        "stats line every log_stats_interval seconds while steps run (the 'workbench' logger, "
        "at INFO) and the stat loggers (add_logger, the server's /metrics); LLM() turns it off "
        "unless told, as vLLM's LLM does")
    log_stats_interval: float = option(5.0, "seconds between two stats lines")
    otlp_traces_endpoint: str | None = option(
        None, "send an OpenTelemetry span per finished request (vLLM's llm_request) to this OTLP "
        "endpoint, e.g. http://127.0.0.1:4318/v1/traces (HTTP/protobuf; "
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=grpc for gRPC)")
    collect_detailed_traces: str | None = option(
        None, "with otlp_traces_endpoint: add the scheduling decisions as span events and the "
        "model forward ('model'), execute ('worker') or both ('all') times as attributes",
        choices=list(DETAILED_TRACE_MODULES))
    enable_sleep_mode: bool = option(
        False, "allow sleep(level) / wake_up(tags): free the weights and KV cache between uses")
    torch_profiler_dir: str | None = option(
        None, "directory of start_profile()'s torch.profiler traces; also enables the server's "
        "/start_profile and /stop_profile (vLLM's VLLM_TORCH_PROFILER_DIR)")
    enable_lora: bool = option(
        False, "serve LoRA adapters (PEFT format): lora_request= on requests, add_lora()")
    max_loras: int = option(1, "with enable_lora: most distinct adapters in one batch (the "
                            "device slots)")
    max_lora_rank: int = option(16, "with enable_lora: the largest adapter rank accepted")
    max_cpu_loras: int | None = option(
        None, "with enable_lora: adapters kept loaded in host memory, LRU (default: max_loras)")

    runner: str = option("auto", "vLLM's --runner: 'generate', 'pooling' (embeddings) or 'auto' "
                         "(generate, unless convert asks for pooling)",
                         choices=["auto", "generate", "pooling"])
    convert: str = option("auto", "vLLM's --convert: 'embed' turns the causal LM into an "
                          "embedding model (runner pooling); 'auto' does so for runner pooling",
                          choices=["auto", "none", "embed", "classify"])
    pooler_config: PoolerConfig | None = option(
        None, "runner pooling: the pooler, as JSON: {\"pooling_type\": \"LAST\"|\"MEAN\"|"
        "\"CLS\"|\"ALL\", \"normalize\": true, \"dimensions\": null} (default: LAST, normalized)")
    kv_transfer_config: KVTransferConfig | None = option(
        None, "prefill/decode disaggregation, vLLM's JSON, e.g. '{\"kv_connector\": "
        "\"InProcessConnector\", \"kv_role\": \"kv_producer\"}' (kv_producer, kv_consumer or "
        "kv_both; a dict in Python); requests then carry kv_transfer_params; default: off")
    structured_outputs_config: StructuredOutputsConfig | None = option(
        None, "structured outputs, as JSON: {\"backend\": \"auto\"|\"xgrammar\"|\"guidance\", "
        "\"disable_fallback\": false, \"disable_any_whitespace\": false, "
        "\"disable_additional_properties\": false} (default: backend auto)")

    def __post_init__(self) -> None:
        self.structured_outputs_config = StructuredOutputsConfig.parse(
            self.structured_outputs_config)
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        self.runner, self.convert, self.pooler_config = resolve_runner(
            self.runner, self.convert, PoolerConfig.parse(self.pooler_config))
        if not pooling_supports_chunking(self.pooler_config) and (
                self.enable_chunked_prefill or self.enable_prefix_caching):
            logger.info('Only "last" pooling supports chunked prefill and prefix caching; '
                        "disabling both.")
            self.enable_chunked_prefill = self.enable_prefix_caching = False
        self.kv_transfer_config = KVTransferConfig.parse(self.kv_transfer_config)
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}.")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}.")
        if not self.keep_warm_s >= 0:
            raise ValueError(f"keep_warm_s must be >= 0, got {self.keep_warm_s}.")
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
        if self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be >= 0, or -1 (no limit), got "
                             f"{self.max_logprobs}.")
        if self.collect_detailed_traces is not None:
            if self.collect_detailed_traces not in DETAILED_TRACE_MODULES:
                raise ValueError(f"collect_detailed_traces must be one of {list(DETAILED_TRACE_MODULES)}, "
                                 f"got {self.collect_detailed_traces!r}.")
            if not self.otlp_traces_endpoint:
                raise ValueError("collect_detailed_traces requires `--otlp-traces-endpoint` to be set.")
        for name in ("max_loras", "max_lora_rank"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}.")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= "
                             f"max_loras ({self.max_loras})")
        if self.async_scheduling and self.speculative_config is not None:
            # vLLM's rule and message: only drafters that run on the device's sampled tokens.
            raise ValueError("Currently, async scheduling is only supported with EAGLE/MTP/Draft "
                             "Model/NGram GPU kind of speculative decoding")
        if self.async_scheduling and self.runner == "pooling":
            raise ValueError("async_scheduling: not supported with runner 'pooling' here (a pooling "
                             "request is one prefill and samples nothing to overlap); drop one of them.")
        if self.async_scheduling and self.kv_transfer_config is not None:
            raise ValueError("async_scheduling: not supported with kv_transfer_config here (the "
                             "AsyncScheduler has no KV-connector path yet); drop one of them.")
        if self.enable_lora and self.batch_invariant:
            raise ValueError("enable_lora: LoRA adapters are not supported with batch_invariant.")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}."
            )

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser, *, exclude: Collection[str] = (),
                     keep_defaults: bool = True) -> argparse.ArgumentParser:
        """Add one ``--flag-name`` per option (booleans also get ``--no-flag-name``).

        ``exclude`` leaves options out (a caller that takes the model as a positional);
        ``keep_defaults=False`` parses an absent flag as None, so only the flags given
        override another base config (``%llm load`` over the teaching engine).
        """
        group = parser.add_argument_group("engine options")
        hints = typing.get_type_hints(EngineArgs)
        for f in fields(EngineArgs):
            if f.name in exclude:
                continue
            flag = "--" + f.name.replace("_", "-")
            meta = dict(f.metadata)
            help_text = meta.pop("help", "")
            default = f.default if keep_defaults else None
            if default is not None:
                help_text += " (default: %(default)s)"
            if hints[f.name] is bool:
                group.add_argument(flag, action=argparse.BooleanOptionalAction,
                                   default=default, help=help_text)
            else:
                group.add_argument(flag, type=_flag_type(hints[f.name]), default=default,
                                   help=help_text, **meta)
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        """The EngineArgs of a namespace parsed with :meth:`add_cli_args` (other keys ignored)."""
        return cls(**{f.name: getattr(args, f.name) for f in fields(EngineArgs)
                      if hasattr(args, f.name)})

    def create_engine_config(self) -> EngineConfig:
        """vLLM's step from options to an engine's config: here a copy (the engine keeps its
        own, whatever the caller later does to these args)."""
        return replace(self)

    def to_kwargs(self) -> dict:
        """The options as keyword arguments (for ``LLM(**args.to_kwargs())``)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def __repr__(self) -> str:
        return "EngineConfig(" + ", ".join(f"{k}={v!r}" for k, v in self.to_kwargs().items()) + ")"

    def _repr_html_(self) -> str:
        return html_table("EngineConfig", self.to_kwargs())


#: The same class as EngineArgs (see its docstring).
EngineConfig = EngineArgs


def default_max_num_seqs(device_type: str) -> int:
    """Sequences per step when not configured: vLLM's, 256 on CUDA and 128 on CPU (its
    server default there)."""
    return 256 if device_type == "cuda" else 128


def default_max_num_batched_tokens(device_type: str, enable_chunked_prefill: bool,
                                   max_model_len: int) -> int:
    """Token budget per step when not configured. CUDA: 8192 (vLLM's for offline use with
    chunked prefill), at least ``max_model_len`` without it. CPU: 2048 (vLLM's server default
    there), at least ``max_model_len`` without chunked prefill."""
    if device_type == "cuda":
        return 8192 if enable_chunked_prefill else max(8192, max_model_len)
    return 2048 if enable_chunked_prefill else max(2048, max_model_len)


#: A pool of 24 blocks of 4 tokens (96 token slots), 32 tokens per step, at most 4
#: sequences: on a default ``Workload.poisson()`` (12 prompts of 8-40 tokens, 4-16 outputs)
#: it fills the pool, chunks prefills, preempts and resumes from the prefix cache, within
#: about 50 steps (a few seconds) of the embedded model.
TEACHING_DEFAULTS = dict(
    block_size=4,
    num_kv_blocks=24,
    max_num_batched_tokens=32,
    max_num_seqs=4,
    device="cpu",
    dtype="float32",
)


def teaching_config(**overrides) -> EngineConfig:
    """EngineConfig of the teaching engine (:data:`TEACHING_DEFAULTS`), with ``overrides``
    (any EngineConfig field) applied."""
    return EngineConfig(**{**TEACHING_DEFAULTS, **overrides})
