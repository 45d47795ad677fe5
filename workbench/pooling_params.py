"""PoolingParams: what a pooling request (an embedding) asks of the pooler (vLLM's names).

Torch-free: the scheduler reads it to treat the request as prefill-only.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

#: vLLM's pooling tasks this engine runs: one vector per prompt ("embed"), one per token
#: ("token_embed").
POOLING_TASKS = ("embed", "token_embed")

#: The parameters each task accepts (vLLM's ``valid_parameters``).
_VALID = {"embed": ("dimensions", "normalize"), "token_embed": ("dimensions", "normalize")}
_ALL = ("dimensions", "normalize", "use_activation")


@dataclass
class PoolingParams:
    """One pooling request's parameters.

    ``truncate_prompt_tokens``: keep only the last k prompt tokens (-1: the model's
    ``max_model_len``; None: no truncation). ``dimensions``: keep the first k dimensions of
    the embedding (matryoshka models only), before normalizing. ``normalize``: L2-normalize
    (default: the PoolerConfig's, else True). ``task`` is set by :meth:`verify`.
    ``skip_reading_prefix_cache``: recompute the whole prompt (a per-token output needs every
    position's hidden state); set by :meth:`verify` for "token_embed".
    """

    truncate_prompt_tokens: int | None = None
    dimensions: int | None = None
    normalize: bool | None = None
    use_activation: bool | None = None
    task: str | None = None
    skip_reading_prefix_cache: bool | None = None
    #: Internal (set by :meth:`verify`): how the runner pools this request, LAST / MEAN / CLS
    #: (the PoolerConfig's, for "embed") or ALL ("token_embed").
    pooling_type: str | None = None

    def __post_init__(self) -> None:
        t = self.truncate_prompt_tokens
        if t is not None and (isinstance(t, bool) or not isinstance(t, int) or t < -1):
            raise ValueError(f"truncate_prompt_tokens must be an int >= -1 or None, got {t!r}.")
        if self.task is not None and self.task not in POOLING_TASKS:
            raise ValueError(f"Unknown pooling task: {self.task}")

    def verify(self, task: str, pooler_config=None, *, model_name: str = "",
               is_matryoshka: bool = False, matryoshka_dimensions: list[int] | None = None) -> None:
        """Fix the task and fill the defaults, in vLLM's order and words: the task may not be
        overwritten; the PoolerConfig's ``normalize`` / ``dimensions`` fill unset fields;
        ``normalize`` defaults to True; ``dimensions`` needs a matryoshka model (and one of its
        listed sizes, when it lists them); a parameter the task does not take is refused."""
        if task not in POOLING_TASKS:
            raise ValueError(f"Unknown pooling task: {task}")
        if self.task is None:
            self.task = task
        elif self.task != task:
            raise ValueError(f"You cannot overwrite self.task={self.task!r} with task={task!r}!")
        if pooler_config is not None:
            for name in _VALID[task]:
                if getattr(self, name) is None and getattr(pooler_config, name, None) is not None:
                    setattr(self, name, getattr(pooler_config, name))
        pooling_type = getattr(pooler_config, "pooling_type", None) or "LAST"
        self.pooling_type = "ALL" if task == "token_embed" else pooling_type
        if self.skip_reading_prefix_cache is None:
            # a prefix hit leaves positions uncomputed: only LAST pools without them
            self.skip_reading_prefix_cache = self.pooling_type != "LAST"
        if self.normalize is None:
            self.normalize = True
        if self.dimensions is not None:
            if not is_matryoshka:
                raise ValueError(f'Model "{model_name}" does not support matryoshka representation, '
                                 "changing output dimensions will lead to poor results.")
            if matryoshka_dimensions is not None:
                if self.dimensions not in matryoshka_dimensions:
                    raise ValueError(f'Model "{model_name}" only supports {matryoshka_dimensions} '
                                     "matryoshka dimensions, use other output dimensions will lead "
                                     "to poor results.")
            elif self.dimensions < 1:
                raise ValueError("Dimensions must be greater than 0")
        invalid = [k for k in _ALL if k not in _VALID[task] and getattr(self, k) is not None]
        if invalid:
            raise ValueError(f"Task {task} only supports {list(_VALID[task])} parameters, "
                             f"does not support {invalid} parameters")

    def clone(self) -> PoolingParams:
        return PoolingParams(**{f.name: getattr(self, f.name) for f in fields(self)})

    def __repr__(self) -> str:
        return (f"PoolingParams(task={self.task}, normalize={self.normalize}, "
                f"dimensions={self.dimensions}, truncate_prompt_tokens={self.truncate_prompt_tokens})")
