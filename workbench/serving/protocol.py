"""Pydantic models of the OpenAI-compatible API (the fields vLLM's server accepts that the
engine supports), and their conversion to :class:`SamplingParams`."""

from __future__ import annotations

import time
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from workbench.sampling_params import SamplingParams


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="allow")  # unknown OpenAI fields are ignored, as vLLM does


class StreamOptions(OpenAIModel):
    include_usage: bool = False


class _SamplingFields(OpenAIModel):
    """Fields shared by completions and chat; ``None`` means SamplingParams' default."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    n: int = 1
    stop: Union[str, list[str], None] = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """Build SamplingParams (raises its ValueError, naming the field, on a bad value)."""
        optional = {
            name: getattr(self, name)
            for name in (
                "temperature", "top_p", "top_k", "min_p", "presence_penalty",
                "frequency_penalty", "repetition_penalty",
            )
            if getattr(self, name) is not None
        }
        return SamplingParams(
            n=self.n,
            max_tokens=max_tokens,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            seed=self.seed,
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            **optional,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingFields):
    """POST /v1/completions. ``prompt`` is one text or one list of token ids."""

    prompt: Union[str, list[int], list[str], list[list[int]]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False

    def to_sampling_params(self) -> SamplingParams:
        return self._sampling_params(self.max_tokens, self.logprobs)


class ContentPart(OpenAIModel):
    type: str = "text"
    text: str = ""


class ChatMessage(OpenAIModel):
    role: str
    content: Union[str, list[ContentPart], None] = None

    def text(self) -> str:
        """The message content as one string (text parts joined, as vLLM's "string" format)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(p.text for p in self.content if p.type == "text")


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions. ``max_completion_tokens`` wins over ``max_tokens``; with
    neither, the rest of the context is the limit."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    add_generation_prompt: bool = True
    chat_template: str | None = None

    def to_sampling_params(self) -> SamplingParams:
        max_tokens = (
            self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        )
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling_params(max_tokens, logprobs)


class TokenizeRequest(OpenAIModel):
    """POST /tokenize: a text (``add_special_tokens`` as the completions API) or a chat."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(OpenAIModel):
    model: str | None = None
    tokens: list[int]


# ---------------------------------------------------------------------------- responses
class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    object: Literal["error"] = "error"
    error: ErrorInfo


class CompletionLogprobs(BaseModel):
    """Completions-API logprobs; ``text_offset`` counts characters from the start of the
    choice's text (of the whole completion, also in stream chunks)."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: Union[int, str, None] = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class ChatResponseMessage(BaseModel):
    role: str = "assistant"
    content: str = ""


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: Union[int, str, None] = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class ChatStreamChoice(BaseModel):
    index: int
    delta: dict[str, str]  # {"role": "assistant", "content": ""} first, then {"content": text}
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: Union[int, str, None] = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "workbench"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def dump(model: BaseModel) -> dict[str, Any]:
    """JSON-ready dict of a response model."""
    return model.model_dump(mode="json")
