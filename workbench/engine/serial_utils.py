"""What crosses the ZMQ sockets between a client and its engine-core process, as msgpack by
msgspec (vLLM's ``serial_utils`` and ``EngineCoreRequestType``).

A message is a multipart frame list: its type (one byte, :class:`EngineCoreRequestType`),
then one msgpack payload. Requests travel as :class:`EngineCoreRequest` (its SamplingParams
as a map of every field, rebuilt without re-validating: the input processor validated them
once); outputs as :class:`EngineCoreOutputs`, whose ``RequestOutput``s msgspec decodes into
the dataclasses by their annotations. A utility call's arguments and result, and the stats,
are Python objects of any shape (a ``StepHistory``, a ``LoRARequest``): they ride in the
msgpack as pickle bytes, between a parent and the child it started.
"""

from __future__ import annotations

import dataclasses
import enum
import pickle
from typing import Any

import msgspec

from workbench.engine.engine_core_request import EngineCoreRequest
from workbench.lora.request import LoRARequest
from workbench.outputs import RequestOutput
from workbench.pooling_params import PoolingParams
from workbench.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams


class EngineCoreRequestType(enum.Enum):
    """The first frame of a client -> core message (vLLM's values)."""

    ADD = b"\x00"
    ABORT = b"\x01"
    UTILITY = b"\x03"
    SHUTDOWN = b"\x04"  # here: stop the busy loop and exit (vLLM signals the process instead)


class UtilityCall(msgspec.Struct, array_like=True):
    """``getattr(engine_core, method)(*args)`` in the core; ``args`` pickled."""

    call_id: int
    method: str
    args: bytes


class UtilityOutput(msgspec.Struct, array_like=True):
    """A utility call's answer: ``result`` (pickled) or ``failure`` (the exception, pickled)."""

    call_id: int
    result: bytes | None = None
    failure: bytes | None = None


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True):
    """One core -> client message: a step's outputs (in the order the step made them), a
    utility answer, the handshake's ``ready`` facts (pickled), or ``engine_dead`` (why the
    core stopped; nothing follows it). ``stats``: the step's pickled (SchedulerStats,
    IterationStats), for the client's stat loggers."""

    outputs: list[RequestOutput] = []
    stats: bytes | None = None
    utility_output: UtilityOutput | None = None
    ready: bytes | None = None
    engine_dead: str | None = None
    #: The step's PoolingRequestOutputs (their tensors), pickled; the decoder appends them to
    #: ``outputs``, so a client sees one list.
    pooling_outputs: bytes | None = None


class _RequestWire(msgspec.Struct, array_like=True):
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sampling_params: dict[str, Any]
    eos_token_id: int | None
    arrival_time: float | None
    priority: int
    trace_headers: dict[str, str] | None
    cache_salt: str | None
    lora_request: LoRARequest | None
    pooling_params: dict[str, Any] | None = None


def _params_to_wire(params: SamplingParams) -> dict[str, Any]:
    if params.logits_processors:  # callables have no msgpack form (vLLM V1 refuses them too)
        raise ValueError("logits_processors: per-request logits processors cannot be sent to an "
                         "engine core in another process; use the engine's logits_processors.")
    wire = {f.name: getattr(params, f.name) for f in dataclasses.fields(params)}
    wire["output_kind"] = params.output_kind.value
    if params.structured_outputs is not None:
        wire["structured_outputs"] = dataclasses.asdict(params.structured_outputs)
    return wire


def _params_from_wire(wire: dict[str, Any]) -> SamplingParams:
    """The SamplingParams whose fields ``wire`` holds, set as they are (no ``__post_init__``)."""
    params = SamplingParams.__new__(SamplingParams)
    wire = dict(wire, output_kind=RequestOutputKind(wire["output_kind"]),
                stop_strings=tuple(wire["stop_strings"]))
    if wire["structured_outputs"] is not None:
        wire["structured_outputs"] = StructuredOutputsParams(**wire["structured_outputs"])
    for f in dataclasses.fields(SamplingParams):
        object.__setattr__(params, f.name, wire[f.name])
    return params


class MsgpackEncoder:
    """Encodes what the client sends (requests, aborts, utility calls) and what the core
    sends (:class:`EngineCoreOutputs`)."""

    def __init__(self) -> None:
        self._encoder = msgspec.msgpack.Encoder()

    def encode_request(self, request: EngineCoreRequest) -> bytes:
        pooling = request.pooling_params
        return self._encoder.encode(_RequestWire(
            request.request_id, request.prompt, request.prompt_token_ids,
            _params_to_wire(request.sampling_params), request.eos_token_id, request.arrival_time,
            request.priority, request.trace_headers, request.cache_salt, request.lora_request,
            None if pooling is None else dataclasses.asdict(pooling)))

    def encode(self, obj: Any) -> bytes:
        if isinstance(obj, EngineCoreOutputs) and any(
                not isinstance(o, RequestOutput) for o in obj.outputs):
            pooled = [o for o in obj.outputs if not isinstance(o, RequestOutput)]
            obj = EngineCoreOutputs([o for o in obj.outputs if isinstance(o, RequestOutput)],
                                    obj.stats, obj.utility_output, obj.ready, obj.engine_dead,
                                    dumps(pooled))
        return self._encoder.encode(obj)


class MsgpackDecoder:
    """The inverse of :class:`MsgpackEncoder` for each payload type."""

    def __init__(self) -> None:
        self._request = msgspec.msgpack.Decoder(_RequestWire)
        self._ids = msgspec.msgpack.Decoder(list[str])
        self._utility = msgspec.msgpack.Decoder(UtilityCall)
        self._outputs = msgspec.msgpack.Decoder(EngineCoreOutputs)

    def decode_request(self, data: bytes) -> EngineCoreRequest:
        w = self._request.decode(data)
        return EngineCoreRequest(w.request_id, w.prompt, w.prompt_token_ids,
                                 _params_from_wire(w.sampling_params), w.eos_token_id,
                                 w.arrival_time, w.priority, w.trace_headers, w.cache_salt,
                                 w.lora_request,
                                 None if w.pooling_params is None else PoolingParams(**w.pooling_params))

    def decode_ids(self, data: bytes) -> list[str]:
        return self._ids.decode(data)

    def decode_utility(self, data: bytes) -> UtilityCall:
        return self._utility.decode(data)

    def decode_outputs(self, data: bytes) -> EngineCoreOutputs:
        outputs = self._outputs.decode(data)
        if outputs.pooling_outputs is not None:
            outputs.outputs = outputs.outputs + loads(outputs.pooling_outputs)
            outputs.pooling_outputs = None
        return outputs


def dumps(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


loads = pickle.loads
