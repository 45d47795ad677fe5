"""The path both generation endpoints share: check a request the way vLLM's OpenAIServing does,
process each prompt once on the input thread into the EngineCoreRequest the engine queues,
run one engine request per prompt (each with ``n`` samples; choice ``i * n + j`` is prompt i,
sample j) and answer it whole (one FINAL_ONLY output per prompt) or as one SSE stream (DELTA
outputs). This event-loop code reads no engine object: only what AsyncLLM exposes.

The endpoints differ only in their :class:`ResponseFormat` (chunk and response shapes).
A request whose processing fails inside the engine (``RequestOutput.error``) answers 500, or,
streaming, an error event and ``[DONE]``; the engine and the other requests go on.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import logging
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel

from workbench.entrypoints.beam_search import beam_search_async, check_beam_width
from workbench.engine.engine_core_request import EngineCoreRequest
from workbench.engine.input_processor import PromptType
from workbench.outputs import CompletionOutput, Logprob, RequestOutput
from workbench.sampling_params import BeamSearchParams, SamplingParams
from workbench.entrypoints.openai import protocol as P
from workbench.entrypoints.openai import responses as R
from workbench.lora.request import LoRARequest
from workbench.engine.async_llm import AsyncLLM, EngineDeadError, RequestStream
from workbench.metrics.tracing import extract_trace_headers, log_tracing_disabled_warning
from workbench.entrypoints.openai.errors import APIError, error_event, unexpected_error_event
from workbench.entrypoints.openai.tool_parsers import ToolParser, ToolParserManager
from workbench.reasoning import ReasoningParser, ReasoningParserManager

logger = logging.getLogger("workbench.entrypoints.openai")


@dataclass
class PreparedPrompt:
    """A prompt processed once: the EngineCoreRequest the engine queues (its ``prompt`` text
    decoded for token prompts); ``prompt_logprobs`` arrive with its first output when the
    request asked for them; ``first_token_text`` is set for completions' echo with logprobs
    (the first prompt token has no logprob to name it)."""

    request: EngineCoreRequest
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    first_token_text: str = ""
    #: What the KV connector returned when its request finished (vLLM's response field).
    kv_transfer_params: dict | None = None

    @property
    def text(self) -> str:
        return self.request.prompt

    @property
    def token_ids(self) -> list[int]:
        return self.request.prompt_token_ids


@dataclass
class ChoiceState:
    """One choice accumulated from its outputs (choice ``index`` of prompt ``prompt``)."""

    index: int
    prompt: PreparedPrompt
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    started: bool = False  # its first chunk went out (echo and role ride on it)


class ResponseFormat:
    """How one endpoint shapes its chunks and responses (see chat.py, completion.py)."""

    def prelude(self, choices: Sequence[ChoiceState]) -> list[BaseModel]:
        """Chunks sent before any token, one per choice (chat: each choice's role)."""
        return []

    def stream_choice(self, state: ChoiceState, delta: CompletionOutput) -> BaseModel | None:
        """The chunk choice of one delta (None: nothing to say yet)."""
        raise NotImplementedError

    def chunk(self, choices: list[BaseModel], usage: R.UsageInfo | None) -> BaseModel:
        raise NotImplementedError

    def response(self, choices: Sequence[ChoiceState], usage: R.UsageInfo) -> BaseModel:
        raise NotImplementedError


def token_text(token_id: int, logprob: Logprob | None, as_token_ids: bool) -> str:
    """A token as logprobs show it: its text, or ``token_id:N`` (return_tokens_as_token_ids)."""
    if as_token_ids:
        return f"token_id:{token_id}"
    return (logprob.decoded_token if logprob is not None else None) or ""


def prompt_logprobs_json(entries: list[dict[int, Logprob] | None] | None
                         ) -> R.PromptLogprobs | None:
    """vLLM's ``prompt_logprobs``: per prompt position, {token id: logprob}."""
    if entries is None:
        return None
    return [
        None if pos is None else {
            t: R.PromptLogprob(logprob=v.logprob, rank=v.rank, decoded_token=v.decoded_token)
            for t, v in pos.items()
        }
        for pos in entries
    ]


class OpenAIServing:
    """Checks and runs generation requests for one app (vLLM's OpenAIServing, trimmed)."""

    def __init__(self, async_llm: AsyncLLM, model_name: str,
                 generation_defaults: dict[str, Any], *, enable_auto_tools: bool = False,
                 tool_parser: str | None = None) -> None:
        """``enable_auto_tools``, ``tool_parser``: vLLM's ``--enable-auto-tool-choice`` and
        ``--tool-call-parser`` (the first needs the second: ValueError, as an unknown name);
        the reasoning parser is the engine's (``EngineArgs.reasoning_parser``)."""
        if enable_auto_tools and tool_parser is None:
            raise ValueError("--enable-auto-tool-choice requires --tool-call-parser")
        self.llm = async_llm
        self.model_name = model_name
        self.max_model_len = async_llm.model_config.max_model_len
        self.defaults = generation_defaults
        self.enable_auto_tools = enable_auto_tools
        self.tool_parser: type[ToolParser] | None = None
        self.reasoning_parser: type[ReasoningParser] | None = None
        try:
            if tool_parser is not None:
                self.tool_parser = ToolParserManager.get_tool_parser(tool_parser)
            if async_llm.config.reasoning_parser is not None:
                self.reasoning_parser = ReasoningParserManager.get_reasoning_parser(
                    async_llm.config.reasoning_parser)
        except KeyError as exc:
            raise ValueError(exc.args[0]) from None
        #: The LoRA adapters served, by name: a request's ``model`` selects one (vLLM's
        #: OpenAIServingModels); ids are given in the order of loading, from 1.
        self.lora_requests: dict[str, LoRARequest] = {}
        self._lora_id_counter = itertools.count(1)
        #: vLLM's RequestLogger (``--enable-log-requests``), else None.
        self.request_logger = None

    # ------------------------------------------------------------------ LoRA adapters
    def _new_lora(self, lora_name: str, lora_path: str) -> LoRARequest:
        if lora_name in self.lora_requests or lora_name == self.model_name:
            raise APIError(400, f"The lora adapter '{lora_name}' has already been loaded.", "lora_name")
        return LoRARequest(lora_name, next(self._lora_id_counter), str(lora_path),
                           base_model_name=self.model_name)

    async def load_lora_adapter(self, lora_name: str, lora_path: str) -> LoRARequest:
        """Load an adapter on the engine thread and serve it under ``lora_name`` (vLLM's
        wording for a name in use; the engine's error, naming the file, for a bad adapter)."""
        lora = self._new_lora(lora_name, lora_path)
        try:
            await self.llm.call_utility("add_lora", lora)
        except ValueError as exc:
            raise APIError(400, str(exc), "lora_path") from exc
        self.lora_requests[lora_name] = lora
        return lora

    def add_lora_module(self, lora_name: str, lora_path: str) -> LoRARequest:
        """:meth:`load_lora_adapter` from a thread with no event loop (``--lora-modules`` at
        start-up); a bad adapter raises the engine's ValueError."""
        lora = self._new_lora(lora_name, lora_path)
        self.llm.call_utility_sync("add_lora", lora)
        self.lora_requests[lora_name] = lora
        return lora

    async def unload_lora_adapter(self, lora_name: str) -> None:
        lora = self.lora_requests.pop(lora_name, None)
        if lora is None:
            raise APIError(404, f"The lora adapter '{lora_name}' cannot be found.", "lora_name")
        await self.llm.call_utility("remove_lora", lora.lora_int_id)

    # ------------------------------------------------------------------ checks
    def check_model(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's ``model`` names (None: the base model); 404 if unknown.
        No name or an empty one is the base model (vLLM's ``_is_model_supported``)."""
        if not model or model == self.model_name:
            return None
        lora = self.lora_requests.get(model)
        if lora is None:
            raise APIError(404, f"The model `{model}` does not exist.", "model")
        return lora

    def check_request(self, req: P._CommonFields, raw: Request) -> str:
        """Model and supported fields; warn about unknown fields (priority is the input
        processor's rule). Returns the base request id: the X-Request-Id header, else the
        body's request_id, else a random one."""
        self.check_model(req.model)
        unknown = req.unknown_fields()
        if unknown:
            logger.warning("The following fields were present in the request but ignored: %s",
                           unknown)
        try:
            req.check_supported(kv_transfer=self.llm.config.kv_transfer_config is not None)
        except P.FieldError as exc:
            raise APIError.bad_request(exc) from exc
        return raw.headers.get("X-Request-Id") or req.request_id or uuid.uuid4().hex

    def trace_headers(self, raw: Request) -> dict[str, str] | None:
        """The request's W3C trace context (``traceparent``, ``tracestate``) when the engine
        traces; otherwise None, with vLLM's warning if the caller sent one."""
        headers = extract_trace_headers(raw.headers)
        if self.llm.is_tracing_enabled():
            return headers or None
        if headers:
            log_tracing_disabled_warning()
        return None

    def sampling_params(self, req: P._CommonFields, *, max_tokens: int | None,
                        logprobs: int | None, prompt_logprobs: int | None = None
                        ) -> SamplingParams:
        """The request's SamplingParams with the model's generation defaults (400 if bad)."""
        try:
            params = req.sampling_params(
                max_tokens=max_tokens, logprobs=logprobs, defaults=self.defaults,
                structured_outputs_config=self.llm.config.structured_outputs_config)
        except ValueError as exc:
            raise APIError.bad_request(exc, set(type(req).model_fields)) from exc
        if prompt_logprobs is not None and params.prompt_logprobs is None:
            params = dataclasses.replace(params, prompt_logprobs=prompt_logprobs)
        return params

    async def prepare(self, req: P._CommonFields, request_id: str,
                      prompts: Sequence[PromptType], params: SamplingParams, *,
                      requested_max_tokens: int | None,
                      trace_headers: dict[str, str] | None = None,
                      numbered: bool = True,
                      arrival_time: float | None = None) -> list[PreparedPrompt]:
        """Process every prompt once on the input thread into the engine request
        ``{request_id}-{i}`` (``numbered``, as vLLM's completions name each prompt's request)
        or ``request_id`` (chat's one prompt); check each against the context as vLLM's
        server does; cap max_tokens by the model's generation config, as vLLM.
        ``arrival_time`` (:attr:`AsyncLLM.clock`): when the HTTP request arrived.

        Two HTTP requests in flight with the same id are both served, as vLLM V1: AsyncLLM
        runs the second under a suffixed id (``AsyncLLM.add_request``), the responses and
        the ``X-Request-Id`` header keep the caller's, and each stream aborts its own."""
        fields = set(type(req).model_fields)
        if not numbered and len(prompts) != 1:
            raise ValueError("an unnumbered engine request id names one prompt")
        prepared = []
        for i, prompt in enumerate(prompts):
            engine_id = f"{request_id}-{i}" if numbered else request_id
            if req.cache_salt is not None:  # vLLM's prompt dicts carry the salt
                key = "prompt" if isinstance(prompt, str) else "prompt_token_ids"
                prompt = {key: prompt, "cache_salt": req.cache_salt}
            try:
                request = await self.llm.process_inputs(
                    engine_id, prompt, params,
                    priority=req.priority,
                    tokenization_kwargs={"add_special_tokens": req.add_special_tokens},
                    trace_headers=trace_headers, lora_request=self.check_model(req.model),
                    arrival_time=arrival_time,
                    serving=True,  # OpenAIServing's prompt-length rule and wording
                )
            except (ValueError, TypeError) as exc:
                raise APIError.bad_request(exc, fields) from exc
            try:  # pure arithmetic on the processor's fixed limit
                self.llm.input_processor.check_context_length(
                    len(request.prompt_token_ids), requested_max_tokens)
            except ValueError as exc:
                raise APIError(400, str(exc), req.max_tokens_field) from exc
            if request.prompt is None:
                text = await self.llm.decode(request.prompt_token_ids)
                request = dataclasses.replace(request, prompt=text)
            if self.request_logger is not None:
                self.request_logger.log_inputs(engine_id, request.prompt, request.prompt_token_ids,
                                               request.sampling_params, request.lora_request)
            prepared.append(PreparedPrompt(request))
        cap = self.defaults.get("max_tokens")
        if cap is not None:
            room = self.max_model_len - max(len(p.token_ids) for p in prepared)
            limit = room if requested_max_tokens is None else requested_max_tokens
            for p in prepared:
                capped = dataclasses.replace(p.request.sampling_params, max_tokens=min(cap, limit))
                p.request = dataclasses.replace(p.request, sampling_params=capped)
        return prepared

    def beam_search_params(self, req: P._CommonFields) -> BeamSearchParams:
        """vLLM's ``to_beam_search_params``: ``beam_width = n``, the request's temperature
        (else the generation config's, else 1.0); max_tokens is set per prompt. 400 when the
        ``2 * n`` logprobs a step asks for exceed the engine's max_logprobs."""
        try:
            check_beam_width(req.n, self.llm.input_processor.max_logprobs, "n")
        except ValueError as exc:
            raise APIError(400, str(exc), "n") from exc
        temperature = req.temperature if req.temperature is not None \
            else self.defaults.get("temperature", 1.0)
        try:
            return BeamSearchParams(beam_width=req.n, max_tokens=1, ignore_eos=req.ignore_eos,
                                    temperature=temperature, length_penalty=req.length_penalty,
                                    include_stop_str_in_output=req.include_stop_str_in_output)
        except ValueError as exc:
            raise APIError.bad_request(exc, set(type(req).model_fields)) from exc

    async def check_beams_fit(self, req: P._CommonFields, prompts: list[PreparedPrompt]) -> None:
        """400 before a beam search's first step when its beams could outgrow the KV cache (a
        search's step requests grow to the prompt plus ``max_tokens - 1`` tokens; the engine
        checks a plain request on arrival, and a beam step's only once it comes)."""
        for p in prompts:  # the prompt alone first, so that the error names the right field
            for field, max_tokens in (("prompt", 1), (req.max_tokens_field, p.request.sampling_params.max_tokens)):
                try:
                    await self.llm.call_utility("check_request_fits", p.request.request_id,
                                                len(p.token_ids), max_tokens)
                except ValueError as exc:
                    raise APIError(400, str(exc), field) from exc

    # ------------------------------------------------------------------ running
    async def generate(self, raw: Request, req: P._CommonFields, base_id: str,
                       prompts: list[PreparedPrompt], fmt: ResponseFormat, *,
                       echo_only: bool = False) -> Response:
        """Run the prepared prompts' engine requests and answer: a JSON response, or an SSE
        stream; the ``X-Request-Id`` header echoes ``base_id``. ``echo_only``: the generated
        tokens are dropped (completions' echo with max_tokens 0)."""
        if req.use_beam_search:
            await self.check_beams_fit(req, prompts)
        run = _BeamRun(self.llm, prompts, self.beam_search_params(req)) if req.use_beam_search \
            else _Run(self.llm, prompts)
        await run.start()
        job = _Answer(run, req, fmt, echo_only)
        headers = {"X-Request-Id": base_id}
        if req.stream:
            return _SSEResponse(job.events(), run, headers=headers)
        try:
            return await _until_disconnect(raw, job.full(), headers)
        finally:
            run.close()


class _Run:
    """The engine requests of one HTTP request (one per prompt), merged into one stream of
    ``(prompt index, RequestOutput)``. ``close()`` aborts what is unfinished."""

    def __init__(self, llm: AsyncLLM, prompts: list[PreparedPrompt]) -> None:
        self.llm, self.prompts = llm, prompts
        self.streams: list[RequestStream] = []
        self._pumps: list[asyncio.Task] = []

    async def start(self) -> None:
        try:
            for p in self.prompts:
                request = p.request
                self.streams.append(await self.llm.add_request(
                    request, request.sampling_params, request.request_id))
        except (ValueError, TypeError) as exc:
            self.close()
            raise APIError.bad_request(exc) from exc
        except BaseException:
            self.close()
            raise

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, stream: RequestStream) -> None:
            try:
                async for out in stream:
                    queue.put_nowait((i, out))
            except BaseException as exc:  # handed to the consumer (EngineDeadError...)
                queue.put_nowait((i, exc))
                if isinstance(exc, asyncio.CancelledError):
                    raise
            else:
                queue.put_nowait((i, None))

        self._pumps = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(self.streams)]
        remaining = len(self.streams)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item

    def close(self) -> None:
        """Abort every unfinished engine request of this run (idempotent)."""
        for task in self._pumps:
            task.cancel()
        for stream in self.streams:
            stream.close()


class _BeamRun(_Run):
    """``use_beam_search``: one beam search per prompt (:mod:`workbench.entrypoints.beam_search`,
    its requests named after the prompt's), each answered by one finished RequestOutput with
    a choice per beam, best first. ``close()`` cancels the searches (aborting their requests)."""

    def __init__(self, llm: AsyncLLM, prompts: list[PreparedPrompt], params: BeamSearchParams
                 ) -> None:
        super().__init__(llm, prompts)
        self.params = params
        self._tasks: list[asyncio.Task] = []

    async def start(self) -> None:
        self._tasks = [asyncio.ensure_future(self._search(p)) for p in self.prompts]

    async def _search(self, prompt: PreparedPrompt) -> RequestOutput:
        request = prompt.request
        params = dataclasses.replace(self.params, max_tokens=request.sampling_params.max_tokens)
        tokenizer = self.llm.input_processor.tokenizer
        try:
            inst, best = await beam_search_async(
                self.llm, request.prompt_token_ids, params, request.request_id,
                tokenizer.eos_token_id, cache_salt=request.cache_salt)
        except (ValueError, RuntimeError) as exc:
            if isinstance(exc, EngineDeadError):
                raise
            raise APIError(500, f"The request failed while it was processed: {exc}") from exc
        skip = request.sampling_params.skip_special_tokens
        texts = [await self.llm.run_input(tokenizer.decode, inst.text_tokens(b),
                                          skip_special_tokens=skip) for b in best]
        return inst.request_output(request.request_id, request.prompt, best, texts)

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        pending = {task: i for i, task in enumerate(self._tasks)}
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                yield pending.pop(task), task.result()

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()


class _Answer:
    """Turns a run's outputs (deltas when streaming, else each prompt's final one) into the
    endpoint's chunks or its one response."""

    def __init__(self, run: _Run, req: P._CommonFields, fmt: ResponseFormat,
                 echo_only: bool) -> None:
        self.run, self.req, self.fmt = run, req, fmt
        self.n = req.n
        self.echo_only = echo_only
        self.choices = [ChoiceState(index=k, prompt=run.prompts[k // self.n])
                        for k in range(len(run.prompts) * self.n)]

    def update(self, i: int, out: RequestOutput) -> list[tuple[ChoiceState, CompletionOutput]]:
        """Fold one output into its choices; returns the (choice, new part) pairs."""
        prompt = self.run.prompts[i]
        if out.prompt_logprobs is not None and prompt.prompt_logprobs is None:
            prompt.prompt_logprobs = out.prompt_logprobs
        if out.error is not None:
            raise APIError(500, f"The request failed while it was processed: {out.error}")
        if out.kv_transfer_params is not None:
            prompt.kv_transfer_params = out.kv_transfer_params
        pairs = []
        for c in out.outputs:
            state = self.choices[i * self.n + c.index]
            if self.echo_only:
                c = CompletionOutput(c.index, "", [], None, [] if c.logprobs is not None
                                     else None, "length" if c.finish_reason else None, None)
            state.text += c.text
            state.token_ids += c.token_ids
            state.logprobs += c.logprobs or []
            state.finish_reason, state.stop_reason = c.finish_reason, c.stop_reason
            pairs.append((state, c))
        return pairs

    def usage(self, state: ChoiceState | None = None) -> R.UsageInfo:
        """Whole-request usage; with ``state``, that choice's (continuous_usage_stats)."""
        if state is None:
            prompt = sum(len(p.token_ids) for p in self.run.prompts)
            completion = sum(len(c.token_ids) for c in self.choices)
        else:
            prompt = len(state.prompt.token_ids)
            completion = len(state.token_ids)
        return R.UsageInfo(prompt_tokens=prompt, completion_tokens=completion,
                           total_tokens=prompt + completion)

    async def full(self) -> Response:
        async for i, out in self.run.outputs():
            self.update(i, out)
        body = self.fmt.response(self.choices, self.usage())
        body.kv_transfer_params = self.run.prompts[0].kv_transfer_params  # vLLM's: the first prompt's
        return JSONResponse(R.dump(body))

    async def events(self) -> AsyncIterator[str]:
        def sse(model: BaseModel) -> str:
            # vLLM's chunks are model_dump_json(exclude_unset=True): a field the chunk never
            # set (usage without continuous_usage_stats, say) is left out, not sent as null.
            body = model.model_dump(mode="json", exclude_unset=True)
            return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

        continuous = self.req.continuous_usage_stats
        try:
            for state, chunk in zip(self.choices, self.fmt.prelude(self.choices)):
                if continuous:
                    chunk.usage = self.usage(state)
                yield sse(chunk)
            async for i, out in self.run.outputs():
                for state, delta in self.update(i, out):
                    choice = self.fmt.stream_choice(state, delta)
                    if choice is not None:
                        yield sse(self.fmt.chunk([choice], self.usage(state) if continuous
                                                 else None))
            if self.req.include_usage:
                yield sse(self.fmt.chunk([], self.usage()))
        except APIError as exc:
            yield error_event(exc.status, exc.message)
        except EngineDeadError as exc:
            yield error_event(503, str(exc))
        except Exception as exc:  # vLLM catches every Exception: an error event, then [DONE]
            logger.exception("Error in the stream of a %s request.", type(self.req).__name__)
            yield unexpected_error_event(exc)
        finally:
            self.run.close()
        yield "data: [DONE]\n\n"


async def _until_disconnect(raw: Request, work, headers: dict[str, str]) -> Response:
    """Await ``work`` unless the client disconnects first (then ``work`` is cancelled, which
    aborts its requests, and an empty 499 response is returned to nobody)."""
    task = asyncio.ensure_future(work)

    async def listen() -> None:
        while (await raw.receive())["type"] != "http.disconnect":
            pass

    listener = asyncio.ensure_future(listen())
    try:
        await asyncio.wait({task, listener}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        listener.cancel()
    if task.done():
        response = task.result()
        response.headers.update(headers)
        return response
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass
    return Response(status_code=499)


class _SSEResponse(StreamingResponse):
    """An SSE StreamingResponse that aborts its run however it ends, also when it is
    cancelled before its body generator ever ran."""

    def __init__(self, content: AsyncIterator[str], run: _Run, headers: dict[str, str]) -> None:
        super().__init__(content, media_type="text/event-stream", headers=headers)
        self.run = run

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.run.close()
