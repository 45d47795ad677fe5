"""``workbench serve --cluster``: the official ``openai`` client against a cluster front on
127.0.0.1. Real replicas answer transformers' greedy text; each answer names its replica in
a header; the router's choices follow a hand-worked sequence; /metrics labels each replica."""

from __future__ import annotations

import json
import re
import time

import httpx
import openai
import pytest

from workbench.entrypoints.cli import build_parser
from workbench.entrypoints.openai.cluster_server import (REPLICA_HEADER, ClusterServeConfig, build_cluster_app,
                                                         shutdown)

from serving_support import MODEL, greedy_ids, hf, uvicorn_server  # noqa: F401  (hf: a fixture)

SMALL = {"device": "cpu", "block_size": 8, "num_kv_blocks": 64}
CONFIG = {"router": "round_robin", "served_model_name": MODEL,
          "replicas": [SMALL, SMALL, {**SMALL, "simulated": True}]}


@pytest.fixture(scope="module")
def served():
    front = build_cluster_app(json.dumps(CONFIG))
    with uvicorn_server(front) as base_url:
        yield front, base_url, openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=60)
    shutdown(front)


def test_completions_and_streamed_chat_name_their_replica_in_round_robin_order(served, hf):
    front, base_url, api = served
    _, tok = hf
    ref = tok.decode(greedy_ids(hf[0], tok("ROMEO:").input_ids, 6))
    replicas = []
    for _ in range(2):
        raw = api.completions.with_raw_response.create(model=MODEL, prompt="ROMEO:", max_tokens=6, temperature=0,
                                                       extra_body={"ignore_eos": True})
        replicas.append(int(raw.headers[REPLICA_HEADER]))
        assert raw.parse().choices[0].text == ref  # two real replicas: the model's own greedy text
    messages = [{"role": "user", "content": "Good morrow."}]
    with api.chat.completions.with_streaming_response.create(model=MODEL, messages=messages, max_tokens=5,
                                                             stream=True, extra_body={"ignore_eos": True}) as resp:
        replicas.append(int(resp.headers[REPLICA_HEADER]))
        chunks = list(resp.parse())
    assert chunks[-1].choices[0].finish_reason == "length"
    assert "".join(c.choices[0].delta.content or "" for c in chunks)  # the simulated replica's filler text
    stream = api.completions.create(model=MODEL, prompt="JULIET:", max_tokens=4, stream=True, temperature=0)
    assert sum(len(c.choices[0].text) for c in stream) > 0
    assert replicas == [0, 1, 2]
    assert [d["replica"] for d in front.decisions] == [0, 1, 2, 0]
    deadline = time.monotonic() + 10  # the last stream's server side ends just after the client read [DONE]
    while front.in_flight != [0, 0, 0] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert front.in_flight == [0, 0, 0]

    text = httpx.get(f"{base_url}/metrics").text
    served_by = {}
    for line in text.splitlines():
        m = re.match(r'vllm:request_success_total\{(.*)\} ([0-9.e+]+)', line)
        if m:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
            served_by[labels["replica"]] = served_by.get(labels["replica"], 0) + float(m.group(2))
    assert served_by == {"0": 2.0, "1": 1.0, "2": 1.0}
    assert httpx.get(f"{base_url}/health").status_code == 200
    assert [m.id for m in api.models.list()] == [MODEL]


def test_cache_aware_front_keeps_a_shared_prefix_on_its_replica():
    """SGLang's rule by hand on two simulated replicas: A goes to the smaller tree (0), B to
    the other (1, now smaller), A's prefix again to 0, whichever is less loaded."""
    front = build_cluster_app({"router": "cache_aware", "router_options": {"cache_threshold": 0.5},
                               "replicas": [{"simulated": True, **SMALL}, {"simulated": True, **SMALL}]})
    try:
        a = "ROMEO: But soft, what light through yonder window breaks? It is the east."
        b = "JULIET: O Romeo, Romeo, wherefore art thou Romeo? Deny thy father."

        async def go():
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=front), base_url="http://t") as c:
                out = []
                for prompt in (a, b, a + " And Juliet is the sun."):
                    r = await c.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2})
                    assert r.status_code == 200, r.text
                    out.append(int(r.headers[REPLICA_HEADER]))
                return out

        import asyncio
        assert asyncio.run(go()) == [0, 1, 0]
        assert front.decisions[2]["match_0"] > 0.5 and front.decisions[2]["match_1"] < 0.5
    finally:
        shutdown(front)


@pytest.mark.parametrize("data, words", [
    ({"replicas": []}, "'replicas' must be a non-empty list"),
    ({"replicas": [{}], "prefill": [{}], "decode": [{}]}, "['decode', 'prefill']"),
    ({"replicas": [{}], "routr": "x"}, "unknown key(s) ['routr']"),
    ({"replicas": [{}, {"simulated": "yes"}]}, "replicas[1].simulated must be true or false"),
    ({"replicas": [{"num_kv_block": 4}]}, "replicas[0]: unknown EngineConfig field(s) ['num_kv_block']"),
    ({"replicas": [{}], "router": "fastest"}, "router must be one of"),
])
def test_bad_cluster_json_names_the_field(data, words):
    with pytest.raises(ValueError) as err:
        ClusterServeConfig.from_json(json.dumps(data))
    assert words in str(err.value)
    with pytest.raises(ValueError, match="router_options for 'cache_aware'"):
        ClusterServeConfig.from_json({"replicas": [{}], "router": "cache_aware",
                                      "router_options": {"threshold": 1}}).make_router()


def test_cli_serve_takes_a_cluster_file(tmp_path):
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps(CONFIG))
    args = build_parser().parse_args(["serve", "--cluster", str(path)])
    config = ClusterServeConfig.from_json(args.cluster)
    assert [r.simulated for r in config.replicas] == [False, False, True] and config.router == "round_robin"
    assert config.replicas[0].config.num_kv_blocks == 64
