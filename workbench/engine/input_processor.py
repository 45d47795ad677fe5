"""Input processing: prompts and chat messages -> validated token ids and, once per request,
an :class:`~workbench.engine.engine_core_request.EngineCoreRequest` (vLLM's wording)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, Union

from workbench.core.sched.policies import FCFSPolicy, SchedulingPolicy
from workbench.engine.engine_core_request import EngineCoreRequest
from workbench.lora.request import LoRARequest
from workbench.metrics.tracing import check_trace_headers
from workbench.config import StructuredOutputsConfig
from workbench.sampling_params import SamplingParams, check_logprobs
from workbench.structured_output.backends import grammar_key

#: A prompt as vLLM accepts it: text, a list of token ids, or {"prompt_token_ids": [...]} / {"prompt": "..."}.
PromptType = Union[str, Sequence[int], Mapping[str, Any]]


class ChatTemplateError(ValueError):
    """The chat template could not render the conversation (its own message kept)."""


class InputProcessor:
    """Tokenizes prompts, renders chats and validates a request against the model.

    Invariant of every processed request: ``0 < len(prompt_token_ids) < max_model_len``, every
    token id (prompt, ``logit_bias``, ``allowed_token_ids``) is below ``vocab_size``,
    ``logprobs`` and ``prompt_logprobs`` are at most ``max_logprobs``, ``bad_words`` are
    tokenized into ``bad_words_token_ids`` and ``max_tokens`` is filled in when it was None
    (the rest of the context, as vLLM). ``prompt + max_tokens`` beyond the context is *not*
    an error here (offline, the engine stops at the context with "length"); the server asks
    :meth:`check_context_length` for vLLM's 400.

    Its limits (``max_model_len``, ``vocab_size``, ``max_logprobs``) never change; in a served
    engine its methods run on AsyncLLM's input thread, never on the engine thread.
    """

    def __init__(self, tokenizer, max_model_len: int, vocab_size: int, max_logprobs: int = 20,
                 *, eos_token_ids: Sequence[int] = (), policy: SchedulingPolicy | None = None,
                 logits_processors: Sequence[type] = (), enable_lora: bool = False,
                 structured_outputs_config: StructuredOutputsConfig | None = None) -> None:
        """``eos_token_ids``: the model's (generation_config.json); ``policy``: the engine's
        scheduling policy, which decides whether a non-zero priority is accepted;
        ``logits_processors``: the engine's custom processor classes, whose
        ``validate_params`` each request's parameters must pass; ``structured_outputs_config``:
        the engine's, whose backend must accept a constraint."""
        self.structured_outputs_config = structured_outputs_config or StructuredOutputsConfig()
        self.tokenizer = tokenizer
        self.logits_processors = tuple(logits_processors)
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.max_logprobs = max_logprobs
        self.policy = policy or FCFSPolicy()
        #: Whether a request may name a LoRA adapter (vLLM's ValueError otherwise).
        self.enable_lora = enable_lora
        # The tokenizer's eos ends a request; the model's other eos ids join each request's
        # stop_token_ids (as vLLM does), unless it ignores eos.
        eos = tokenizer.eos_token_id
        self.eos_token_id = eos if eos is not None or not eos_token_ids else eos_token_ids[0]
        self._extra_eos_ids = [t for t in eos_token_ids if t != self.eos_token_id]

    def process_inputs(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | None = None,
        *,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
        tokenization_kwargs: Mapping[str, Any] | None = None,
        trace_headers: Mapping[str, str] | None = None,
        priority: int = 0,
        serving: bool = False,
    ) -> EngineCoreRequest:
        """The request processed once (vLLM's ``process_inputs``): tokenized, truncated,
        validated and completed. Raises ValueError naming the field, TypeError for an argument
        of the wrong type (``request_id`` not a string, ``params`` not a SamplingParams, the
        prompt); ``tokenization_kwargs`` may hold ``add_special_tokens``. ``serving``: the
        OpenAI server's prompt-length rule and wording instead of the engine's (see
        :meth:`validate`)."""
        check_request_id(request_id)
        # vLLM V1's InputProcessor._validate_params: params must be SamplingParams or
        # PoolingParams, else TypeError (the seed's LLMEngine said ValueError; V1 says TypeError).
        # There is no pooling here, so SamplingParams it is: never a silent default.
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams (PoolingParams are not supported "
                            f"here), got {type(params).__name__}.")
        if lora_request is not None:
            if not self.enable_lora:
                raise ValueError(f"Got lora_request {lora_request} but LoRA is not enabled!")
            if not isinstance(lora_request, LoRARequest):
                raise ValueError(f"lora_request must be a LoRARequest, got {lora_request!r}.")
        trace_headers = check_trace_headers(trace_headers)
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"priority must be an integer, got {priority!r}.")
        if priority != 0 and not self.policy.uses_priority:  # vLLM's check and wording
            raise ValueError(f"Got priority {priority} but Priority scheduling is not enabled.")
        kwargs = dict(tokenization_kwargs or {})
        unknown = sorted(set(kwargs) - {"add_special_tokens"})
        if unknown:
            raise ValueError(f"tokenization_kwargs: unsupported keys {unknown}; "
                             "only 'add_special_tokens' is.")
        cache_salt = prompt.get("cache_salt") if isinstance(prompt, Mapping) else None
        check_cache_salt(cache_salt)
        if params.structured_outputs is not None:
            try:  # before the engine sees it: a bad schema never reaches the compiler thread
                grammar_key(params.structured_outputs, self.structured_outputs_config)
            except ValueError as exc:
                raise ValueError(f"structured_outputs: {exc}") from None
        text, token_ids, params = self.process(prompt, params, serving=serving, **kwargs)
        if not params.ignore_eos and self._extra_eos_ids:
            params = dataclasses.replace(
                params, stop_token_ids=params.stop_token_ids + self._extra_eos_ids
            )
        return EngineCoreRequest(request_id, text, token_ids, params, self.eos_token_id,
                                 arrival_time=arrival_time, priority=priority,
                                 trace_headers=trace_headers, cache_salt=cache_salt,
                                 lora_request=lora_request)

    def process(
        self, prompt: PromptType, params: SamplingParams, *, add_special_tokens: bool = True,
        serving: bool = False,
    ) -> tuple[str | None, list[int], SamplingParams]:
        """Return (prompt text or None, prompt token ids, params completed and validated).

        Raises ValueError (TypeError for a prompt of the wrong type) naming the field.
        """
        text, token_ids = self._tokenize(prompt, add_special_tokens)
        k = params.truncate_prompt_tokens
        if k is not None:
            # vLLM V1's rule (vllm/renderers/params.py TokenizeParams, which the seed's
            # "-1 -> max_model_len, then validate" became): the prompt may hold at most
            # max_model_len - max_tokens tokens (the requested max_tokens, 0 when unset);
            # -1 keeps that many, a larger k is refused in V1's words; then the usual
            # length check applies (a -1 prompt filling the whole context still fails it).
            room = self.max_model_len - (params.max_tokens or 0)
            if k > room:
                raise ValueError(
                    f"truncate_prompt_tokens={k} cannot be greater than max_model_len - "
                    f"max_tokens = {room}. Please request a smaller truncation size."
                )
            keep = room if k == -1 else k
            if len(token_ids) > keep:  # keep the last tokens (vLLM's left truncation)
                token_ids = token_ids[len(token_ids) - keep:]
                text = None if text is None else self.tokenizer.decode(token_ids)
        return text, token_ids, self.validate(token_ids, params, serving=serving)

    def validate(self, token_ids: list[int], params: SamplingParams, *,
                 serving: bool = False) -> SamplingParams:
        """``params`` completed and checked against ``token_ids`` (ValueError naming the field).

        The prompt's length: a generating request needs ``len < max_model_len`` (a position for
        its first output token). Offline (the engine's rule, vLLM V1's
        ``InputProcessor._validate_prompt_len``): longer than ``max_model_len`` gets the seed's
        "The decoder prompt (length N) is longer than the maximum model length of M. ..."; exactly
        ``max_model_len`` gets V1's "... plus the number of requested output tokens (at least 1)
        is longer than ..." (V1 rejects it: the seed let it through). ``serving``: the OpenAI
        server's rule (``OpenAIServing._validate_input``: ``>= max_model_len``, "This model's
        maximum context length is ...").
        """
        n, limit = len(token_ids), self.max_model_len
        if n == 0:
            raise ValueError("The decoder prompt cannot be empty")  # vLLM's wording
        if serving and n >= limit:
            raise ValueError(
                f"This model's maximum context length is {limit} tokens. However, your request "
                f"has {n} input tokens. Please reduce the length of the input messages."
            )
        if n > limit:
            raise ValueError(
                f"The decoder prompt (length {n}) is longer than the maximum model length of "
                f"{limit}. Make sure that `max_model_len` is no smaller than the number of text "
                "tokens."
            )
        if n == limit:  # V1: a generating request needs room for one output token
            raise ValueError(
                f"The decoder prompt (length {n}) plus the number of requested output tokens "
                f"(at least 1) is longer than the maximum model length of {limit}. Make sure "
                "that `max_model_len` is no smaller than the number of text tokens (prompt + "
                "requested output tokens)."
            )
        top = max(token_ids)
        if top >= self.vocab_size:  # vLLM's wording (negative ids: the caller's type)
            raise ValueError(f"Token id {top} is out of vocabulary")
        if min(token_ids) < 0:
            self._check_ids(token_ids, "prompt_token_ids")
        changes: dict[str, Any] = {}
        for name in ("logprobs", "prompt_logprobs"):
            check_logprobs(name, getattr(params, name), self.max_logprobs, self.vocab_size)
            if getattr(params, name) == -1:  # the whole vocabulary (vLLM)
                changes[name] = self.vocab_size
        for name in ("logit_bias", "allowed_token_ids"):
            self._check_ids(list(getattr(params, name) or ()), name)
        for cls in self.logits_processors:
            cls.validate_params(params)
        if params.max_tokens is None:
            changes["max_tokens"] = limit - n
        if params.bad_words:
            changes["bad_words_token_ids"] = self._bad_words_token_ids(params.bad_words)
        return dataclasses.replace(params, **changes) if changes else params

    def check_context_length(self, num_prompt_tokens: int, max_tokens: int | None) -> None:
        """vLLM's server check: ``prompt + max_tokens`` must fit the context (ValueError)."""
        n, limit = num_prompt_tokens, self.max_model_len
        if max_tokens is not None and n + max_tokens > limit:
            raise ValueError(
                f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. "
                f"This model's maximum context length is {limit} tokens and your request has "
                f"{n} input tokens ({max_tokens} > {limit} - {n})."
            )

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        chat_template: str | None = None,
    ) -> str:
        """Render a conversation with the tokenizer's chat template (or ``chat_template``).

        Raises ValueError for malformed messages or options, ChatTemplateError (a ValueError)
        with the template's own message when rendering fails (a role it rejects, say).
        """
        for i, m in enumerate(messages):
            if not isinstance(m, Mapping) or "role" not in m:
                raise ValueError(f"messages[{i}] must be a dict with a 'role', got {m!r}.")
        if add_generation_prompt and continue_final_message:
            raise ValueError(
                "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
            )
        if continue_final_message and (not messages or messages[-1]["role"] != "assistant"):
            raise ValueError(
                "continue_final_message requires the last message to have role 'assistant'."
            )
        if chat_template is None and not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("This tokenizer has no chat template; pass chat_template=...")
        kwargs = dict(chat_template_kwargs or {})
        # vLLM V1 (vllm/renderers/hf.py resolve_chat_template_kwargs): chat_template and
        # tokenize inside chat_template_kwargs are refused with its message.
        unexpected = {"chat_template", "tokenize"} & set(kwargs)
        if unexpected:
            raise ValueError(
                f"Found unexpected chat template kwargs from request: {sorted(unexpected)}"
            )
        reserved = {"conversation", "messages"} & set(kwargs)
        if reserved:
            raise ValueError(
                f"chat_template_kwargs may not set {sorted(reserved)}: they are request fields."
            )
        # vLLM V1 (ChatCompletionRequest.build_chat_params: merge_kwargs(chat_template_kwargs,
        # {add_generation_prompt, continue_final_message, ...})): the explicit arguments win
        # over the same keys in chat_template_kwargs (the seed let the kwargs win; V1 no more).
        kwargs.pop("add_generation_prompt", None)
        kwargs.pop("continue_final_message", None)
        try:
            return self.tokenizer.apply_chat_template(
                [dict(m) for m in messages],
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                chat_template=chat_template,
                **kwargs,
            )
        except Exception as exc:  # jinja2's TemplateError, raise_exception(), bad kwargs...
            raise ChatTemplateError(str(exc) or type(exc).__name__) from exc

    def __repr__(self) -> str:
        return (f"InputProcessor(max_model_len={self.max_model_len}, "
                f"vocab_size={self.vocab_size}, max_logprobs={self.max_logprobs})")

    def _repr_html_(self) -> str:
        from workbench.utils.reprs import html_table

        return html_table("InputProcessor", {
            "max_model_len": self.max_model_len, "vocab_size": self.vocab_size,
            "max_logprobs": self.max_logprobs,
            "chat template": "yes" if getattr(self.tokenizer, "chat_template", None) else "no",
        })

    def _tokenize(self, prompt: PromptType, add_special_tokens: bool) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self._encode(prompt, add_special_tokens)
        if isinstance(prompt, Mapping):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), self._as_ids(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return self._tokenize(prompt["prompt"], add_special_tokens)
            raise ValueError(
                "A prompt dict must have 'prompt' (text) or 'prompt_token_ids' (list of ints); "
                f"got keys {sorted(prompt)}."
            )
        if isinstance(prompt, Sequence):
            return None, self._as_ids(prompt)
        raise TypeError(
            f"prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}."
        )

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        """Token ids of ``text``. A fast tokenizer's Rust backend is called directly: it
        releases the GIL while it works (a multi-megabyte prompt does not stall the engine
        thread) and skips transformers' per-token Python bookkeeping."""
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is None:
            return self.tokenizer(text, add_special_tokens=add_special_tokens).input_ids
        (encoding,) = backend.encode_batch([text], add_special_tokens=add_special_tokens)
        return encoding.ids

    @staticmethod
    def _as_ids(ids: Sequence[int]) -> list[int]:
        ids = list(ids)
        if set(map(type, ids)) - {int}:  # one pass in C for the usual plain ints
            for t in ids:
                if isinstance(t, bool) or not isinstance(t, int):
                    raise ValueError(f"prompt_token_ids must be integers, got {t!r}.")
        return ids

    def _check_ids(self, ids: Sequence[int], name: str) -> None:
        if not ids or (min(ids) >= 0 and max(ids) < self.vocab_size):
            return
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(
                f"{name} must be integers in [0, {self.vocab_size}) (the vocabulary's token "
                f"ids), got {bad[0]!r}."
            )

    def _bad_words_token_ids(self, words: Sequence[str]) -> list[list[int]]:
        """Each bad word tokenized alone and after a space (vLLM's two spellings), unique."""
        out: list[list[int]] = []
        for word in words:
            for spelling in (word.lstrip(), " " + word.lstrip()):
                ids = self.tokenizer(spelling, add_special_tokens=False).input_ids
                if ids and ids not in out:
                    out.append(ids)
        return out


def check_request_id(request_id: object) -> None:
    """vLLM's rule (``LLMEngine.add_request``, the seed's and V1's): a request id is a string,
    TypeError in vLLM's wording otherwise; here it must also be non-empty (ValueError)."""
    if not isinstance(request_id, str):
        raise TypeError(f"request_id must be a string, got {type(request_id)}")
    if not request_id:
        raise ValueError("request_id must be a non-empty string, got ''.")


_CACHE_SALT_FORBIDDEN = frozenset("@/\\\x00")
_MAX_CACHE_SALT_LENGTH = 128


def check_cache_salt(salt: object) -> None:
    """vLLM's rule for ``cache_salt``: None, or a non-empty string of at most 128 characters
    without '@', '/', '\\' or NUL (ValueError in vLLM's wording)."""
    if salt is None:
        return
    if not isinstance(salt, str) or not salt:
        raise ValueError("Parameter 'cache_salt' must be a non-empty string if provided.")
    if len(salt) > _MAX_CACHE_SALT_LENGTH or any(c in _CACHE_SALT_FORBIDDEN for c in salt):
        raise ValueError("Parameter 'cache_salt' must be at most 128 characters and must not "
                         "contain '@', '/', '\\\\', or NUL.")
