"""Request and response bodies of the pooling endpoints (vLLM's names and fields):
``/v1/embeddings``, ``/pooling``, ``/score`` and ``/rerank``."""

from __future__ import annotations

import time
from typing import Literal, Optional, Union

from pydantic import BaseModel, Field

from workbench.entrypoints.openai.protocol import OpenAIModel
from workbench.entrypoints.openai.responses import UsageInfo
from workbench.pooling_params import PoolingParams

PromptInput = Union[str, list[str], list[int], list[list[int]]]


class _PoolingFields(OpenAIModel):
    """What every pooling request may carry (vLLM's ``PoolingBasicRequestMixin``)."""

    model: Optional[str] = None
    user: Optional[str] = None
    truncate_prompt_tokens: Optional[int] = Field(default=None, ge=-1)
    add_special_tokens: bool = True
    priority: int = 0
    request_id: Optional[str] = None


class EmbeddingRequest(_PoolingFields):
    """``POST /v1/embeddings`` (vLLM's EmbeddingCompletionRequest; chat-style ``messages``
    are not taken here)."""

    input: PromptInput
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Optional[int] = None
    normalize: Optional[bool] = None

    def to_pooling_params(self) -> PoolingParams:
        return PoolingParams(truncate_prompt_tokens=self.truncate_prompt_tokens,
                             dimensions=self.dimensions, normalize=self.normalize)


class PoolingRequest(EmbeddingRequest):
    """``POST /pooling``: ``task`` "embed" or "token_embed" (default: "token_embed", every
    token's vector, as vLLM picks for an embedding model)."""

    task: Optional[str] = None

    def to_pooling_params(self) -> PoolingParams:
        params = super().to_pooling_params()
        params.task = self.task
        return params


class ScoreRequest(_PoolingFields):
    """``POST /score``: ``text_1`` against each of ``text_2`` (1:1, 1:N or N:N)."""

    text_1: Union[str, list[str]]
    text_2: Union[str, list[str]]

    def to_pooling_params(self) -> PoolingParams:
        return PoolingParams(truncate_prompt_tokens=self.truncate_prompt_tokens)


class RerankRequest(_PoolingFields):
    """``POST /rerank``: the documents ordered by their score against ``query``; ``top_n``
    (0: all) keeps the best."""

    query: str
    documents: list[str]
    top_n: int = Field(default=0, ge=0)

    def to_pooling_params(self) -> PoolingParams:
        return PoolingParams(truncate_prompt_tokens=self.truncate_prompt_tokens)


def _now() -> int:
    return int(time.time())


class EmbeddingResponseData(BaseModel):
    index: int
    object: str = "embedding"
    embedding: Union[list[float], str]


class EmbeddingResponse(BaseModel):
    id: str
    object: str = "list"
    created: int = Field(default_factory=_now)
    model: str
    data: list[EmbeddingResponseData]
    usage: UsageInfo


class PoolingResponseData(BaseModel):
    index: int
    object: str = "pooling"
    data: Union[list[list[float]], list[float], str]


class PoolingResponse(BaseModel):
    id: str
    object: str = "list"
    created: int = Field(default_factory=_now)
    model: str
    data: list[PoolingResponseData]
    usage: UsageInfo


class ScoreResponseData(BaseModel):
    index: int
    object: str = "score"
    score: float


class ScoreResponse(BaseModel):
    id: str
    object: str = "list"
    created: int = Field(default_factory=_now)
    model: str
    data: list[ScoreResponseData]
    usage: UsageInfo


class RerankDocument(BaseModel):
    text: str


class RerankResult(BaseModel):
    index: int
    document: RerankDocument
    relevance_score: float


class RerankUsage(BaseModel):
    total_tokens: int


class RerankResponse(BaseModel):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]
