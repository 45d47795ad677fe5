"""SamplingParams: how one request's tokens are chosen and when it stops (vLLM's names and defaults)."""

from __future__ import annotations

import enum
import math
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

_GREEDY_EPS = 1e-5
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1  # vLLM's range for seed (torch.int64's)
_MAX_LOGIT_BIAS = 100.0  # OpenAI's and vLLM's limit on |logit_bias| values

#: vLLM V0's per-request logits processor: ``(output_token_ids, logits[vocab]) -> logits``.
#: vLLM's per-request logits processor: ``fn(output_token_ids, logits)`` or, when it takes three
#: parameters, ``fn(prompt_token_ids, output_token_ids, logits)``; it returns the row's logits.
LogitsProcessor = (Callable[[list[int], "torch.Tensor"], "torch.Tensor"]
                   | Callable[[list[int], list[int], "torch.Tensor"], "torch.Tensor"])


@dataclass(frozen=True)
class StructuredOutputsParams:
    """vLLM's constraint on a request's output: exactly one of ``json`` (a JSON schema, as a
    dict or its text), ``regex``, ``choice`` (one of these strings), ``grammar`` (EBNF, or Lark
    when no line has ``::=``, vLLM's rule), ``json_object`` (any JSON object) or
    ``structural_tag`` (xgrammar's structural tag as JSON text: ``{"type": "structural_tag",
    "format": ...}``, or vLLM's older ``{"structures": [{"begin", "schema", "end"}],
    "triggers": [...]}``). ``disable_any_whitespace``: JSON without free whitespace;
    ``whitespace_pattern``: the regex of JSON's whitespace (the guidance backend only);
    ``disable_additional_properties``: JSON objects without properties the schema does not
    name (the guidance backend; xgrammar never adds them); ``disable_fallback``: no second
    backend when the engine's backend is "auto" and xgrammar refuses the constraint.
    Raises ValueError in vLLM's words otherwise.
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None

    def __post_init__(self) -> None:
        count = sum(getattr(self, name) is not None for name in _CONSTRAINTS)
        if count > 1:
            raise ValueError("You can only use one kind of structured outputs constraint but "
                             f"multiple are specified: {self.__dict__}")
        if count < 1:
            raise ValueError("You must use one kind of structured outputs constraint but none "
                             f"are specified: {self.__dict__}")
        if self.choice is not None:
            if isinstance(self.choice, str) or not self.choice or any(
                    not isinstance(c, str) for c in self.choice):
                raise ValueError(f"structured_outputs.choice must be a non-empty list of "
                                 f"strings, got {self.choice!r}.")
            object.__setattr__(self, "choice", list(self.choice))
        for name in ("regex", "grammar", "structural_tag", "whitespace_pattern"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise ValueError(f"structured_outputs.{name} must be a string, got "
                                 f"{getattr(self, name)!r}.")
        if self.grammar is not None and not self.grammar.strip():
            raise ValueError("structured_outputs.grammar cannot be an empty string")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError(f"structured_outputs.json must be a JSON schema (a dict or its "
                             f"text), got {self.json!r}.")

    @property
    def kind(self) -> str:
        """The constraint's name: "json", "regex", "choice", "grammar", "json_object" or
        "structural_tag"."""
        return next(name for name in _CONSTRAINTS if getattr(self, name) is not None)


_CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


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
    the field, the value and the allowed range (floats must be finite). ``temperature == 0``
    means greedy. What needs the model (token ids below the vocabulary size, ``logprobs``
    below ``max_logprobs``, ``bad_words`` tokenized into ``bad_words_token_ids``) is checked
    by :class:`~workbench.engine.input_processor.InputProcessor` when the request is added.

    ``logit_bias`` ({token id: bias in [-100, 100]}) is added to the logits;
    ``allowed_token_ids`` masks every other token; ``bad_words`` bans the last token of each
    word's tokenization when the tokens before it were just generated; ``logits_processors``
    are called per step on the request's logits row as vLLM calls them: one that takes three
    parameters as ``fn(prompt_token_ids, output_token_ids, logits)``, any other as
    ``fn(output_token_ids, logits)``; each returns the row (for notebook experiments).
    ``prompt_logprobs`` asks for the prompt tokens' logprobs. ``truncate_prompt_tokens`` keeps
    only the last k prompt tokens (-1: as many as ``max_model_len - max_tokens`` allows, vLLM
    V1's rule; k above that is a ValueError).
    ``detokenize=False`` skips detokenization: outputs carry token ids and empty text.
    ``structured_outputs`` constrains every sampled token to a grammar (see
    :mod:`workbench.structured_output`); the request waits in WAITING_FOR_FSM until it is
    compiled, and ends when the grammar does.
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
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    logits_processors: list[LogitsProcessor] | None = None
    truncate_prompt_tokens: int | None = None
    detokenize: bool = True  # False: token ids only, text "" (no stop strings then)
    skip_special_tokens: bool = True
    #: Accepted for vLLM's API; as in vLLM's fast-tokenizer detokenizer (DecodeStream), the
    #: tokenizer's own decoder decides the spacing, so it changes nothing here.
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: StructuredOutputsParams | None = None
    #: vLLM's free-form extra arguments, read by custom logits processors (``vllm_xargs``).
    extra_args: dict[str, Any] | None = None
    #: Set by InputProcessor from ``bad_words`` and the tokenizer (each word with and
    #: without a leading space, as vLLM); the sampler reads only this.
    bad_words_token_ids: list[list[int]] | None = None
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
        if self.logit_bias is not None:
            self.logit_bias = _int_keyed(self.logit_bias)
        for name in ("allowed_token_ids", "bad_words", "logits_processors"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, (str, dict)):
                setattr(self, name, list(value))
        self._validate()

    def _validate(self) -> None:
        def bad(name: str, rule: str) -> ValueError:
            return ValueError(f"{name} must be {rule}, got {getattr(self, name)!r}.")

        for name in _INT_FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not (value is None or isinstance(value, int)):
                raise bad(name, "an integer")
        for name in _FLOAT_FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise bad(name, "a number")
            if not math.isfinite(value):
                raise bad(name, "a finite number")
        if self.n < 1:
            raise bad("n", "an integer >= 1")
        if self.temperature < 0.0:
            raise bad("temperature", "non-negative (0 means greedy)")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad("top_k", "an integer >= 0 (0 or -1 disables it)")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "in [0, 1]")
        if self.seed is not None and not _INT64_MIN <= self.seed <= _INT64_MAX:
            raise bad("seed", f"an integer in [{_INT64_MIN}, {_INT64_MAX}]")
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
        for name in ("logprobs", "prompt_logprobs"):
            check_logprobs(name, getattr(self, name))
        for name in ("stop_token_ids", "allowed_token_ids"):
            ids = getattr(self, name)
            if ids is not None and any(isinstance(t, bool) or not isinstance(t, int) or t < 0
                                       for t in ids):
                raise bad(name, "a list of non-negative token ids")
        if not isinstance(self.detokenize, bool):
            raise bad("detokenize", "a bool")
        if not self.detokenize and self.stop_strings:
            raise ValueError("stop strings are only supported when detokenize is True, got "
                             f"stop={list(self.stop_strings)!r} with detokenize=False.")
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise bad("allowed_token_ids", "a non-empty list (or None)")
        if self.truncate_prompt_tokens is not None and not (
            self.truncate_prompt_tokens >= 1 or self.truncate_prompt_tokens == -1
        ):
            raise bad("truncate_prompt_tokens", "an integer >= 1, or -1 (the model's context)")
        for token, bias in (self.logit_bias or {}).items():
            if token < 0:
                raise bad("logit_bias", "a dict of non-negative token ids to biases")
            if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not (
                math.isfinite(bias) and -_MAX_LOGIT_BIAS <= bias <= _MAX_LOGIT_BIAS
            ):
                raise ValueError(
                    f"logit_bias values must be numbers in [-100, 100], got {bias!r} for "
                    f"token {token}."
                )
        if self.bad_words is not None and any(not isinstance(w, str) or not w.strip()
                                              for w in self.bad_words):
            raise bad("bad_words", "a list of non-blank strings")
        if self.logits_processors is not None and any(
            not callable(fn) for fn in self.logits_processors
        ):
            raise bad("logits_processors", "a list of callables (output_token_ids, logits) or "
                      "(prompt_token_ids, output_token_ids, logits)")
        if self.extra_args is not None and not isinstance(self.extra_args, dict):
            raise bad("extra_args", "a dict or None")
        if self.structured_outputs is not None and not isinstance(
                self.structured_outputs, StructuredOutputsParams):
            raise bad("structured_outputs", "a StructuredOutputsParams or None")

    @property
    def greedy(self) -> bool:
        """True when the argmax is taken (temperature 0, as vLLM treats values below 1e-5)."""
        return self.temperature < _GREEDY_EPS

    def _changed(self) -> dict[str, str]:
        """The fields that differ from vLLM's defaults, as plain text."""
        defaults = SamplingParams()
        return {
            f.name: _plain(getattr(self, f.name))
            for f in fields(self)
            if f.init and f.name != "bad_words_token_ids"
            and getattr(self, f.name) != getattr(defaults, f.name)
        }

    def __repr__(self) -> str:
        parts = [f"{name}={value}" for name, value in self._changed().items()]
        return f"SamplingParams({', '.join(parts)})"

    def _repr_html_(self) -> str:
        from workbench.utils.reprs import html_table

        return html_table("SamplingParams (fields not at their defaults)",
                          self._changed() or {"(all defaults)": ""})


_INT_FIELDS = ("n", "top_k", "seed", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs",
               "truncate_prompt_tokens")
_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty")


def check_logprobs(name: str, value: int | None, max_logprobs: int | None = None,
                   vocab_size: int | None = None) -> None:
    """The one logprob-count rule (vLLM's): ``value`` is None, an integer >= 0, or -1 (the
    whole vocabulary, which counts as ``vocab_size``), at most ``max_logprobs`` (no upper
    limit without it, or when it is -1; -1 is checked only when ``vocab_size`` is known).
    ValueError naming ``name`` otherwise, in vLLM's wording; ``prompt_logprobs`` counts
    prompt logprobs, every other name samples'."""
    if value is None:
        return
    if value < -1:
        raise ValueError(f"{name} must be an integer >= 0 (a positive value or 0), -1 (the "
                         f"whole vocabulary) or None, got {value!r}.")
    count = vocab_size if value == -1 else value
    if max_logprobs is not None and max_logprobs != -1 and count is not None \
            and count > max_logprobs:
        kind = "prompt" if name == "prompt_logprobs" else "sample"
        raise ValueError(f"{name}: Requested {kind} logprobs of {count}, which is greater "
                         f"than max allowed: {max_logprobs}")


def _int_keyed(bias: dict) -> dict[int, float]:
    """logit_bias with int keys (JSON sends "123"); a key that is no integer raises."""
    out = {}
    for key, value in dict(bias).items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise ValueError(
                f"logit_bias keys must be token ids (integers), got {key!r}."
            ) from None
        if isinstance(key, (bool, float)) or (isinstance(key, str) and str(token) != key.strip()):
            raise ValueError(f"logit_bias keys must be token ids (integers), got {key!r}.")
        out[token] = value
    return out


def _plain(value) -> str:
    """repr without addresses: callables print their qualified names."""
    if isinstance(value, list) and value and callable(value[0]):
        names = [getattr(fn, "__qualname__", type(fn).__qualname__) for fn in value]
        return f"[{', '.join(names)}]"
    return repr(value)


@dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's beam-search parameters (``LLM.beam_search``; ``use_beam_search`` over HTTP).

    Each of ``max_tokens`` steps keeps the ``beam_width`` likeliest continuations by
    cumulative logprob; finished beams are ranked by ``cum_logprob / len ** length_penalty``
    (:func:`workbench.entrypoints.beam_search.get_beam_search_score`). ``temperature`` is the
    per-beam requests' (their logprobs are raw, so it only changes which sampled token joins
    the candidates). ``ignore_eos`` keeps EOS as an ordinary token: every beam runs
    ``max_tokens`` steps. Bad values raise ValueError naming the field.
    """

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        for name in ("beam_width", "max_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}.")
        for name in ("temperature", "length_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}.")
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature!r}.")
