"""EngineCoreRequest: a request after input processing, as the engine queues it (vLLM's name)."""

from __future__ import annotations

from dataclasses import dataclass

from workbench.lora.request import LoRARequest
from workbench.pooling_params import PoolingParams
from workbench.sampling_params import SamplingParams


@dataclass(frozen=True)
class EngineCoreRequest:
    """One request rendered, tokenized and validated once, by
    :meth:`~workbench.engine.input_processor.InputProcessor.process_inputs`.

    Invariants: ``prompt_token_ids`` satisfy the processor's checks (non-empty, shorter than
    the context, inside the vocabulary); ``sampling_params`` are complete (``max_tokens``
    filled in, ``bad_words_token_ids`` tokenized, the model's extra eos ids among the
    ``stop_token_ids``) and their logprob counts within the limit; ``priority`` is 0 unless the
    policy uses priority. Queuing it (``LLMEngine.add_request``) needs no tokenizer.
    """

    request_id: str
    #: The prompt's text (for outputs and echo), or None for a token prompt nobody decoded.
    prompt: str | None
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None
    #: In the engine's ``clock`` seconds; None: the moment the engine queues it.
    arrival_time: float | None = None
    priority: int = 0
    #: The caller's W3C trace context (``traceparent``, ``tracestate``) the request's span continues.
    trace_headers: dict[str, str] | None = None
    #: vLLM's ``cache_salt`` (a prompt dict's key): only requests with the same salt share
    #: prefix-cache blocks.
    cache_salt: str | None = None
    #: The adapter it runs under (None: the base model).
    lora_request: LoRARequest | None = None
    #: A pooling request's parameters, verified (vLLM's field): the request is prefill-only and
    #: ``sampling_params`` then only bound it to one step past its prompt.
    pooling_params: PoolingParams | None = None
