"""POST /v1/chat/completions: messages -> the model's chat template -> chat.completion.

The conversation is rendered by ``InputProcessor.render_chat`` on the input thread (template
errors answer 400 with the template's message). ``echo`` puts the last message's content
before each reply when that message is the assistant's (vLLM's rule), as does streaming.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from workbench.outputs import CompletionOutput, Logprob
from workbench.entrypoints.openai import protocol as P
from workbench.entrypoints.openai import responses as R
from workbench.entrypoints.openai.errors import APIError
from workbench.entrypoints.openai.load_tracking import load_aware_call
from workbench.entrypoints.openai.reply_parsing import ReplyReader
from workbench.entrypoints.openai.serving import (
    ChoiceState,
    OpenAIServing,
    ResponseFormat,
    prompt_logprobs_json,
    token_text,
)
from workbench.entrypoints.openai.tool_parsers import ToolParser
from workbench.entrypoints.openai.tool_parsers.tool_choice_parsers import (
    NamedToolParser,
    RequiredToolParser,
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


def reply_reader(serving: OpenAIServing, req: P.ChatCompletionRequest
                 ) -> Callable[[], ReplyReader] | None:
    """A factory of each choice's ReplyReader (None: the reply is plain content). "auto"
    without the server's tool-call parser is a 400 with vLLM's message; "required" falls
    back to that parser for a reply that is not a JSON array (vLLM's). The reasoning parser
    gets the request's chat template kwargs, as vLLM builds it."""
    tools: Callable[[], ToolParser] | None = None
    tokenizer = serving.llm.input_processor.tokenizer
    auto = None
    if serving.enable_auto_tools and serving.tool_parser is not None:
        auto = partial(serving.tool_parser, tokenizer)
    choice = "named" if req.named_tool is not None else req.tool_choice
    if choice == "named":
        tools = partial(NamedToolParser, req.named_tool)
    elif choice == "required":
        tools = lambda: RequiredToolParser(tokenizer, auto() if auto else None)  # noqa: E731
    elif choice == "auto":
        if auto is None:
            raise APIError(400, '"auto" tool choice requires --enable-auto-tool-choice and '
                                "--tool-call-parser to be set", "tool_choice")
        tools = auto
    reasoning = serving.reasoning_parser
    if tools is None and reasoning is None:
        return None
    template_kwargs = req.template_kwargs()
    return lambda: ReplyReader(reasoning(tokenizer, chat_template_kwargs=template_kwargs)
                               if reasoning else None,
                               tools() if tools else None, tool_choice=choice,
                               include_reasoning=req.include_reasoning,
                               parallel_tool_calls=req.parallel_tool_calls is not False)


class ChatFormat(ResponseFormat):
    """chat.completion responses and chat.completion.chunk chunks; with ``readers`` (a
    ReplyReader factory), each choice's reply is split into reasoning, content and tool
    calls, streamed as OpenAI's deltas."""

    def __init__(self, serving: OpenAIServing, req: P.ChatCompletionRequest, response_id: str,
                 echo: str, readers: Callable[[], ReplyReader] | None = None) -> None:
        self.req, self.response_id, self.echo = req, response_id, echo
        self.model = req.model if req.model in serving.lora_requests else serving.model_name
        self.created = int(time.time())
        self.readers = readers
        self._readers: dict[int, ReplyReader] = {}

    def _reader(self, index: int) -> ReplyReader | None:
        if self.readers is None:
            return None
        if index not in self._readers:
            self._readers[index] = self.readers()
        return self._readers[index]

    def _entry(self, token_id: int, v: Logprob) -> dict[str, Any]:
        token = token_text(token_id, v, self.req.return_tokens_as_token_ids)
        return {"token": token, "logprob": v.logprob, "bytes": list(token.encode("utf-8"))}

    def _logprobs(self, token_ids: list[int], positions: list[dict[int, Logprob]]
                  ) -> R.ChatLogprobs | None:
        """Each sampled token with its ``top_logprobs`` most likely candidates."""
        if not self.req.logprobs:
            return None
        k = self.req.top_logprobs or 0
        if k == -1:  # the whole vocabulary (vLLM)
            k = max(map(len, positions), default=0)
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
                                                 delta={"role": ROLE, "content": self.echo},
                                                 logprobs=None, finish_reason=None)],
                             None) for s in choices]
        if self.req.return_token_ids and chunks:  # vLLM: the prompt's ids in the first chunk
            chunks[0].prompt_token_ids = choices[0].prompt.token_ids
        return chunks

    def stream_choice(self, state: ChoiceState, delta: CompletionOutput
                      ) -> R.ChatStreamChoice | None:
        ids = self.req.return_token_ids
        reader = self._reader(state.index)
        fields: dict = {"content": delta.text}
        finish_reason = delta.finish_reason
        if reader is not None:
            fields = reader.delta(state.text, delta.text, state.token_ids) if delta.text else {}
            if finish_reason is not None:
                fields = reader.flush(state.text, fields)
                finish_reason = reader.finish_reason(finish_reason, reader.tools_called)
            if not fields and finish_reason is None and not self.req.logprobs and not (
                    ids and delta.token_ids):
                return None
        elif (not delta.text and finish_reason is None and not self.req.logprobs
              and not (ids and delta.token_ids)):
            return None
        choice = R.ChatStreamChoice(
            index=state.index, delta=fields,
            logprobs=self._logprobs(delta.token_ids, delta.logprobs or []),
            finish_reason=finish_reason, token_ids=list(delta.token_ids) if ids else None,
        )
        if finish_reason is not None:  # vLLM sets stop_reason on the finishing chunk only
            choice.stop_reason = delta.stop_reason
        return choice

    def _message(self, s: ChoiceState) -> tuple[R.ChatResponseMessage, str | None]:
        reader = self._reader(s.index)
        if reader is None:
            return R.ChatResponseMessage(role=ROLE, content=self.echo + s.text), s.finish_reason
        fields, calls = reader.message(s.text)
        if self.echo:
            fields["content"] = self.echo + (fields["content"] or "")
        return (R.ChatResponseMessage(role=ROLE, tool_calls=calls, **fields),
                reader.finish_reason(s.finish_reason, bool(calls)))

    def chunk(self, choices: list, usage: R.UsageInfo | None) -> R.ChatCompletionChunk:
        """A chunk; ``usage`` only when there is one (a stream leaves unset fields out)."""
        chunk = R.ChatCompletionChunk(id=self.response_id, object="chat.completion.chunk",
                                      created=self.created, model=self.model, choices=choices)
        if usage is not None:
            chunk.usage = usage
        return chunk

    def response(self, choices: Sequence[ChoiceState], usage: R.UsageInfo
                 ) -> R.ChatCompletionResponse:
        out = []
        for s in choices:
            message, finish_reason = self._message(s)
            out.append(R.ChatChoice(
                index=s.index, message=message,
                logprobs=self._logprobs(s.token_ids, s.logprobs),
                finish_reason=finish_reason, stop_reason=s.stop_reason,
                token_ids=s.token_ids if self.req.return_token_ids else None,
            ))
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
    @load_aware_call
    async def create_chat_completion(req: P.ChatCompletionRequest, raw: Request) -> Response:
        arrival_time = serving.llm.clock()  # before rendering, as vLLM stamps arrival_time
        base_id = serving.check_request(req, raw)
        readers = reply_reader(serving, req)
        # The parser may need special tokens kept. vLLM (OpenAIServing._preprocess_chat) calls
        # adjust_request whenever a tool-call parser is configured and tool_choice is not
        # "none" (named and "required" too), whatever --enable-auto-tool-choice says.
        if serving.tool_parser is not None and req.tool_choice != "none":
            serving.tool_parser(serving.llm.input_processor.tokenizer).adjust_request(req)
        text = await render(
            serving, req.messages, add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message,
            chat_template=req.chat_template, chat_template_kwargs=req.template_kwargs(),
        )
        requested = req.requested_max_tokens
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        try:  # the engine's limit, under this endpoint's field name
            processor = serving.llm.input_processor
            P.logprobs_rule("top_logprobs", logprobs, processor.max_logprobs,
                            processor.vocab_size)
        except P.FieldError as exc:
            raise APIError.bad_request(exc) from exc
        params = serving.sampling_params(req, max_tokens=requested, logprobs=logprobs)
        response_id = f"chatcmpl-{base_id}"
        prompts = await serving.prepare(req, response_id, [text], params,
                                        requested_max_tokens=requested,
                                        trace_headers=serving.trace_headers(raw),
                                        numbered=False, arrival_time=arrival_time)
        last = req.messages[-1]
        echo = last.for_template(len(req.messages) - 1)["content"] \
            if req.echo and last.role == ROLE else ""
        return await serving.generate(raw, req, base_id, prompts,
                                      ChatFormat(serving, req, response_id, echo, readers))

    return router
