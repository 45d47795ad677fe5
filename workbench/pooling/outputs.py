"""What a pooling request gives back (vLLM's names): PoolingRequestOutput, and its typed
views EmbeddingRequestOutput and ScoringRequestOutput."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass
class PoolingOutput:
    """The pooler's result: ``[hidden]`` for "embed", ``[prompt tokens, hidden]`` for
    "token_embed" (float32, on the CPU)."""

    data: torch.Tensor

    def __repr__(self) -> str:
        return f"PoolingOutput(data=<tensor {list(self.data.shape)}>)"


@dataclass
class PoolingRequestOutput:
    """A finished pooling request (pooling requests have one, final, output). ``error`` is
    set when its processing raised inside a step (``outputs`` is then None)."""

    request_id: str
    outputs: PoolingOutput | None
    prompt_token_ids: list[int]
    num_cached_tokens: int = 0
    finished: bool = True
    prompt: str | None = None
    error: str | None = None

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(request_id={self.request_id!r}, outputs={self.outputs!r}, "
                f"prompt_tokens={len(self.prompt_token_ids)}, finished={self.finished}"
                + ("" if self.error is None else f", error={self.error!r}") + ")")


@dataclass
class EmbeddingOutput:
    """One embedding vector (vLLM's ``EmbeddingOutput``)."""

    embedding: list[float]

    @classmethod
    def from_base(cls, output: PoolingOutput) -> EmbeddingOutput:
        if output.data.ndim != 1:
            raise ValueError("pooled_data should be a 1-D embedding vector")
        return cls(output.data.tolist())

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)

    def __repr__(self) -> str:
        return f"EmbeddingOutput(hidden_size={self.hidden_size})"


@dataclass(repr=False)
class EmbeddingRequestOutput(PoolingRequestOutput):
    @classmethod
    def from_base(cls, output: PoolingRequestOutput) -> EmbeddingRequestOutput:
        return cls(output.request_id, EmbeddingOutput.from_base(output.outputs),
                   output.prompt_token_ids, output.num_cached_tokens, output.finished, output.prompt)


@dataclass
class ScoringOutput:
    """A similarity score (vLLM's ``ScoringOutput``): for an embedding model, the cosine
    similarity of the two texts' embeddings."""

    score: float

    def __repr__(self) -> str:
        return f"ScoringOutput(score={self.score:.6f})"


@dataclass(repr=False)
class ScoringRequestOutput(PoolingRequestOutput):
    pass
