"""The pooling endpoints through vLLM's ServeContext pipeline (seed 002's ``OpenAIServing``):
``handle(ctx)`` runs ``_check_model`` -> ``_validate_request`` -> ``_preprocess`` ->
``_prepare_generators`` -> ``_collect_batch`` -> ``_build_response``, and the first step that
returns an error answers. Subclasses fill in ``_preprocess`` (prompts) and ``_build_response``:
:class:`ServingEmbedding` (``/v1/embeddings``), :class:`ServingPooling` (``/pooling``),
:class:`ServingScores` (``/score``, ``/rerank``: cosine similarity of embeddings, as vLLM
scores with an embedding model).

Prompts are processed (tokenized, truncated, length-checked in vLLM's words) on AsyncLLM's
input thread; engine request ``i`` of a request is ``f"{request_id}-{i}"``, as vLLM's.
"""

from __future__ import annotations

import asyncio
import base64
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from workbench.engine.async_llm import AsyncLLM
from workbench.engine.pooling_requests import OPERATIONS, PoolingRequests
from workbench.entrypoints.llm_pooling import cosine_scores, validate_score_input_lens
from workbench.entrypoints.openai import pooling_protocol as PP
from workbench.entrypoints.openai.errors import APIError
from workbench.entrypoints.openai.load_tracking import load_aware_call
from workbench.entrypoints.openai.responses import UsageInfo, dump
from workbench.entrypoints.openai.serving import OpenAIServing, _until_disconnect
from workbench.pooling.config import supported_tasks
from workbench.pooling.outputs import PoolingRequestOutput


@dataclass
class ServeContext:
    """One HTTP request's way through the pipeline (vLLM's ServeContext)."""

    request: Any
    raw_request: Request | None
    model_name: str
    request_id: str
    lora_request: Any = None
    #: The processed prompts (EngineCoreRequests), in input order.
    engine_prompts: list | None = None
    #: Each prompt's stream, in input order.
    result_generator: list | None = None
    final_res_batch: list[PoolingRequestOutput] = field(default_factory=list)
    #: Scores: how many of ``engine_prompts`` are first texts (queries); the rest are paired.
    num_first: int = 0


class PoolingServing:
    """The pipeline (see the module docstring). ``task``: the pooling task this endpoint
    runs; ``api_name``: how a refusal names it ("The model does not support ...")."""

    request_id_prefix = "pool"
    task = "embed"
    api_name = "Pooling API"
    operation = OPERATIONS["embed"]

    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving
        self.llm: AsyncLLM = serving.llm
        config = self.llm.config
        self.supported_tasks = supported_tasks(config.runner, config.pooler_config)
        self.max_model_len = serving.max_model_len
        self.pooling = PoolingRequests(config.pooler_config, serving.model_name,
                                       self.llm.model_config.hf_config)

    async def __call__(self, request: Any, raw: Request) -> Response:
        base_id = raw.headers.get("X-Request-Id") or request.request_id or uuid.uuid4().hex
        ctx = ServeContext(request, raw, self.serving.model_name,
                           f"{self.request_id_prefix}-{base_id}")
        return await _until_disconnect(raw, self.handle(ctx), {"X-Request-Id": base_id})

    async def handle(self, ctx: ServeContext) -> Response:
        async for response in self._pipeline(ctx):
            if isinstance(response, APIError):
                raise response
            return JSONResponse(dump(response))
        raise APIError(500, "No response yielded from pipeline")

    async def _pipeline(self, ctx: ServeContext):
        try:
            for stage in (self._check_model, self._validate_request, self._preprocess,
                          self._prepare_generators, self._collect_batch):
                error = await stage(ctx)
                if error is not None:
                    yield error
                    return
            yield self._build_response(ctx)
        finally:
            for stream in ctx.result_generator or ():
                stream.close()  # aborts what did not finish (a client gone, an error)

    # ------------------------------------------------------------------ stages
    async def _check_model(self, ctx: ServeContext) -> APIError | None:
        if self.task not in self.supported_tasks:
            return APIError(400, f"The model does not support {self.api_name}")
        try:
            ctx.lora_request = self.serving.check_model(ctx.request.model)
        except APIError as exc:
            return exc
        return None

    async def _validate_request(self, ctx: ServeContext) -> APIError | None:
        k = getattr(ctx.request, "truncate_prompt_tokens", None)
        if k is not None and k > self.max_model_len:
            return APIError(400, "truncate_prompt_tokens value is greater than max_model_len. "
                                 "Please, select a smaller truncation size.",
                            "truncate_prompt_tokens")
        return None

    def _prompts(self, ctx: ServeContext) -> list:
        """The request's prompts (str or token ids), in order."""
        value = ctx.request.input
        if isinstance(value, str) or (value and isinstance(value[0], int)):
            return [value]
        if not value:
            raise APIError(400, "input must not be empty", "input")
        return list(value)

    async def _preprocess(self, ctx: ServeContext) -> APIError | None:
        return await self._process(ctx, self._prompts(ctx))

    async def _process(self, ctx: ServeContext, prompts: Sequence) -> APIError | None:
        params = self._create_pooling_params(ctx)
        if isinstance(params, APIError):
            return params
        requests = []
        for i, prompt in enumerate(prompts):
            try:
                requests.append(await self.llm.run_input(
                    self.pooling.process_inputs, self.llm.input_processor,
                    f"{ctx.request_id}-{i}", prompt, self.pooling.verify(params, self.task),
                    lora_request=ctx.lora_request, priority=ctx.request.priority,
                    tokenization_kwargs={"add_special_tokens": ctx.request.add_special_tokens},
                    operation=self.operation))
            except (ValueError, TypeError) as exc:
                return APIError.bad_request(exc, set(type(ctx.request).model_fields))
        ctx.engine_prompts = requests
        if self.serving.request_logger is not None:  # vLLM's _log_inputs
            for r in requests:
                self.serving.request_logger.log_inputs(r.request_id, r.prompt, r.prompt_token_ids,
                                                       r.pooling_params, r.lora_request)
        return None

    def _create_pooling_params(self, ctx: ServeContext):
        if not hasattr(ctx.request, "to_pooling_params"):
            return APIError(400, "Request type does not support pooling parameters")
        try:
            return ctx.request.to_pooling_params()
        except ValueError as exc:
            return APIError.bad_request(exc, set(type(ctx.request).model_fields))

    async def _prepare_generators(self, ctx: ServeContext) -> APIError | None:
        if ctx.engine_prompts is None:
            return APIError(500, "Engine prompts not available")
        ctx.result_generator = []
        for request in ctx.engine_prompts:
            try:
                ctx.result_generator.append(
                    await self.llm.add_request(request, None, request.request_id))
            except (ValueError, TypeError) as exc:
                return APIError.bad_request(exc)
        return None

    async def _collect_batch(self, ctx: ServeContext) -> APIError | None:
        if ctx.result_generator is None:
            return APIError(500, "Result generator not available")

        async def final(stream) -> PoolingRequestOutput | None:
            last = None
            async for out in stream:
                last = out
            return last

        batch = await asyncio.gather(*(final(s) for s in ctx.result_generator))
        if any(res is None for res in batch):
            return APIError(500, "Failed to generate results for all prompts")
        failed = next((res for res in batch if res.error is not None), None)
        if failed is not None:
            return APIError(500, f"request {failed.request_id!r} failed: {failed.error}")
        ctx.final_res_batch = list(batch)
        return None

    def _build_response(self, ctx: ServeContext):
        raise APIError(500, "unimplemented endpoint")

    # ------------------------------------------------------------------ helpers
    @staticmethod
    def usage(batch: Sequence[PoolingRequestOutput]) -> UsageInfo:
        n = sum(len(res.prompt_token_ids) for res in batch)
        return UsageInfo(prompt_tokens=n, total_tokens=n)

    @staticmethod
    def encode(data, encoding_format: str):
        """A vector (or rows) as JSON floats, or base64 of its float32 little-endian bytes."""
        if encoding_format == "base64":
            return base64.b64encode(data.float().numpy().astype("<f4").tobytes()).decode()
        return data.tolist()


class ServingEmbedding(PoolingServing):
    request_id_prefix = "embd"
    api_name = "Embeddings API"

    def _build_response(self, ctx: ServeContext) -> PP.EmbeddingResponse:
        fmt = ctx.request.encoding_format
        return PP.EmbeddingResponse(
            id=ctx.request_id, model=ctx.request.model or ctx.model_name,
            data=[PP.EmbeddingResponseData(index=i, embedding=self.encode(res.outputs.data, fmt))
                  for i, res in enumerate(ctx.final_res_batch)],
            usage=self.usage(ctx.final_res_batch))


class ServingPooling(PoolingServing):
    request_id_prefix = "pool"
    api_name = "Pooling API"

    async def _check_model(self, ctx: ServeContext) -> APIError | None:
        task = ctx.request.task
        if task is None:
            task = "token_embed" if "token_embed" in self.supported_tasks else "embed"
        if task not in self.supported_tasks:
            return APIError(400, f"Task {task} is not supported, it must be one of "
                                 f"{list(self.supported_tasks)}.", "task")
        ctx.request.task, self.task_of = task, task
        return await super()._check_model(ctx)

    @property
    def task(self) -> str:  # the request's, once _check_model has resolved it
        return getattr(self, "task_of", "token_embed")

    def _build_response(self, ctx: ServeContext) -> PP.PoolingResponse:
        fmt = ctx.request.encoding_format
        return PP.PoolingResponse(
            id=ctx.request_id, model=ctx.request.model or ctx.model_name,
            data=[PP.PoolingResponseData(index=i, data=self.encode(res.outputs.data, fmt))
                  for i, res in enumerate(ctx.final_res_batch)],
            usage=self.usage(ctx.final_res_batch))


class ServingScores(PoolingServing):
    """``/score`` and ``/rerank`` (``rerank=True``) for an embedding model."""

    request_id_prefix = "score"
    api_name = "Score API"
    operation = OPERATIONS["score"]

    def __init__(self, serving: OpenAIServing, *, rerank: bool = False) -> None:
        super().__init__(serving)
        self.rerank = rerank
        if rerank:
            self.request_id_prefix, self.api_name = "rerank", "Rerank (Score) API"
            self.operation = OPERATIONS["embed"]  # vLLM names only ScoreRequest "score"

    def _pairs(self, ctx: ServeContext) -> tuple[list[str], list[str]]:
        req = ctx.request
        if self.rerank:
            return [req.query], list(req.documents)
        return ([req.text_1] if isinstance(req.text_1, str) else list(req.text_1),
                [req.text_2] if isinstance(req.text_2, str) else list(req.text_2))

    async def _preprocess(self, ctx: ServeContext) -> APIError | None:
        first, second = self._pairs(ctx)
        try:
            validate_score_input_lens(len(first), len(second))
        except ValueError as exc:
            return APIError(400, str(exc))
        ctx.num_first = len(first)
        return await self._process(ctx, first + second)

    def _build_response(self, ctx: ServeContext):
        n = ctx.num_first
        scores = cosine_scores(ctx.final_res_batch[:n], ctx.final_res_batch[n:])
        usage = self.usage(ctx.final_res_batch)
        model = ctx.request.model or ctx.model_name
        if not self.rerank:
            return PP.ScoreResponse(id=ctx.request_id, model=model, usage=usage, data=[
                PP.ScoreResponseData(index=i, score=s.outputs.score) for i, s in enumerate(scores)])
        documents = ctx.request.documents
        results = sorted((PP.RerankResult(index=i, document=PP.RerankDocument(text=documents[i]),
                                          relevance_score=s.outputs.score)
                          for i, s in enumerate(scores)), key=lambda r: -r.relevance_score)
        top_n = ctx.request.top_n
        return PP.RerankResponse(id=ctx.request_id, model=model, results=results[:top_n or None],
                                 usage=PP.RerankUsage(total_tokens=usage.total_tokens))


def pooling_router(serving: OpenAIServing) -> APIRouter:
    """The pooling routes (each refuses, in vLLM's words, a model without its task)."""
    router = APIRouter()
    embedding, scores, rerank = (ServingEmbedding(serving), ServingScores(serving),
                                 ServingScores(serving, rerank=True))

    @router.post("/v1/embeddings")
    @load_aware_call
    async def create_embedding(req: PP.EmbeddingRequest, raw: Request) -> Response:
        return await embedding(req, raw)

    @router.post("/pooling")
    @load_aware_call
    async def create_pooling(req: PP.PoolingRequest, raw: Request) -> Response:
        return await ServingPooling(serving)(req, raw)  # one per request: it keeps the task

    @router.post("/score")
    @router.post("/v1/score")
    @load_aware_call
    async def create_score(req: PP.ScoreRequest, raw: Request) -> Response:
        return await scores(req, raw)

    @router.post("/rerank")
    @router.post("/v1/rerank")
    @router.post("/v2/rerank")
    @load_aware_call
    async def do_rerank(req: PP.RerankRequest, raw: Request) -> Response:
        return await rerank(req, raw)

    return router


def generation_refused_router() -> APIRouter:
    """A pooling model's answer to the generation endpoints (vLLM's 400 and words)."""
    router = APIRouter()

    @router.post("/v1/completions")
    async def completions() -> Response:
        raise APIError(400, "The model does not support Completions API")

    @router.post("/v1/chat/completions")
    async def chat() -> Response:
        raise APIError(400, "The model does not support Chat Completions API")

    return router
