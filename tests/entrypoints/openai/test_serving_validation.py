"""Every bad request is answered OpenAI-shaped with vLLM's status, the field named in ``param``
and its rule in the message; the next request is still served. Cases follow vLLM's request
rules (protocol validators, SamplingParams, the processor's vocabulary and logprob limits,
OpenAIServing's context checks), written from those rules, not from this server's output."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest

from serving_support import GOOD, MODEL, client, serving_fixtures, sse_events, wait_all_free

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Speak."}], "max_tokens": 2,
        "temperature": 0, "ignore_eos": True}
VOCAB = 4096
CTX = 1024

async_llm, app = serving_fixtures()


def cmpl(**kw):
    return ("/v1/completions", {**GOOD, **kw})


def chat(**kw):
    return ("/v1/chat/completions", {**CHAT, **kw})


# (id, (path, body), status, param, words the message must contain)
CASES = [
    ("nan_temperature", cmpl(temperature=float("nan")), 400, "temperature", "finite number"),
    ("inf_top_p", cmpl(top_p=float("inf")), 400, "top_p", "finite number"),
    ("nan_presence", chat(presence_penalty=float("nan")), 400, "presence_penalty", "finite"),
    ("seed_above_int64", cmpl(seed=2**63), 400, "seed", "9223372036854775807"),
    ("seed_below_int64", cmpl(seed=-(2**63) - 1), 400, "seed", "-9223372036854775808"),
    ("n_bool", cmpl(n=True), 400, "n", "valid integer"),
    ("n_zero", cmpl(n=0), 400, "n", "at least 1"),
    ("max_tokens_float", cmpl(max_tokens=1.5), 400, "max_tokens", "valid integer"),
    ("max_tokens_string", cmpl(max_tokens="5"), 400, "max_tokens", "valid integer"),
    ("temperature_string", chat(temperature="hot"), 400, "temperature", "valid number"),
    ("stream_bool_string", cmpl(stream="yes"), 400, "stream", "valid boolean"),
    ("max_tokens_zero", cmpl(max_tokens=0), 400, "max_tokens", "at least 1"),
    ("max_tokens_context", cmpl(max_tokens=5000), 400, "max_tokens",
     "'max_tokens' or 'max_completion_tokens' is too large: 5000. This model's maximum "
     "context length is 1024 tokens"),
    ("prompt_too_long", cmpl(prompt=[5] * CTX), 400, "prompt",
     f"This model's maximum context length is {CTX} tokens. However, your request has {CTX} "
     "input tokens. Please reduce the length of the input messages."),
    ("chat_context", chat(max_completion_tokens=5000), 400, "max_completion_tokens",
     "is too large: 5000"),
    ("logprobs_over_max", cmpl(logprobs=21), 400, "logprobs",
     "Requested sample logprobs of 21, which is greater than max allowed: 20"),
    ("logprobs_negative", cmpl(logprobs=-2), 400, "logprobs", "positive"),
    ("logprobs_all_over_the_limit", cmpl(logprobs=-1), 400, "logprobs",
     "which is greater than max allowed: 20"),
    ("top_logprobs_all_over_the_limit", chat(logprobs=True, top_logprobs=-1), 400,
     "top_logprobs", "which is greater than max allowed: 20"),
    ("top_logprobs_all_without_logprobs", chat(top_logprobs=-1), 400, "top_logprobs",
     "`logprobs` must be set to true"),
    ("top_logprobs_over_max", chat(logprobs=True, top_logprobs=21), 400, "top_logprobs",
     "greater than max allowed: 20"),
    ("top_logprobs_without_logprobs", chat(top_logprobs=2), 400, "top_logprobs",
     "`logprobs` must be set to true"),
    ("prompt_logprobs_over_max", cmpl(prompt_logprobs=30), 400, "prompt_logprobs",
     "Requested prompt logprobs of 30, which is greater than max allowed: 20"),
    ("prompt_logprobs_stream", cmpl(prompt_logprobs=1, stream=True), 400, "prompt_logprobs",
     "not available when `stream=True`"),
    ("stream_options_without_stream", cmpl(stream_options={"include_usage": True}), 400,
     "stream_options", "only be defined when `stream=True`"),
    ("logit_bias_out_of_vocab", cmpl(logit_bias={str(VOCAB): 1}), 400, "logit_bias",
     f"[0, {VOCAB})"),
    ("logit_bias_value", cmpl(logit_bias={"5": 100.5}), 400, "logit_bias", "[-100, 100]"),
    ("logit_bias_key", cmpl(logit_bias={"five": 1}), 400, "logit_bias", "token ids"),
    ("allowed_token_ids_empty", cmpl(allowed_token_ids=[]), 400, "allowed_token_ids",
     "non-empty"),
    ("allowed_token_ids_vocab", cmpl(allowed_token_ids=[1, VOCAB]), 400, "allowed_token_ids",
     f"[0, {VOCAB})"),
    # vLLM's input processor: the largest id out of the vocabulary, an empty token prompt
    ("token_prompt_out_of_vocab", cmpl(prompt=[VOCAB + 3, 5, VOCAB]), 400, "prompt",
     f"Token id {VOCAB + 3} is out of vocabulary"),
    ("token_prompt_negative", cmpl(prompt=[[5], [-1]]), 400, "prompt",
     "greater than or equal to 0"),  # vLLM's list[Annotated[int, Field(ge=0)]]
    ("prompt_bools", cmpl(prompt=[True, False]), 400, "prompt", "valid"),
    ("prompt_wrong_type", cmpl(prompt=5), 400, "prompt", "valid"),
    ("prompt_mixed_list", cmpl(prompt=[5, "a"]), 400, "prompt", "valid"),
    ("prompt_empty_list", cmpl(prompt=[]), 400, "prompt", "The decoder prompt cannot be empty"),
    ("prompt_empty_in_list", cmpl(prompt=[[5], []]), 400, "prompt",
     "The decoder prompt cannot be empty"),
    ("prompt_empty_text", cmpl(prompt=""), 400, "prompt",
     "Either prompt or prompt_embeds must be provided and non-empty."),
    ("prompt_null", cmpl(prompt=None), 400, "prompt",
     "Either prompt or prompt_embeds must be provided and non-empty."),
    ("prompt_missing", ("/v1/completions", {"model": MODEL}), 400, "prompt",
     "Either prompt or prompt_embeds must be provided and non-empty."),
    ("best_of_below_n", cmpl(n=2, best_of=1), 400, "best_of",
     "best_of must be greater than or equal to n"),
    ("best_of_above_n", cmpl(best_of=3), 400, "best_of", "not supported"),
    ("min_tokens_above_max", cmpl(min_tokens=9, max_tokens=8), 400, "min_tokens",
     "min_tokens must be <= max_tokens"),
    ("repetition_penalty_zero", cmpl(repetition_penalty=0), 400, "repetition_penalty", "(0, 2]"),
    ("top_k_string", cmpl(top_k="many"), 400, "top_k", "valid integer"),
    ("stop_empty", cmpl(stop=[""]), 400, "stop", "non-empty"),
    ("stop_token_ids_negative", cmpl(stop_token_ids=[-3]), 400, "stop_token_ids", "non-negative"),
    ("bad_words_blank", cmpl(bad_words=[" "]), 400, "bad_words", "non-blank"),
    ("truncate_zero", cmpl(truncate_prompt_tokens=0), 400, "truncate_prompt_tokens", ">= 1"),
    ("truncate_above_context", cmpl(truncate_prompt_tokens=CTX + 1), 400,
     "truncate_prompt_tokens", "greater than max_model_len"),
    ("priority_without_policy", cmpl(priority=1), 400, "priority",
     "Priority scheduling is not enabled"),
    ("unknown_model", cmpl(model="gpt-5"), 404, "model", "The model `gpt-5` does not exist."),
    ("unknown_model_chat", chat(model="gpt-5"), 404, "model", "does not exist"),
    ("response_format_structural_tag", chat(response_format={"type": "structural_tag",
                                                             "format": {}}), 400,
     "response_format", "Invalid format"),
    ("response_format_structural_tag_empty", chat(response_format={"type": "structural_tag"}),
     400, "response_format", "'format' (or 'structures' and 'triggers') must be provided"),
    ("structural_tag", cmpl(structural_tag="{}"), 400, "structural_tag",
     "Structural tag must have a format field"),
    ("structural_tag_bad_schema", cmpl(structured_outputs={"structural_tag": json.dumps({
        "structures": [{"begin": "<f=", "schema": {"type": "objectx"}, "end": "</f>"}],
        "triggers": ["<f="]})}), 400, "structured_outputs", 'Unsupported type "objectx"'),
    ("grammar_lark_bad", cmpl(structured_outputs={"grammar": 'start: "a" ('}), 400,
     "structured_outputs", "structured_outputs: "),
    # structured outputs: vLLM's rules, the compiler's own message, the field that set it
    ("response_format_schema_missing", cmpl(response_format={"type": "json_schema"}), 400,
     "response_format", "the 'json_schema' field must be provided"),
    ("response_format_bad_type", chat(response_format={"type": "yaml"}), 400,
     "response_format", "got 'yaml'"),
    ("response_format_bad_schema", chat(response_format={
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}),
     400, "response_format", 'Unsupported type "objectx"'),
    ("structured_outputs_bad_regex", cmpl(structured_outputs={"regex": "a(b"}), 400,
     "structured_outputs", "The parenthesis is not closed"),
    ("structured_outputs_bad_grammar", cmpl(structured_outputs={"grammar": 'root ::= "a" ('}),
     400, "structured_outputs", "EBNF parser error"),
    ("structured_outputs_two_kinds", cmpl(structured_outputs={"regex": "a", "choice": ["b"]}),
     400, "structured_outputs", "You can only use one kind of structured outputs constraint"),
    ("structured_outputs_flags_only", cmpl(structured_outputs={"disable_any_whitespace": True}),
     400, "structured_outputs", "You must use one kind of structured outputs constraint"),
    ("structured_outputs_choice_empty", cmpl(structured_outputs={"choice": []}), 400,
     "structured_outputs", "non-empty list of strings"),
    ("guided_json_bad", cmpl(guided_json={"type": "objectx"}), 400, "guided_json",
     'Unsupported type "objectx"'),
    ("guided_whitespace_pattern_bad", cmpl(guided_json={"type": "object"},
                                           guided_whitespace_pattern="("), 400,
     "guided_json", "Grammar error: regex parse error"),
    ("guided_decoding_backend", cmpl(guided_regex="a", guided_decoding_backend="outlines"),
     400, "guided_decoding_backend", "backend selection is not supported"),
    ("tools_auto", chat(tools=[{"type": "function", "function": {"name": "f"}}],
                        tool_choice="auto"), 400, "tool_choice",
     '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'),
    ("tool_choice_without_tools", chat(tool_choice="required"), 400, "tool_choice",
     "`tools` must be set"),
    ("suffix", cmpl(suffix="END"), 400, "suffix", "not supported"),
    ("beam_search_stream", cmpl(use_beam_search=True, stream=True), 400, "stream",
     "Streaming is not currently supported with beam search"),
    ("beam_search_logprobs", cmpl(use_beam_search=True, logprobs=1), 400, "logprobs",
     "not supported with beam search"),
    ("server_logits_processors", cmpl(logits_processors=["my.Proc"]), 400, "logits_processors",
     "not supported"),
    ("prompt_embeds", cmpl(prompt_embeds="AAAA"), 400, "prompt_embeds", "not supported"),
    ("kv_transfer_params", cmpl(kv_transfer_params={"x": 1}), 400, "kv_transfer_params",
     "not supported"),
    ("reasoning_effort", chat(reasoning_effort="extreme"), 400, "reasoning_effort", "'high'"),
    ("image_part", chat(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]), 400, "messages",
     "'image_url' are not supported"),
    # chat rules and template failures
    ("role_the_template_rejects", chat(messages=[{"role": "villain", "content": "Ha!"}]), 400,
     "messages", "chat template: role must be system, user, assistant or tool, got villain"),
    ("template_syntax", chat(chat_template="{% for m in messages %}{{ m['content'] }"), 400,
     "messages", ""),
    ("both_generation_and_continue", chat(continue_final_message=True), 400,
     "continue_final_message", "Cannot set both"),
    ("continue_non_assistant", chat(continue_final_message=True, add_generation_prompt=False),
     400, "messages", "last message to have role 'assistant'"),
    ("messages_empty", chat(messages=[]), 400, "messages", "at least 1"),
    ("message_without_role", chat(messages=[{"content": "hi"}]), 400, "messages", "role"),
    ("max_completion_tokens_zero", chat(max_completion_tokens=0), 400, "max_completion_tokens",
     "at least 1"),
    ("chat_template_kwargs_reserved", chat(chat_template_kwargs={"tokenize": True}), 400,
     "messages", "tokenize"),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_request_is_answered_and_the_next_one_served(app, case):
    _, (path, body), status, param, words = case

    async def go():
        async with client(app) as c:
            bad = await c.post(path, content=json.dumps(body),  # NaN/Infinity as JS spells them
                               headers={"content-type": "application/json"})
            good = await c.post(path, json={**(GOOD if path == "/v1/completions" else CHAT),
                                            "max_tokens": 2})
            return bad, good

    bad, good = asyncio.run(go())
    assert bad.status_code == status, bad.text
    err = bad.json()
    assert set(err) == {"error"}  # vLLM V1's ErrorResponse: no top-level "object"
    assert set(err["error"]) == {"message", "type", "param", "code"}
    assert err["error"]["code"] == status
    assert err["error"]["type"] == {400: "BadRequestError", 404: "NotFoundError"}[status]
    assert err["error"]["param"] == param, err
    assert words in err["error"]["message"], err["error"]["message"]
    assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] == 2


def test_errors_while_streams_run_leave_them_intact(app, async_llm):
    """A burst of bad requests (one per case) while a stream runs: the stream is unaffected."""

    async def go():
        async with client(app) as c:
            stream = asyncio.create_task(c.post("/v1/completions", json={
                **GOOD, "max_tokens": 24, "stream": True}))
            answers = await asyncio.gather(*(
                c.post(path, content=json.dumps(body), headers={"content-type": "application/json"})
                for _, (path, body), *_ in CASES))
            done = await stream
        await wait_all_free(async_llm)
        return answers, done

    answers, done = asyncio.run(go())
    assert [a.status_code for a in answers] == [c[2] for c in CASES]
    chunks = sse_events(done.text)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert sum(1 for ch in chunks if ch["choices"]) >= 1


@pytest.mark.parametrize("raw, words", [
    (b'{"prompt": "ROMEO:", ', "Malformed JSON"),
    (b'{"prompt": "ROMEO:", "temperature": NaN}', "finite number"),
    (b'["ROMEO:"]', "valid dictionary"),
    (b"", "The request body is missing"),
])
def test_unparseable_bodies_are_400(app, raw, words):
    async def go():
        async with client(app) as c:
            return await c.post("/v1/completions", content=raw,
                                headers={"content-type": "application/json"})

    response = asyncio.run(go())
    assert response.status_code == 400, response.text
    assert words in response.json()["error"]["message"]


def test_unknown_fields_are_accepted_with_one_warning(app, caplog):
    async def go():
        async with client(app) as c:
            return await c.post("/v1/completions", json={
                **GOOD, "max_tokens": 2, "frobnicate": 1, "store": True, "stream": True,
                "stream_options": {"include_usage": True, "verbose": 1}})

    with caplog.at_level(logging.WARNING, logger="workbench.entrypoints.openai"):
        response = asyncio.run(go())
    assert response.status_code == 200
    warnings = [r.getMessage() for r in caplog.records if "ignored" in r.getMessage()]
    assert warnings == ["The following fields were present in the request but ignored: "
                        "['frobnicate', 'store', 'stream_options.verbose']"]


def test_a_routing_error_is_openai_shaped(app):
    async def go():
        async with client(app) as c:
            return await c.get("/v1/nothing"), await c.get("/v1/completions")

    missing, wrong_method = asyncio.run(go())
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "NotFoundError"
    assert wrong_method.status_code == 405
    assert wrong_method.json()["error"]["code"] == 405
