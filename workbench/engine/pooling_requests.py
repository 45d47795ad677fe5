"""The engine's pooling requests: processed once (tokenized, truncated and length-checked as
vLLM), queued as prefill-only :class:`~workbench.request.Request`\\ s, and each one the
scheduler finishes turned into its :class:`~workbench.pooling.outputs.PoolingRequestOutput`.

A pooling request never meets the output processor (it has no tokens to detokenize): this
registry is its whole life between ``add_request`` and the step that pools it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from workbench.engine.engine_core_request import EngineCoreRequest
from workbench.engine.input_processor import InputProcessor, PromptType, check_cache_salt, check_request_id
from workbench.pooling.config import PoolerConfig
from workbench.pooling.outputs import PoolingOutput, PoolingRequestOutput
from workbench.pooling_params import PoolingParams
from workbench.request import Request
from workbench.sampling_params import SamplingParams

#: What bounds a pooling request in the scheduler: one position past its prompt (vLLM gives a
#: pooling request ``max_tokens = 1``); it never samples.
PREFILL_ONLY = SamplingParams(temperature=0.0, max_tokens=1, detokenize=False)

#: vLLM's words for the operation a too-long pooling prompt was meant for, by request kind.
OPERATIONS = {"embed": "embedding generation", "score": "score", "classify": "classification"}


def check_pooling_prompt_len(num_tokens: int, max_model_len: int, operation: str | None) -> None:
    """A pooling prompt may fill the whole context (it generates nothing). ``operation``:
    the server's wording ("embedding generation", "score"); None: the engine's."""
    if num_tokens == 0:
        raise ValueError("The decoder prompt cannot be empty")
    if num_tokens <= max_model_len:
        return
    if operation is not None:
        raise ValueError(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {num_tokens} tokens in the input for {operation}. Please reduce the "
            "length of the input.")
    raise ValueError(
        f"The decoder prompt (length {num_tokens}) is longer than the maximum model length of "
        f"{max_model_len}. Make sure that `max_model_len` is no smaller than the number of text "
        "tokens.")


def truncate_prompt(token_ids: list[int], truncate_prompt_tokens: int | None,
                    max_model_len: int) -> list[int]:
    """The last ``k`` tokens (-1: ``max_model_len``); ValueError, in vLLM's words, for a ``k``
    above ``max_model_len``."""
    k = truncate_prompt_tokens
    if k is None:
        return token_ids
    if k > max_model_len:
        raise ValueError("truncate_prompt_tokens value is greater than max_model_len. "
                         "Please, select a smaller truncation size.")
    keep = max_model_len if k == -1 else k
    return token_ids[len(token_ids) - keep:] if len(token_ids) > keep else token_ids


class PoolingRequests:
    """The pooling requests in flight, by id. ``pooler_config`` and the model's matryoshka
    facts fill and check each request's PoolingParams (:meth:`PoolingParams.verify`)."""

    def __init__(self, pooler_config: PoolerConfig | None, model_name: str,
                 hf_config: Mapping[str, Any] | None = None) -> None:
        self.pooler_config = pooler_config
        self.model_name = model_name
        hf_config = hf_config or {}
        self.matryoshka_dimensions = hf_config.get("matryoshka_dimensions")
        self.is_matryoshka = bool(hf_config.get("is_matryoshka") or self.matryoshka_dimensions)
        self.requests: dict[str, Request] = {}
        self._prompts: dict[str, str | None] = {}

    def verify(self, params: PoolingParams, task: str | None = None) -> PoolingParams:
        """A copy of ``params`` verified for ``task`` (default: its own, else "embed")."""
        params = params.clone()
        params.verify(task or params.task or "embed", self.pooler_config,
                      model_name=self.model_name, is_matryoshka=self.is_matryoshka,
                      matryoshka_dimensions=self.matryoshka_dimensions)
        return params

    def process_inputs(self, processor: InputProcessor, request_id: str, prompt: PromptType,
                       params: PoolingParams, *, arrival_time: float | None = None,
                       lora_request=None, tokenization_kwargs: Mapping[str, Any] | None = None,
                       trace_headers: Mapping[str, str] | None = None, priority: int = 0,
                       operation: str | None = None) -> EngineCoreRequest:
        """The pooling request processed once: verified, tokenized, truncated
        (``truncate_prompt_tokens``) and length-checked (``operation``: the server's wording)."""
        check_request_id(request_id)
        if not isinstance(params, PoolingParams):
            raise TypeError(f"params must be a PoolingParams, got {type(params).__name__}.")
        if priority != 0 and not processor.policy.uses_priority:
            raise ValueError(f"Got priority {priority} but Priority scheduling is not enabled.")
        params = self.verify(params)
        add_special_tokens = dict(tokenization_kwargs or {}).get("add_special_tokens", True)
        cache_salt = prompt.get("cache_salt") if isinstance(prompt, Mapping) else None
        check_cache_salt(cache_salt)
        text, token_ids = processor._tokenize(prompt, add_special_tokens)
        kept = truncate_prompt(token_ids, params.truncate_prompt_tokens, processor.max_model_len)
        if len(kept) != len(token_ids):
            text = None if text is None else processor.tokenizer.decode(kept)
        check_pooling_prompt_len(len(kept), processor.max_model_len, operation)
        processor._check_ids(kept, "prompt_token_ids")
        return EngineCoreRequest(request_id, text, kept, PREFILL_ONLY, None,
                                 arrival_time=arrival_time, priority=priority,
                                 trace_headers=dict(trace_headers) if trace_headers else None,
                                 cache_salt=cache_salt, lora_request=lora_request,
                                 pooling_params=params)

    def add(self, request: EngineCoreRequest, scheduler, arrival_time: float) -> None:
        """Queue it (ValueError, nothing queued, if the id is in flight or it can never fit)."""
        rid = request.request_id
        if rid in self.requests:
            raise ValueError(f"request_id {rid!r} is already in flight.")
        queued = Request(rid, list(request.prompt_token_ids), PREFILL_ONLY,
                         priority=request.priority, arrival_time=arrival_time,
                         cache_salt=request.cache_salt, lora_request=request.lora_request,
                         pooling_params=request.pooling_params)
        scheduler.add_request(queued)
        self.requests[rid] = queued
        self._prompts[rid] = request.prompt

    def take_outputs(self, scheduler, pooler_output: Mapping[str, Any]
                     ) -> tuple[list[PoolingRequestOutput], dict[str, str]]:
        """(the outputs of the pooling requests the scheduler finished in this step, the step's
        other errors: ``finished_request_errors`` less theirs). A finished request the pooler
        gave nothing (its row failed) carries its error."""
        outputs: list[PoolingRequestOutput] = []
        errors = scheduler.finished_request_errors
        for rid in scheduler.finished_request_ids:
            request = self.requests.pop(rid, None)
            if request is None:
                continue
            data = pooler_output.get(rid)
            error = errors.get(rid)
            if data is None and error is None:
                error = f"request {rid!r} finished without a pooled output"
            outputs.append(PoolingRequestOutput(
                rid, None if data is None else PoolingOutput(data), request.prompt_token_ids,
                request.num_cached_tokens, True, self._prompts.pop(rid), error))
        pooled = {o.request_id for o in outputs}
        return outputs, {rid: e for rid, e in errors.items() if rid not in pooled}

    def abort(self, request_ids: Iterable[str]) -> list[PoolingRequestOutput]:
        """Forget these requests (unknown ids are ignored); returns the final output of each
        one that was in flight (no data, error "abort"): what a served stream ends with."""
        found = []
        for rid in request_ids:
            request = self.requests.pop(rid, None)
            if request is not None:
                found.append(PoolingRequestOutput(rid, None, request.prompt_token_ids,
                                                  request.num_cached_tokens, True,
                                                  self._prompts.pop(rid), "abort"))
        return found
