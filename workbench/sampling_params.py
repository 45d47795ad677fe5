"""SamplingParams: how one request's tokens are chosen and when it stops (vLLM's names and defaults)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, fields

_GREEDY_EPS = 1e-5


class RequestOutputKind(enum.Enum):
    """What each RequestOutput of a request carries (vLLM's names).

    CUMULATIVE: every step that produced tokens, the text and token ids so far (the default
    for ``LLMEngine.step()``). DELTA: only what is new since the last output (servers
    streaming). FINAL_ONLY: one output, when the request finishes (``LLM.generate``).
    """

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass
class SamplingParams:
    """Per-request sampling and stopping parameters.

    Every field is validated at construction; a bad value raises ``ValueError`` naming
    the field, the value and the allowed range. ``temperature == 0`` means greedy.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1, vLLM's old spelling) disables top-k
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    stop_strings: tuple[str, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.stop is None:
            stops: tuple[str, ...] = ()
        elif isinstance(self.stop, str):
            stops = (self.stop,)
        else:
            stops = tuple(self.stop)
        for s in stops:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop must be a non-empty string or a list of them, got {s!r}.")
        self.stop_strings = stops
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        def bad(name: str, rule: str) -> ValueError:
            return ValueError(f"{name} must be {rule}, got {getattr(self, name)!r}.")

        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", "an integer >= 1")
        if self.temperature < 0.0:
            raise bad("temperature", "non-negative (0 means greedy)")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad("top_k", "an integer >= 0 (0 or -1 disables it)")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "in [0, 1]")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad("seed", "an integer or None")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise bad("max_tokens", "an integer >= 1 or None")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", "an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens={self.max_tokens}, got {self.min_tokens}."
            )
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", "in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", "in [-2, 2]")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise bad("repetition_penalty", "in (0, 2]")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or self.logprobs < 0):
            raise bad("logprobs", "an integer >= 0 or None")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "a list of non-negative token ids")

    @property
    def greedy(self) -> bool:
        """True when the argmax is taken (temperature 0, as vLLM treats values below 1e-5)."""
        return self.temperature < _GREEDY_EPS

    def __repr__(self) -> str:
        defaults = SamplingParams()
        parts = [
            f"{f.name}={getattr(self, f.name)!r}"
            for f in fields(self)
            if f.init and getattr(self, f.name) != getattr(defaults, f.name)
        ]
        return f"SamplingParams({', '.join(parts)})"
