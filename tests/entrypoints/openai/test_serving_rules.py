"""vLLM's serving rules where this server used to differ: the completions defaults (a null
``max_tokens`` is 16, as vLLM's ``normalize_null_max_tokens``; nullable ``echo``/``stream``)
and the Authorization header's parsing (vLLM's AuthenticationMiddleware: scheme before the
first space, any case; the rest unstripped equals a key; only paths starting ``/v1``).
Expectations are written from those rules and checked against the Hugging Face tokenizer."""

from __future__ import annotations

import asyncio

import pytest

from workbench.entrypoints.openai.api_server import build_app

from serving_support import GOOD, KEY, MODEL, client, serving_fixtures

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
