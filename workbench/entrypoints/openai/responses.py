"""Pydantic models of the OpenAI-compatible API's responses, chunks and errors (vLLM's
shapes, which the official ``openai`` client parses)."""

from __future__ import annotations

import time
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, Field


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: int


class ErrorResponse(BaseModel):
    """vLLM V1's error body: only ``error`` (vllm/entrypoints/openai/engine/protocol.py
    ``ErrorResponse(error: ErrorInfo)``, no top-level ``object``), as OpenAI's own."""

    error: ErrorInfo


class CompletionLogprobs(BaseModel):
    """Completions-API logprobs; ``text_offset`` counts characters from the start of the
    choice's text (of the whole completion, also in stream chunks)."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[Optional[float]] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[Optional[dict[str, float]]] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    logprob: float
    rank: Optional[int] = None
    decoded_token: Optional[str] = None


#: vLLM's ``prompt_logprobs``: per prompt position (the first is null), {token id: logprob}.
PromptLogprobs = list[Optional[dict[int, PromptLogprob]]]


def _only_when_set(default=None):
    """A field left out of the JSON while None (vLLM's ``return_token_ids`` extras)."""
    return Field(default=default, exclude_if=lambda v: v is None)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: Optional[CompletionLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Union[int, str, None] = None
    prompt_logprobs: Optional[PromptLogprobs] = None  # its prompt's, when asked (vLLM)
    # return_token_ids: the choice's tokens (a stream: each chunk's), its prompt's (first chunk)
    token_ids: Optional[list[int]] = _only_when_set()
    prompt_token_ids: Optional[list[int]] = _only_when_set()


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Optional[UsageInfo] = None
    kv_transfer_params: Optional[dict[str, Any]] = _only_when_set()  # a KV producer's (vLLM)


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: Optional[list[ChatTokenLogprob]] = None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCall(BaseModel):
    id: str  # "chatcmpl-tool-<hex>", as vLLM
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(BaseModel):
    name: Optional[str] = _only_when_set()
    arguments: Optional[str] = _only_when_set()


class DeltaToolCall(BaseModel):
    """One tool call's part of a stream chunk: its first carries ``id``, ``type`` and
    ``function.name``; the later ones fragments of ``function.arguments`` (OpenAI's deltas)."""

    index: int
    id: Optional[str] = _only_when_set()
    type: Optional[Literal["function"]] = _only_when_set()
    function: DeltaFunctionCall


class DeltaMessage(BaseModel):
    """What one stream chunk adds to a choice's message (only the set fields are sent)."""

    content: Optional[str] = _only_when_set()
    tool_calls: Optional[list[DeltaToolCall]] = _only_when_set()


class ChatResponseMessage(BaseModel):
    """The reply; ``reasoning`` (vLLM's name now) and ``reasoning_content`` (its older one,
    which DeepSeek's API uses) carry the same text when a reasoning parser runs."""

    role: str = "assistant"
    content: Optional[str] = ""
    reasoning: Optional[str] = _only_when_set()
    reasoning_content: Optional[str] = _only_when_set()
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Union[int, str, None] = None
    token_ids: Optional[list[int]] = _only_when_set()  # return_token_ids


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_logprobs: Optional[PromptLogprobs] = None
    prompt_token_ids: Optional[list[int]] = _only_when_set()  # return_token_ids
    kv_transfer_params: Optional[dict[str, Any]] = _only_when_set()  # a KV producer's (vLLM)


class ChatStreamChoice(BaseModel):
    index: int
    delta: dict[str, Any]  # {"role": "assistant", "content": ""} first, then DeltaMessages
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Union[int, str, None] = None
    token_ids: Optional[list[int]] = _only_when_set()  # return_token_ids: this chunk's


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatStreamChoice]
    usage: Optional[UsageInfo] = None
    prompt_token_ids: Optional[list[int]] = _only_when_set()  # return_token_ids: first chunk


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "workbench"
    root: Optional[str] = None
    parent: Optional[str] = None  # a LoRA adapter's base model
    max_model_len: Optional[int] = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def dump(model: BaseModel) -> dict[str, Any]:
    """JSON-ready dict of a response model."""
    return model.model_dump(mode="json")
