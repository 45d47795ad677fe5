"""vLLM's serving rules where this server used to differ: the completions defaults (a null
``max_tokens`` is 16, as vLLM's ``normalize_null_max_tokens``; nullable ``echo``/``stream``)
and the Authorization header's parsing (vLLM's AuthenticationMiddleware: scheme before the
first space, any case; the rest unstripped equals a key; only paths starting ``/v1``).
Expectations are written from those rules and checked against the Hugging Face tokenizer."""

from __future__ import annotations

import asyncio

import pytest

from workbench.entrypoints.openai.api_server import build_app

from serving_support import GOOD, KEY, MODEL, client, hf, serving_fixtures, sse_events  # noqa: F401

async_llm, app = serving_fixtures()


@pytest.fixture(scope="module")
def two_keys_app(async_llm):
    return build_app(async_llm, model_name=MODEL, api_key=[KEY, "second key"])


def post_all(app, requests):
    async def go():
        async with client(app) as c:
            return [await c.request(method, path, json=body, headers=headers)
                    for method, path, body, headers in requests]
    return asyncio.run(go())


def test_null_max_tokens_is_sixteen_and_null_flags_are_their_defaults(app):
    body = {k: v for k, v in GOOD.items() if k != "max_tokens"}
    absent, null = post_all(app, [
        ("POST", "/v1/completions", body, {}),
        ("POST", "/v1/completions", {**body, "max_tokens": None, "echo": None,
                                     "stream": None}, {}),
    ])
    assert absent.status_code == 200 and null.status_code == 200, null.text
    assert absent.json()["usage"]["completion_tokens"] == 16  # ignore_eos: exactly the limit
    assert null.json()["usage"]["completion_tokens"] == 16
    assert null.json()["choices"][0]["text"] == absent.json()["choices"][0]["text"]


def test_chat_null_n_and_logprobs_are_their_defaults(app):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
            "n": None, "logprobs": None, "stream": None}
    (answer,) = post_all(app, [("POST", "/v1/chat/completions", body, {})])
    assert answer.status_code == 200, answer.text
    assert len(answer.json()["choices"]) == 1 and answer.json()["choices"][0]["logprobs"] is None


@pytest.mark.parametrize("header, ok", [
    (f"Bearer {KEY}", True),
    (f"bearer {KEY}", True),       # the scheme in any case
    (f"BEARER {KEY}", True),
    ("Bearer second key", True),   # the rest of the header, spaces and all, is the key
    (f"Bearer  {KEY}", False),     # not stripped: " sesame" is not a key
    (f"Bearer {KEY} ", False),
    (f"Token {KEY}", False),
    (f"Bearer{KEY}", False),
    (KEY, False),
    ("", False),
    (None, False),
])
def test_authorization_header_follows_vllms_rule(two_keys_app, header, ok):
    headers = {} if header is None else {"Authorization": header}
    (answer,) = post_all(two_keys_app, [("GET", "/v1/models", None, headers)])
    assert answer.status_code == (200 if ok else 401), answer.text
    if not ok:
        assert answer.json()["error"]["type"] == "AuthenticationError"


def test_only_v1_paths_are_guarded(two_keys_app):
    """vLLM guards paths starting /v1; /health, /tokenize and /detokenize are open there."""
    health, tokenize, models, options = post_all(two_keys_app, [
        ("GET", "/health", None, {}),
        ("POST", "/tokenize", {"prompt": "ROMEO:"}, {}),
        ("GET", "/v1/models", None, {}),
        ("OPTIONS", "/v1/models", None, {}),
    ])
    assert health.status_code == 200 and tokenize.status_code == 200
    assert models.status_code == 401
    assert options.status_code != 401  # OPTIONS passes the middleware (the route answers 405)


# ---------------------------------------------------------------------------- return_token_ids
def test_return_token_ids_completions_whole_and_streamed(app, hf):
    _, tok = hf
    body = {**GOOD, "prompt": "ROMEO:", "max_tokens": 6, "return_token_ids": True}
    whole, streamed, plain = post_all(app, [
        ("POST", "/v1/completions", body, {}),
        ("POST", "/v1/completions", {**body, "stream": True}, {}),
        ("POST", "/v1/completions", {**GOOD, "max_tokens": 6}, {}),
    ])
    choice = whole.json()["choices"][0]
    assert choice["prompt_token_ids"] == tok("ROMEO:").input_ids
    assert len(choice["token_ids"]) == 6 and tok.decode(choice["token_ids"]) == choice["text"]
    assert "token_ids" not in plain.json()["choices"][0]  # absent unless asked, as before
    assert "prompt_token_ids" not in plain.json()["choices"][0]
    chunks = [c for c in sse_events(streamed.text) if c["choices"]]
    assert chunks[0]["choices"][0]["prompt_token_ids"] == choice["prompt_token_ids"]
    assert all("prompt_token_ids" not in c["choices"][0] for c in chunks[1:])
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == choice["token_ids"]


def test_return_token_ids_chat_whole_and_streamed(app, hf):
    _, tok = hf
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Speak."}],
            "max_tokens": 5, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    whole, streamed = post_all(app, [
        ("POST", "/v1/chat/completions", body, {}),
        ("POST", "/v1/chat/completions", {**body, "stream": True}, {}),
    ])
    data = whole.json()
    rendered = tok.apply_chat_template(body["messages"], tokenize=False,
                                       add_generation_prompt=True)
    assert data["prompt_token_ids"] == tok(rendered, add_special_tokens=False).input_ids
    ids = data["choices"][0]["token_ids"]
    assert len(ids) == 5 and tok.decode(ids) == data["choices"][0]["message"]["content"]
    chunks = sse_events(streamed.text)
    assert chunks[0]["prompt_token_ids"] == data["prompt_token_ids"]
    assert all("prompt_token_ids" not in c for c in chunks[1:])
    assert [t for c in chunks for ch in c["choices"] for t in ch.get("token_ids", [])] == ids


# ---------------------------------------------------------------------------- cache_salt
def test_cache_salt_is_honoured_and_checked_as_vllm(app, async_llm):
    salted = {**GOOD, "cache_salt": "tenant-a"}
    ok, empty, slash, long = post_all(app, [
        ("POST", "/v1/completions", salted, {}),
        ("POST", "/v1/completions", {**GOOD, "cache_salt": ""}, {}),
        ("POST", "/v1/chat/completions", {"model": MODEL, "cache_salt": "a/b",
                                          "messages": [{"role": "user", "content": "Hi"}]}, {}),
        ("POST", "/v1/completions", {**GOOD, "cache_salt": "x" * 129}, {}),
    ])
    plain, = post_all(app, [("POST", "/v1/completions", GOOD, {})])
    assert ok.status_code == 200
    assert ok.json()["choices"][0]["text"] == plain.json()["choices"][0]["text"]
    for bad in (empty, slash, long):
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "cache_salt", bad.text
    assert "at least 1 character" in empty.json()["error"]["message"]  # vLLM's min_length=1
    assert "must not contain '@', '/'" in slash.json()["error"]["message"]
    assert "at most 128 characters" in long.json()["error"]["message"]
