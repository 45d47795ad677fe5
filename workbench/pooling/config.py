"""PoolerConfig and the runner / convert choice (vLLM's ``--runner``, ``--convert``,
``--pooler-config``), resolved once when the engine's options are checked. Torch-free."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from workbench.utils.json_config import config_from_json

logger = logging.getLogger("workbench")

#: vLLM's pooling types this engine runs: the last token's hidden state, the mean over the
#: prompt, the first token's (CLS), or every token's (ALL).
POOLING_TYPES = ("LAST", "MEAN", "CLS", "ALL")
RUNNERS = ("auto", "generate", "pooling")
CONVERTS = ("auto", "none", "embed", "classify")


@dataclass(frozen=True)
class PoolerConfig:
    """How a pooling model pools. ``pooling_type``: one of POOLING_TYPES (None: the task's
    default, LAST for a causal LM converted to embeddings, as vLLM); ``normalize``: the
    default of requests that leave it unset (None: True); ``dimensions``: the default
    matryoshka size."""

    pooling_type: str | None = None
    normalize: bool | None = None
    dimensions: int | None = None

    def __post_init__(self) -> None:
        if self.pooling_type is not None:
            object.__setattr__(self, "pooling_type", str(self.pooling_type).upper())
            if self.pooling_type not in POOLING_TYPES:
                raise ValueError(f"pooler_config.pooling_type must be one of {list(POOLING_TYPES)}, "
                                 f"got {self.pooling_type!r}.")

    @classmethod
    def parse(cls, value: object) -> PoolerConfig | None:
        """A PoolerConfig from itself, None, a dict or its JSON text (the CLI's form)."""
        if value is None or isinstance(value, cls):
            return value
        return config_from_json(cls, value, "pooler_config")


def resolve_runner(runner: str, convert: str, pooler_config: PoolerConfig | None
                   ) -> tuple[str, str, PoolerConfig | None]:
    """(runner, convert, pooler config) as vLLM resolves them for a ``*ForCausalLM``: runner
    "auto" is "generate" (unless convert or a pooler config asks for pooling); a pooling runner converts the model to embeddings ("auto" ->
    "embed") and pools LAST unless told otherwise. ValueError for what cannot run. Resolving
    a resolved triple changes nothing (``dataclasses.replace`` re-checks a config)."""
    if runner not in RUNNERS:
        raise ValueError(f"runner must be one of {list(RUNNERS)}, got {runner!r}.")
    if convert not in CONVERTS:
        raise ValueError(f"convert must be one of {list(CONVERTS)}, got {convert!r}.")
    if runner == "auto":
        pooling = convert in ("embed", "classify") or pooler_config is not None
        runner = "pooling" if pooling else "generate"
    if runner == "generate":
        if convert not in ("auto", "none"):
            raise ValueError(f"convert={convert!r} needs runner='pooling' (--runner pooling).")
        if pooler_config is not None:
            raise ValueError("pooler_config is only used with runner='pooling'.")
        return runner, convert, None
    if convert == "classify":
        raise ValueError("convert='classify' needs a classification head (a `score` layer), "
                         "which the native models do not have; use convert='embed'.")
    if convert == "none":
        raise ValueError("runner='pooling' on a *ForCausalLM needs convert='embed' "
                         "(--convert embed).")
    config = pooler_config or PoolerConfig()
    if config.pooling_type is None:
        config = PoolerConfig("LAST", config.normalize, config.dimensions)
    return runner, "embed", config


def pooling_supports_chunking(pooler_config: PoolerConfig | None) -> bool:
    """vLLM's rule: only LAST pooling supports chunked prefill and prefix caching (the other
    types need every prompt position computed in one pass)."""
    return pooler_config is None or pooler_config.pooling_type == "LAST"


def supported_tasks(runner: str, pooler_config: PoolerConfig | None) -> tuple[str, ...]:
    """vLLM's ``supported_tasks``: what LLM and the server offer for this engine."""
    if runner != "pooling":
        return ("generate",)
    if pooler_config is not None and pooler_config.pooling_type == "ALL":
        return ("token_embed",)
    return ("embed", "token_embed")
