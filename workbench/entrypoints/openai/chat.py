"""POST /v1/chat/completions: messages -> the model's chat template -> chat.completion.

The conversation is rendered by ``InputProcessor.render_chat`` on the input thread (template
errors answer 400 with the template's message). ``echo`` puts the last message's content
before each reply when that message is the assistant's (vLLM's rule), as does streaming.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from workbench.outputs import CompletionOutput, Logprob
from workbench.entrypoints.openai import protocol as P
from workbench.entrypoints.openai import responses as R
from workbench.entrypoints.openai.errors import APIError
from workbench.entrypoints.openai.serving import (
    ChoiceState,
    OpenAIServing,
    ResponseFormat,
    prompt_logprobs_json,
    token_text,
)

ROLE = "assistant"


def template_messages(messages: list[P.ChatMessage]) -> list[dict[str, Any]]:
    try:
        return [m.for_template(i) for i, m in enumerate(messages)]
    except P.FieldError as exc:
        raise APIError.bad_request(exc) from exc


async def render(serving: OpenAIServing, messages: list[P.ChatMessage], *,
                 add_generation_prompt: bool, continue_final_message: bool,
                 chat_template: str | None, chat_template_kwargs: dict[str, Any] | None) -> str:
    """The conversation's prompt text (400 naming ``messages`` when the template fails)."""
    try:
        return await serving.llm.render_chat(
            template_messages(messages),
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            chat_template=chat_template,
            chat_template_kwargs=chat_template_kwargs,
        )
    except ValueError as exc:
        raise APIError(400, str(exc), "messages") from exc


class ChatFormat(ResponseFormat):
    """chat.completion responses and chat.completion.chunk chunks."""

    def __init__(self, serving: OpenAIServing, req: P.ChatCompletionRequest, response_id: str,
                 echo: str) -> None:
        self.req, self.response_id, self.echo = req, response_id, echo
        self.model = req.model if req.model in serving.lora_requests else serving.model_name
        self.created = int(time.time())

    def _entry(self, token_id: int, v: Logprob) -> dict[str, Any]:
        token = token_text(token_id, v, self.req.return_tokens_as_token_ids)
        return {"token": token, "logprob": v.logprob, "bytes": list(token.encode("utf-8"))}

    def _logprobs(self, token_ids: list[int], positions: list[dict[int, Logprob]]
                  ) -> R.ChatLogprobs | None:
        """Each sampled token with its ``top_logprobs`` most likely candidates."""
        if not self.req.logprobs:
            return None
        k = self.req.top_logprobs or 0
        content = []
        for token_id, pos in zip(token_ids, positions):
            top = sorted(((t, v) for t, v in pos.items() if v.rank is not None and v.rank <= k),
                         key=lambda tv: tv[1].rank)[:k]
            content.append(R.ChatTokenLogprob(**self._entry(token_id, pos[token_id]),
                                              top_logprobs=[self._entry(*tv) for tv in top]))
        return R.ChatLogprobs(content=content)

    def prelude(self, choices: Sequence[ChoiceState]) -> list[R.ChatCompletionChunk]:
        for state in choices:
            state.started = True
        chunks = [self.chunk([R.ChatStreamChoice(index=s.index,
                                                 delta={"role": ROLE, "content": self.echo})],
                             None) for s in choices]
        if self.req.return_token_ids and chunks:  # vLLM: the prompt's ids in the first chunk
            chunks[0].prompt_token_ids = choices[0].prompt.token_ids
        return chunks

    def stream_choice(self, state: ChoiceState, delta: CompletionOutput
                      ) -> R.ChatStreamChoice | None:
        ids = self.req.return_token_ids
        if (not delta.text and delta.finish_reason is None and not self.req.logprobs
                and not (ids and delta.token_ids)):
            return None
        return R.ChatStreamChoice(
            index=state.index, delta={"content": delta.text},
            logprobs=self._logprobs(delta.token_ids, delta.logprobs or []),
            finish_reason=delta.finish_reason, stop_reason=delta.stop_reason,
            token_ids=list(delta.token_ids) if ids else None,
        )

    def chunk(self, choices: list, usage: R.UsageInfo | None) -> R.ChatCompletionChunk:
        return R.ChatCompletionChunk(id=self.response_id, created=self.created,
                                     model=self.model, choices=choices, usage=usage)

    def response(self, choices: Sequence[ChoiceState], usage: R.UsageInfo
                 ) -> R.ChatCompletionResponse:
        out = [
            R.ChatChoice(
                index=s.index,
                message=R.ChatResponseMessage(role=ROLE, content=self.echo + s.text),
                logprobs=self._logprobs(s.token_ids, s.logprobs),
                finish_reason=s.finish_reason,
                stop_reason=s.stop_reason,
                token_ids=s.token_ids if self.req.return_token_ids else None,
            )
            for s in choices
        ]
        prompt_logprobs = None
        if self.req.prompt_logprobs is not None:  # one prompt: top-level, as vLLM
            prompt_logprobs = prompt_logprobs_json(choices[0].prompt.prompt_logprobs)
        return R.ChatCompletionResponse(id=self.response_id, created=self.created,
                                        model=self.model, choices=out, usage=usage,
                                        prompt_logprobs=prompt_logprobs,
                                        prompt_token_ids=choices[0].prompt.token_ids
                                        if self.req.return_token_ids else None)


def chat_router(serving: OpenAIServing) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/chat/completions")
    async def create_chat_completion(req: P.ChatCompletionRequest, raw: Request) -> Response:
        base_id = serving.check_request(req, raw)
        text = await render(
            serving, req.messages, add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message,
            chat_template=req.chat_template, chat_template_kwargs=req.template_kwargs(),
        )
        requested = req.requested_max_tokens
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        try:  # the engine's limit, under this endpoint's field name
            P.logprobs_rule("top_logprobs", logprobs, serving.llm.input_processor.max_logprobs)
        except P.FieldError as exc:
            raise APIError.bad_request(exc) from exc
        params = serving.sampling_params(req, max_tokens=requested, logprobs=logprobs)
        response_id = f"chatcmpl-{base_id}"
        prompts = await serving.prepare(req, response_id, [text], params,
                                        requested_max_tokens=requested,
                                        trace_headers=serving.trace_headers(raw))
        last = req.messages[-1]
        echo = last.for_template(len(req.messages) - 1)["content"] \
            if req.echo and last.role == ROLE else ""
        return await serving.generate(raw, req, base_id, prompts,
                                      ChatFormat(serving, req, response_id, echo))

    return router
