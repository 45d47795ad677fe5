"""vLLM's disaggregated-serving flow over HTTP: a prefill server (kv_producer) answers a
``max_tokens=1`` request carrying ``kv_transfer_params: {"do_remote_decode": true}`` with
the params a decode server (kv_consumer) takes; the decode answer equals a colocated
server's, and both servers end with every block free. A server without a connector still
refuses the field (400), and malformed params are a 400 naming the field."""

import asyncio


from serving_support import MODEL, client, wait_all_free
from workbench import LLMEngine
from workbench.engine.async_llm import AsyncLLM
from workbench.entrypoints.openai.api_server import build_app

BLOCKS = 32
BODY = {"model": MODEL, "prompt": "JULIET:\nO Romeo, Romeo! wherefore art thou Romeo?",
        "max_tokens": 12, "temperature": 0}


def server(role=None, engine_id=None):
    kv = None if role is None else {"kv_role": role, "engine_id": engine_id,
                                     "kv_connector_extra_config": {"link_latency_s": 0.001}}
    llm = AsyncLLM(LLMEngine(device="cpu", dtype="float32", block_size=8, num_kv_blocks=BLOCKS,
                             kv_transfer_config=kv))
    return llm, build_app(llm, model_name=MODEL)


def test_a_disaggregated_request_over_http_equals_its_colocated_twin():
    async def run():
        servers = [server("kv_producer", "http-p"), server("kv_consumer", "http-d"), server()]
        (p_llm, p_app), (d_llm, d_app), (c_llm, c_app) = servers
        try:
            async with client(p_app) as p, client(d_app) as d, client(c_app) as c:
                first = await p.post("/v1/completions", json={
                    **BODY, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
                assert first.status_code == 200, first.text
                params = first.json()["kv_transfer_params"]
                assert params["do_remote_prefill"] and params["remote_engine_id"] == "http-p"
                second = await d.post("/v1/completions", json={**BODY, "kv_transfer_params": params})
                twin = await c.post("/v1/completions", json=BODY)
                assert second.status_code == twin.status_code == 200, second.text
                assert second.json()["choices"][0]["text"] == twin.json()["choices"][0]["text"]
                assert "kv_transfer_params" not in twin.json()
                assert second.json()["usage"] == twin.json()["usage"]
                bad = await d.post("/v1/completions", json={
                    **BODY, "kv_transfer_params": {"do_remote_prefill": True, "remote_engine_id": "http-p"}})
                assert bad.status_code == 400 and "remote_request_id" in bad.text
                refused = await c.post("/v1/completions", json={**BODY, "kv_transfer_params": {"x": 1}})
                assert refused.status_code == 400 and "kv_transfer_params" in refused.text
                await p.post("/v1/completions", json=BODY)  # a step of the producer after the read
                for llm in (p_llm, d_llm, c_llm):
                    await wait_all_free(llm, num_blocks=BLOCKS)
        finally:
            for llm, _ in servers:
                await llm.shutdown()

    asyncio.run(run())
