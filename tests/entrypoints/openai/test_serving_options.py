"""Request options vLLM honours, each checked against an independent reference: the Hugging
Face tokenizer and transformers' logits on the same weights, or a rule worked out by hand
(choice indexing, usage arithmetic, header echo)."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

from workbench import LLMEngine
from workbench.engine.async_llm import AsyncLLM
from workbench.entrypoints.openai.api_server import build_app

from serving_support import (
    GOOD, MODEL, client, greedy_ids, hf, serving_fixtures, sse_events, wait_all_free,
)

USER = [{"role": "user", "content": "Good morrow, sweet lady."}]


BLOCKS = 136  # a whole context (1024 tokens) fits: chat's default max_tokens is admitted
async_llm, app = serving_fixtures(BLOCKS)


def post_all(app, *calls, headers=None):
    """POST each (path, body) concurrently; the responses in order."""
    async def go():
        async with client(app) as c:
            return await asyncio.gather(*(c.post(p, json=b, headers=headers) for p, b in calls))
    return asyncio.run(go())


def test_echo_with_and_without_generation(app, hf):
    model, tok = hf
    prompt = "JULIET:\nO Romeo"
    ids = tok(prompt).input_ids
    ref = tok.decode(greedy_ids(model, ids, 4))
    gen, only, streamed = post_all(
        app,
        ("/v1/completions", {**GOOD, "prompt": prompt, "max_tokens": 4, "echo": True}),
        ("/v1/completions", {**GOOD, "prompt": prompt, "max_tokens": 0, "echo": True}),
        ("/v1/completions", {**GOOD, "prompt": prompt, "max_tokens": 4, "echo": True,
                             "stream": True}),
    )
    assert gen.json()["choices"][0]["text"] == prompt + ref
    body = only.json()
    assert body["choices"][0]["text"] == prompt and body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 0,
                             "total_tokens": len(ids)}
    text = "".join(ch["choices"][0]["text"] for ch in sse_events(streamed.text) if ch["choices"])
    assert text == prompt + ref


def test_echo_logprobs_include_the_prompt_tokens(app, hf):
    model, tok = hf
    prompt = "ROMEO:\nBut soft"
    ids = tok(prompt).input_ids
    with torch.inference_mode():
        ref = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    only, gen = post_all(
        app,
        ("/v1/completions", {**GOOD, "prompt": prompt, "max_tokens": 0, "echo": True,
                             "logprobs": 1}),
        ("/v1/completions", {**GOOD, "prompt": prompt, "max_tokens": 3, "echo": True,
                             "logprobs": 1}),
    )
    lp = only.json()["choices"][0]["logprobs"]
    assert lp["tokens"] == [tok.decode([t]) for t in ids]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    for k in range(1, len(ids)):  # position k is predicted by the logits at k - 1
        assert lp["token_logprobs"][k] == pytest.approx(float(ref[k - 1, ids[k]]), abs=1e-4)
        best = int(ref[k - 1].argmax())
        assert lp["top_logprobs"][k][tok.decode([best])] == pytest.approx(
            float(ref[k - 1, best]), abs=1e-4)
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:k]) for k in range(len(ids))]
    full = gen.json()["choices"][0]["logprobs"]
    assert len(full["tokens"]) == len(ids) + 3 and full["tokens"][: len(ids)] == lp["tokens"]
    generated = gen.json()["choices"][0]["text"][len(prompt):]
    assert "".join(full["tokens"][len(ids):]) == generated


def test_prompt_logprobs_per_choice_and_chat_top_level(app, hf):
    model, tok = hf
    first, second = tok("HAMLET:\nTo be").input_ids, tok("LEAR:\nBlow").input_ids
    chat_ids = tok.apply_chat_template(USER, tokenize=True, add_generation_prompt=True,
                                       return_dict=True)["input_ids"]
    comp, chat = post_all(
        app,
        ("/v1/completions", {**GOOD, "prompt": [first, second], "max_tokens": 1,
                             "prompt_logprobs": 2}),
        ("/v1/chat/completions", {"messages": USER, "max_tokens": 1, "prompt_logprobs": 1}),
    )
    choices = comp.json()["choices"]
    for ids, plp in ((first, choices[0]["prompt_logprobs"]), (second, choices[1]["prompt_logprobs"]),
                     (chat_ids, chat.json()["prompt_logprobs"])):
        with torch.inference_mode():
            ref = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
        assert len(plp) == len(ids) and plp[0] is None
        for k in range(1, len(ids)):
            entry = plp[k][str(ids[k])]
            assert entry["logprob"] == pytest.approx(float(ref[k - 1, ids[k]]), abs=1e-4)
            assert entry["rank"] == int((ref[k - 1] > ref[k - 1, ids[k]]).sum()) + 1


@pytest.mark.parametrize("as_ids", [False, True], ids=["texts", "token_ids"])
def test_list_of_prompts_indexes_choices_prompt_major(app, hf, as_ids):
    model, tok = hf
    prompts = ["ROMEO:", "JULIET:", "LEAR:"]
    refs = [tok.decode(greedy_ids(model, tok(p).input_ids, 3)) for p in prompts]
    if as_ids:
        prompts = [tok(p).input_ids for p in prompts]
    full, streamed = post_all(
        app,
        ("/v1/completions", {**GOOD, "prompt": prompts, "n": 2, "max_tokens": 3}),
        ("/v1/completions", {**GOOD, "prompt": prompts, "n": 2, "max_tokens": 3,
                             "stream": True, "stream_options": {"include_usage": True}}),
    )
    body = full.json()
    assert [c["index"] for c in body["choices"]] == list(range(6))
    assert [c["text"] for c in body["choices"]] == [r for r in refs for _ in range(2)]
    prompt_tokens = sum(len(tok(p).input_ids) if isinstance(p, str) else len(p) for p in prompts)
    assert body["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": 18,
                             "total_tokens": prompt_tokens + 18}
    chunks = sse_events(streamed.text)
    texts = [""] * 6
    for ch in chunks[:-1]:
        for c in ch["choices"]:
            texts[c["index"]] += c["text"]
    assert texts == [r for r in refs for _ in range(2)]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == body["usage"]
    assert len({ch["id"] for ch in chunks}) == 1


def test_request_id_header_and_body(app):
    by_header, by_body, neither = asyncio.run(_request_ids(app))
    assert by_header.headers["x-request-id"] == "trace-7"
    assert by_header.json()["id"] == "cmpl-trace-7"
    assert by_body.headers["x-request-id"] == "mine-1"
    assert by_body.json()["id"] == "chatcmpl-mine-1"
    assert neither.json()["id"] == "cmpl-" + neither.headers["x-request-id"]


async def _request_ids(app):
    async with client(app) as c:
        return (
            await c.post("/v1/completions", json={**GOOD, "max_tokens": 1, "request_id": "no"},
                         headers={"X-Request-Id": "trace-7"}),
            await c.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 1,
                                                       "request_id": "mine-1"}),
            await c.post("/v1/completions", json={**GOOD, "max_tokens": 1}),
        )


def test_return_tokens_as_token_ids(app, hf):
    model, tok = hf
    ids = tok("ROMEO:").input_ids
    ref = greedy_ids(model, ids, 3)
    comp, chat = post_all(
        app,
        ("/v1/completions", {**GOOD, "max_tokens": 3, "logprobs": 1,
                             "return_tokens_as_token_ids": True}),
        ("/v1/chat/completions", {"messages": USER, "max_tokens": 2, "temperature": 0,
                                  "logprobs": True, "top_logprobs": 1,
                                  "return_tokens_as_token_ids": True}),
    )
    lp = comp.json()["choices"][0]["logprobs"]
    assert lp["tokens"] == [f"token_id:{t}" for t in ref]
    assert [list(top) for top in lp["top_logprobs"]] == [[f"token_id:{t}"] for t in ref]
    for entry in chat.json()["choices"][0]["logprobs"]["content"]:
        assert entry["token"].startswith("token_id:") and int(entry["token"][9:]) >= 0
        assert entry["top_logprobs"][0]["token"] == entry["token"]


def test_continuous_usage_stats(app, hf):
    _, tok = hf
    n_prompt = len(tok("ROMEO:").input_ids)
    (r,) = post_all(app, ("/v1/completions", {
        **GOOD, "max_tokens": 5, "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}}))
    chunks = sse_events(r.text)
    *token_chunks, last = chunks
    seen = [ch["usage"]["completion_tokens"] for ch in token_chunks]
    assert seen == sorted(seen) and seen[-1] == 5
    assert all(ch["usage"]["prompt_tokens"] == n_prompt for ch in token_chunks)
    assert all(ch["usage"]["total_tokens"] == n_prompt + ch["usage"]["completion_tokens"]
               for ch in token_chunks)
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 5
    (chat,) = post_all(app, ("/v1/chat/completions", {
        "messages": USER, "max_tokens": 3, "temperature": 0, "ignore_eos": True, "stream": True,
        "stream_options": {"continuous_usage_stats": True}}))
    usages = [ch["usage"]["completion_tokens"] for ch in sse_events(chat.text)]
    assert usages[0] == 0 and usages[-1] == 3 and usages == sorted(usages)


def test_truncate_prompt_tokens_keeps_the_last_tokens(app, hf):
    model, tok = hf
    ids = tok("KING LEAR:\nBlow, winds, and crack your cheeks!").input_ids
    ref = tok.decode(greedy_ids(model, ids[-5:], 3))
    text, tokens = post_all(
        app,
        ("/v1/completions", {**GOOD, "prompt": tok.decode(ids, skip_special_tokens=True),
                             "max_tokens": 3, "truncate_prompt_tokens": 5}),
        ("/v1/completions", {**GOOD, "prompt": ids, "max_tokens": 3,
                             "truncate_prompt_tokens": 5}),
    )
    assert tokens.json()["usage"]["prompt_tokens"] == 5
    assert tokens.json()["choices"][0]["text"] == ref
    assert text.json()["usage"]["prompt_tokens"] == 5


def test_logit_bias_allowed_and_bad_words_shape_the_output(app, hf):
    model, tok = hf
    ids = tok("ROMEO:").input_ids
    ref = greedy_ids(model, ids, 6)
    target = tok(" night", add_special_tokens=False).input_ids[-1]
    allowed = sorted({target, ref[0], ref[1]})
    # a word of the greedy output whose tokenization (plain or after a space) is one token
    banned_word, banned_token = next(
        (w, t) for t in ref for w in [tok.decode([t]).strip()] if w
        and t in [ids[0] for ids in (tok(w, add_special_tokens=False).input_ids,
                                     tok(" " + w, add_special_tokens=False).input_ids)
                  if len(ids) == 1])
    bias, allow, bad = post_all(
        app,
        ("/v1/completions", {**GOOD, "max_tokens": 4, "logit_bias": {str(target): 100},
                             "logprobs": 0, "return_tokens_as_token_ids": True}),
        ("/v1/completions", {**GOOD, "max_tokens": 6, "allowed_token_ids": allowed,
                             "temperature": 1.0, "seed": 3, "logprobs": 0,
                             "return_tokens_as_token_ids": True}),
        ("/v1/completions", {**GOOD, "max_tokens": 6, "bad_words": [banned_word],
                             "logprobs": 0, "return_tokens_as_token_ids": True}),
    )
    assert bias.status_code == allow.status_code == bad.status_code == 200, (
        bias.text, allow.text, bad.text)
    as_ids = [int(t[9:]) for t in bias.json()["choices"][0]["logprobs"]["tokens"]]
    assert as_ids == [target] * 4  # +100 outweighs any logit of this model
    as_ids = [int(t[9:]) for t in allow.json()["choices"][0]["logprobs"]["tokens"]]
    assert as_ids and set(as_ids) <= set(allowed)
    as_ids = [int(t[9:]) for t in bad.json()["choices"][0]["logprobs"]["tokens"]]
    assert banned_token not in as_ids and as_ids != ref


def test_min_tokens_holds_back_stop_tokens(app, hf):
    model, tok = hf
    ref = greedy_ids(model, tok("ROMEO:").input_ids, 4)
    stop_now, held = post_all(
        app,
        ("/v1/completions", {**GOOD, "ignore_eos": False, "stop_token_ids": [ref[0]]}),
        ("/v1/completions", {**GOOD, "ignore_eos": False, "stop_token_ids": [ref[0]],
                             "min_tokens": 3}),
    )
    first = stop_now.json()["choices"][0]
    assert first["finish_reason"] == "stop" and first["stop_reason"] == ref[0]
    assert stop_now.json()["usage"]["completion_tokens"] == 1
    assert held.json()["usage"]["completion_tokens"] >= 3


def test_chat_echo_continue_final_message_and_template_kwargs(app, hf):
    model, tok = hf
    convo = USER + [{"role": "assistant", "content": "Good morrow"}]
    cont_text = tok.apply_chat_template(convo, tokenize=False, continue_final_message=True,
                                        add_generation_prompt=False)
    cont_ids = tok(cont_text, add_special_tokens=False).input_ids
    ref = tok.decode(greedy_ids(model, cont_ids, 3))
    no_prompt_ids = tok(tok.apply_chat_template(USER, tokenize=False,
                                                add_generation_prompt=False),
                        add_special_tokens=False).input_ids
    custom = "{{ greeting }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    custom_ids = tok("HAMLET:" + USER[0]["content"], add_special_tokens=False).input_ids
    common = {"max_tokens": 3, "temperature": 0, "ignore_eos": True}
    cont, streamed, no_gen, kwargs = post_all(
        app,
        ("/v1/chat/completions", {**common, "messages": convo, "echo": True,
                                  "continue_final_message": True,
                                  "add_generation_prompt": False}),
        ("/v1/chat/completions", {**common, "messages": convo, "echo": True, "stream": True,
                                  "continue_final_message": True,
                                  "add_generation_prompt": False}),
        ("/v1/chat/completions", {**common, "messages": USER, "add_generation_prompt": False}),
        ("/v1/chat/completions", {**common, "messages": USER, "chat_template": custom,
                                  "chat_template_kwargs": {"greeting": "HAMLET:"}}),
    )
    assert cont.json()["choices"][0]["message"]["content"] == "Good morrow" + ref
    assert cont.json()["usage"]["prompt_tokens"] == len(cont_ids)
    chunks = sse_events(streamed.text)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": "Good morrow"}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == \
        "Good morrow" + ref
    assert no_gen.json()["usage"]["prompt_tokens"] == len(no_prompt_ids)
    assert kwargs.json()["usage"]["prompt_tokens"] == len(custom_ids)


def test_default_max_tokens_completions_16_chat_fills_context(app, async_llm, hf):
    _, tok = hf
    (comp,) = post_all(app, ("/v1/completions", {"prompt": "ROMEO:", "ignore_eos": True}))
    assert comp.json()["usage"]["completion_tokens"] == 16
    n_prompt = len(tok.apply_chat_template(USER, tokenize=True, add_generation_prompt=True,
                                           return_dict=True)["input_ids"])

    async def go():  # read the running chat request's limit in the engine, then leave
        async with client(app) as c:
            task = asyncio.create_task(c.post("/v1/chat/completions", json={
                "messages": USER, "ignore_eos": True, "request_id": "fill"}))
            limits = []
            while not limits:
                await asyncio.sleep(0.01)
                limits = await async_llm.call(lambda: [
                    r.sampling_params.max_tokens
                    for r in async_llm.engine.scheduler.requests.values()])
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        await wait_all_free(async_llm, num_blocks=BLOCKS)
        return limits

    assert asyncio.run(go()) == [1024 - n_prompt]  # the rest of the context, as vLLM


def test_generation_config_defaults_apply_and_requests_override(async_llm, hf, tmp_path):
    model, tok = hf
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.0, "max_new_tokens": 3, "do_sample": False}))
    app = build_app(async_llm, model_name=MODEL, generation_config=str(tmp_path))
    ref = tok.decode(greedy_ids(model, tok("ROMEO:").input_ids, 3))
    default, override = post_all(
        app,
        ("/v1/completions", {"prompt": "ROMEO:", "ignore_eos": True, "max_tokens": None}),
        ("/v1/completions", {"prompt": "ROMEO:", "ignore_eos": True, "max_tokens": 2,
                             "temperature": 0}),
    )
    assert default.json()["choices"][0]["text"] == ref  # greedy, 3 tokens: the model's config
    assert override.json()["usage"]["completion_tokens"] == 2


def test_priority_is_honoured_with_the_priority_policy():
    engine = LLMEngine(device="cpu", block_size=8, num_kv_blocks=80, policy="priority",
                       max_num_seqs=1)
    llm = AsyncLLM(engine)
    app = build_app(llm, model_name=MODEL)
    finished = []

    async def go():
        async with client(app) as c:
            async def one(name, priority, max_tokens=2):
                r = await c.post("/v1/completions", json={**GOOD, "max_tokens": max_tokens,
                                                          "priority": priority})
                finished.append(name)
                return r

            async def num_waiting():
                return await llm.call(lambda: len(engine.scheduler.waiting))

            # "first" holds the only slot for 150 tokens; "low" then "high" queue behind it
            tasks = [asyncio.create_task(one("first", 0, max_tokens=150))]
            while await llm.call(lambda: len(engine.scheduler.running)) == 0:
                await asyncio.sleep(0.005)
            tasks.append(asyncio.create_task(one("low", 5)))
            while await num_waiting() < 1:
                await asyncio.sleep(0.005)
            tasks.append(asyncio.create_task(one("high", -5)))
            while await num_waiting() < 2:
                await asyncio.sleep(0.005)
            assert "first" not in finished  # both queued while the slot was taken
            responses = await asyncio.gather(*tasks)
        await wait_all_free(llm, num_blocks=80)
        await llm.shutdown()
        return responses

    responses = asyncio.run(go())
    assert all(r.status_code == 200 for r in responses)
    assert finished == ["first", "high", "low"]


def test_tools_documents_and_text_response_format_reach_the_template(app, hf):
    _, tok = hf
    template = ("{{ tools | length }}/{{ documents | length }}"
                "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    tools = [{"type": "function", "function": {"name": n}} for n in ("a", "b")]
    (r,) = post_all(app, ("/v1/chat/completions", {
        "messages": USER, "max_tokens": 1, "chat_template": template, "tools": tools,
        "tool_choice": "none", "documents": [{"text": "x"}], "response_format": {"type": "text"},
        "parallel_tool_calls": False}))
    expected = tok("2/1" + USER[0]["content"], add_special_tokens=False).input_ids
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(expected)
