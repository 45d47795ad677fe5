"""Request: one sequence's life inside the engine (tokens, status, progress, timestamps)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from workbench.lora.request import LoRARequest
from workbench.pooling_params import PoolingParams
from workbench.sampling_params import SamplingParams


_FINISH_REASONS = {  # by RequestStatus value
    "finished_stopped": "stop",
    "finished_length_capped": "length",
    "finished_aborted": "abort",
    "finished_error": "error",
}


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    #: vLLM's status of a request whose grammar (structured outputs) is still compiling: it
    #: sits in the waiting queue and the scheduler passes over it, until the engine's
    #: structured-output manager sets it WAITING.
    WAITING_FOR_FSM = "waiting_for_fsm"
    #: vLLM's status of a request whose prompt's KV blocks are being received from another
    #: engine (``kv_transfer_params`` with ``do_remote_prefill``): it holds the blocks they
    #: land in and sits in the waiting queue, passed over, until its connector reports them in.
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH_CAPPED = "finished_length_capped"
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_ERROR = "finished_error"  # processing this request raised; the others went on

    def __init__(self, value: str) -> None:
        #: Whether the status ends the request (the FINISHED_* ones). A plain attribute, not
        #: a property: it is read for every request every step.
        self.is_finished: bool = value in _FINISH_REASONS
        #: vLLM's finish_reason string: "stop", "length", "abort", "error" or None while unfinished.
        self.finish_reason: str | None = _FINISH_REASONS.get(value)


@dataclass(eq=False)
class Request:
    """A request as the scheduler and runner see it.

    Invariants: ``0 <= num_computed_tokens <= num_tokens``; the token at index
    ``num_tokens - 1`` is the last one known, so a step that brings
    ``num_computed_tokens`` to ``num_tokens`` samples one new token.
    ``block_hashes[i]`` is the prefix hash of full block ``i`` of ``all_token_ids``.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    eos_token_id: int | None = None
    priority: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache at first schedule
    num_preemptions: int = 0
    block_hashes: list[bytes] = field(default_factory=list)
    stop_reason: int | str | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    #: vLLM's ``cache_salt``: mixed into the first block's hash, so only requests with the
    #: same salt share prefix-cache blocks.
    cache_salt: str | None = None
    #: The LoRA adapter this request runs under (None: the base model); its name keys every
    #: block's prefix hash, so requests under different adapters share no block.
    lora_request: LoRARequest | None = None
    #: vLLM's ``spec_token_ids``: the draft tokens proposed after the latest step, which the
    #: next step schedules after the last known token for the target to verify. Never part of
    #: ``num_tokens``, never hashed; cleared when scheduled, preempted or finished.
    spec_token_ids: list[int] = field(default_factory=list)
    #: vLLM's ``is_prefill_chunk``: the chunk last scheduled for it stopped short of its last
    #: known token (it sampled nothing); drafts handed to it then are dropped.
    is_prefill_chunk: bool = False
    #: vLLM's ``num_output_placeholders`` (async scheduling): tokens a step in flight will
    #: sample for it, counted in ``num_computed_tokens`` but not yet in ``output_token_ids``.
    num_output_placeholders: int = 0
    #: A pooling request's parameters (None: it generates). A pooling request is prefill-only:
    #: the step that computes its last prompt token pools it and finishes it; it samples nothing.
    pooling_params: PoolingParams | None = None
    #: What the KV connector said when the request finished (vLLM's output ``kv_transfer_params``:
    #: how a peer engine fetches its blocks), else None.
    output_kv_transfer_params: dict | None = None

    @property
    def kv_transfer_params(self) -> dict | None:
        """vLLM's: the request's ``SamplingParams.extra_args["kv_transfer_params"]`` (None without)."""
        extra = self.sampling_params.extra_args
        return None if not extra else extra.get("kv_transfer_params")

    @property
    def lora_name(self) -> str | None:
        return None if self.lora_request is None else self.lora_request.lora_name

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_slice(self, start: int, stop: int) -> list[int]:
        """Tokens [start, stop) of prompt + output without building the whole list."""
        p = len(self.prompt_token_ids)
        if stop <= p:
            return self.prompt_token_ids[start:stop]
        if start >= p:
            return self.output_token_ids[start - p : stop - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: stop - p]

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"prompt={self.num_prompt_tokens}, output={self.num_output_tokens}, "
            f"computed={self.num_computed_tokens}, priority={self.priority})"
        )
