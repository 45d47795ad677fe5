"""POST /v1/completions: prompts (text, token ids, or a list of either) -> text_completion.

``echo`` puts the prompt before each choice's text (with ``max_tokens: 0``, the prompt alone);
with ``logprobs`` too, the prompt's tokens and logprobs come first (the first prompt token's
logprob is null: nothing predicts it), computed by the engine as ``prompt_logprobs``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from fastapi import APIRouter, Request
from fastapi.responses import Response

from workbench.outputs import CompletionOutput, Logprob
from workbench.entrypoints.openai import protocol as P
from workbench.entrypoints.openai import responses as R
from workbench.entrypoints.openai.load_tracking import load_aware_call
from workbench.entrypoints.openai.serving import (
    ChoiceState,
    OpenAIServing,
    ResponseFormat,
    prompt_logprobs_json,
    token_text,
)


class CompletionFormat(ResponseFormat):
    """text_completion responses and chunks; choice ``i * n + j`` is prompt i, sample j."""

    def __init__(self, serving: OpenAIServing, req: P.CompletionRequest, response_id: str
                 ) -> None:
        self.req, self.response_id = req, response_id
        self.model = req.model if req.model in serving.lora_requests else serving.model_name
        self.created = int(time.time())

    def _echo(self, state: ChoiceState) -> str:
        return state.prompt.text if self.req.echo else ""

    def _logprobs(self, state: ChoiceState, token_ids: list[int],
                  positions: list[dict[int, Logprob]], offset: int, with_prompt: bool
                  ) -> R.CompletionLogprobs:
        """Logprobs of ``token_ids`` whose text starts ``offset`` characters into the choice;
        ``with_prompt``: the echoed prompt's tokens first."""
        entries: list[tuple[int, dict[int, Logprob] | None]] = []
        if with_prompt:
            prompt = state.prompt
            known = prompt.prompt_logprobs or []
            entries += [(t, known[k] if k < len(known) else None)
                        for k, t in enumerate(prompt.token_ids)]
        entries += list(zip(token_ids, positions))
        as_ids = self.req.return_tokens_as_token_ids
        # every field set explicitly: a stream chunk leaves unset fields out (exclude_unset)
        lp = R.CompletionLogprobs(text_offset=[], token_logprobs=[], tokens=[], top_logprobs=[])
        for token_id, pos in entries:
            chosen = None if pos is None else pos.get(token_id)
            if chosen is None and not as_ids:  # the first prompt token: no logprob to name it
                token = state.prompt.first_token_text
            else:
                token = token_text(token_id, chosen, as_ids)
            lp.tokens.append(token)
            lp.token_logprobs.append(None if chosen is None else chosen.logprob)
            lp.top_logprobs.append(None if pos is None else {
                token_text(t, v, as_ids): v.logprob
                for t, v in sorted(pos.items(), key=lambda kv: kv[1].rank or 0)
            })
            lp.text_offset.append(offset)
            offset += len(token)
        return lp

    def stream_choice(self, state: ChoiceState, delta: CompletionOutput
                      ) -> R.CompletionChoice | None:
        first = not state.started
        state.started = True
        text = (self._echo(state) if first else "") + delta.text
        ids = self.req.return_token_ids
        if (not text and delta.finish_reason is None and self.req.logprobs is None
                and not (ids and (first or delta.token_ids))):
            return None  # the detokenizer held the text back: nothing to say yet
        logprobs = None
        if self.req.logprobs is not None:
            offset = 0 if first else len(self._echo(state)) + len(state.text) - len(delta.text)
            logprobs = self._logprobs(state, delta.token_ids, delta.logprobs or [], offset,
                                      with_prompt=first and self.req.echo)
        return R.CompletionChoice(index=state.index, text=text, logprobs=logprobs,
                                  finish_reason=delta.finish_reason,
                                  stop_reason=delta.stop_reason,
                                  token_ids=list(delta.token_ids) if ids else None,
                                  prompt_token_ids=state.prompt.token_ids if ids and first
                                  else None)

    def chunk(self, choices: list, usage: R.UsageInfo | None) -> R.CompletionResponse:
        """A chunk; ``usage`` only when there is one (a stream leaves unset fields out)."""
        chunk = R.CompletionResponse(id=self.response_id, object="text_completion",
                                     created=self.created, model=self.model, choices=choices)
        if usage is not None:
            chunk.usage = usage
        return chunk

    def response(self, choices: Sequence[ChoiceState], usage: R.UsageInfo
                 ) -> R.CompletionResponse:
        out = []
        for state in choices:
            logprobs = None
            if self.req.logprobs is not None:
                logprobs = self._logprobs(state, state.token_ids, state.logprobs, 0,
                                          with_prompt=self.req.echo)
            out.append(R.CompletionChoice(
                index=state.index, text=self._echo(state) + state.text, logprobs=logprobs,
                finish_reason=state.finish_reason, stop_reason=state.stop_reason,
                prompt_logprobs=prompt_logprobs_json(state.prompt.prompt_logprobs)
                if self.req.prompt_logprobs is not None else None,
                token_ids=state.token_ids if self.req.return_token_ids else None,
                prompt_token_ids=state.prompt.token_ids if self.req.return_token_ids else None,
            ))
        return R.CompletionResponse(id=self.response_id, created=self.created,
                                    model=self.model, choices=out, usage=usage)


def completion_router(serving: OpenAIServing) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/completions")
    @load_aware_call
    async def create_completion(req: P.CompletionRequest, raw: Request) -> Response:
        arrival_time = serving.llm.clock()  # before tokenizing, as vLLM stamps arrival_time
        base_id = serving.check_request(req, raw)
        echo_only = req.echo and req.max_tokens == 0  # one token is run, then dropped
        max_tokens = 1 if echo_only else req.max_tokens
        echo_logprobs = req.logprobs if req.echo else None
        params = serving.sampling_params(req, max_tokens=max_tokens, logprobs=req.logprobs,
                                         prompt_logprobs=echo_logprobs)
        response_id = f"cmpl-{base_id}"
        # engine requests f"{response_id}-{i}", one per prompt, a single one too (vLLM's
        # completions: request_id_item = f"{request_id}-{i}")
        prompts = await serving.prepare(req, response_id, req.prompts(), params,
                                        requested_max_tokens=max_tokens,
                                        trace_headers=serving.trace_headers(raw),
                                        numbered=True, arrival_time=arrival_time)
        if req.echo and req.logprobs is not None and not req.return_tokens_as_token_ids:
            for p in prompts:
                p.first_token_text = await serving.llm.decode(p.token_ids[:1])
        return await serving.generate(raw, req, base_id, prompts,
                                      CompletionFormat(serving, req, response_id),
                                      echo_only=echo_only)

    return router
