"""Input processing: prompts and chat messages -> validated token ids (vLLM's serving-layer wording)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, Union

from workbench.sampling_params import SamplingParams

#: A prompt as vLLM accepts it: text, a list of token ids, or {"prompt_token_ids": [...]} / {"prompt": "..."}.
PromptType = Union[str, Sequence[int], Mapping[str, Any]]


class InputProcessor:
    """Tokenizes prompts and checks them against the model's context length.

    Invariant of every accepted request: ``0 < len(prompt_token_ids) < max_model_len`` and
    ``len(prompt_token_ids) + max_tokens <= max_model_len`` (``max_tokens`` is filled in
    when it was None, as vLLM does for completions).
    """

    def __init__(self, tokenizer, max_model_len: int, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size

    def process(
        self, prompt: PromptType, params: SamplingParams
    ) -> tuple[str | None, list[int], SamplingParams]:
        """Return (prompt text or None, prompt token ids, params with max_tokens resolved)."""
        text, token_ids = self._tokenize(prompt)
        return text, token_ids, self.validate(token_ids, params)

    def validate(self, token_ids: list[int], params: SamplingParams) -> SamplingParams:
        n, limit = len(token_ids), self.max_model_len
        if n == 0:
            raise ValueError("The prompt is empty: it must contain at least one token.")
        if n >= limit:
            raise ValueError(
                f"This model's maximum context length is {limit} tokens. However, your request "
                f"has {n} input tokens. Please reduce the length of the input messages."
            )
        if params.max_tokens is None:
            return dataclasses.replace(params, max_tokens=limit - n)
        if n + params.max_tokens > limit:
            raise ValueError(
                f"'max_tokens' or 'max_completion_tokens' is too large: {params.max_tokens}. "
                f"This model's maximum context length is {limit} tokens and your request has "
                f"{n} input tokens ({params.max_tokens} > {limit} - {n})."
            )
        return params

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer(prompt).input_ids
        if isinstance(prompt, Mapping):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), self._check_ids(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return self._tokenize(prompt["prompt"])
            raise ValueError(
                "A prompt dict must have 'prompt' (text) or 'prompt_token_ids' (list of ints); "
                f"got keys {sorted(prompt)}."
            )
        if isinstance(prompt, Sequence):
            return None, self._check_ids(prompt)
        raise TypeError(
            f"prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}."
        )

    def _check_ids(self, ids: Sequence[int]) -> list[int]:
        ids = list(ids)
        for t in ids:
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size:
                raise ValueError(
                    f"prompt_token_ids must be integers in [0, {self.vocab_size}), got {t!r}."
                )
        return ids

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, str]],
        *,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
    ) -> str:
        """Render a conversation with the tokenizer's chat template (or ``chat_template``)."""
        for i, m in enumerate(messages):
            if not isinstance(m, Mapping) or "role" not in m or "content" not in m:
                raise ValueError(
                    f"messages[{i}] must be a dict with 'role' and 'content', got {m!r}."
                )
        if chat_template is None and not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("This tokenizer has no chat template; pass chat_template=...")
        return self.tokenizer.apply_chat_template(
            list(messages),
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            chat_template=chat_template,
        )
