"""Multi-LoRA over HTTP with the official ``openai`` client: ``--lora-modules`` adapters in
/v1/models with their ``parent``, a request's ``model`` selecting its adapter (texts equal
transformers + PEFT's greedy ones), vLLM's 404 for an unknown name, the runtime
load/unload endpoints behind ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``, and
``vllm:lora_requests_info`` on /metrics."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
import torch
import transformers

from workbench import LLMEngine, LoRARequest, SamplingParams, default_model_path
from workbench.engine.async_llm import AsyncLLM
from workbench.entrypoints.cli import parse_lora_modules
from workbench.entrypoints.openai.api_server import build_app
from workbench.metrics.prometheus import PrometheusStatLogger
from workbench.model.loader import embedded_lora_path

from serving_support import MODEL, client, uvicorn_server

ERRORS, TIMON = str(embedded_lora_path("errors")), str(embedded_lora_path("timon"))


@pytest.fixture(scope="module")
def server():
    mp = pytest.MonkeyPatch()
    mp.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
    llm = AsyncLLM(LLMEngine(device="cpu", dtype="float32", block_size=8, num_kv_blocks=64,
                             enable_lora=True, max_loras=2))
    app = build_app(llm, model_name=MODEL, lora_modules=parse_lora_modules([f"errors={ERRORS}"]))
    mp.undo()
    with uvicorn_server(app) as base_url:
        yield base_url, openai.OpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0, timeout=30)
    asyncio.run(llm.shutdown())


def peft_text(path, prompt, n):
    from peft import PeftModel

    base = transformers.AutoModelForCausalLM.from_pretrained(default_model_path(), dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(default_model_path())
    model = PeftModel.from_pretrained(base, path).eval() if path else base.eval()
    ids = torch.tensor([tok(prompt).input_ids])
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=n, eos_token_id=None)
    return tok.decode(out[0, ids.shape[1]:])


def complete(api, model, prompt="ADRIANA:", n=8):
    c = api.completions.create(model=model, prompt=prompt, max_tokens=n, temperature=0,
                               extra_body={"ignore_eos": True})
    assert c.model == model
    return c.choices[0].text


def test_models_list_the_adapters_with_their_parent(server):
    _, api = server
    models = api.models.list().data
    assert [m.id for m in models] == [MODEL, "errors"]
    assert models[1].parent == MODEL and models[1].root == ERRORS and models[0].parent is None


def test_the_model_field_selects_the_adapter(server):
    _, api = server
    with_adapter, plain = complete(api, "errors"), complete(api, MODEL)
    assert with_adapter == peft_text(ERRORS, "ADRIANA:", 8)
    assert plain == peft_text(None, "ADRIANA:", 8) and plain != with_adapter


def test_an_unknown_adapter_is_vllm_s_404(server):
    _, api = server
    with pytest.raises(openai.NotFoundError) as info:
        complete(api, "timon")
    assert info.value.body["message"] == "The model `timon` does not exist."
    assert info.value.body["param"] == "model"


def test_load_and_unload_at_run_time(server):
    base_url, api = server
    post = lambda path, body: httpx.post(f"{base_url}/v1/{path}", json=body, timeout=30)  # noqa: E731
    r = post("load_lora_adapter", {"lora_name": "timon", "lora_path": TIMON})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'timon' added successfully."
    assert [m.id for m in api.models.list().data] == [MODEL, "errors", "timon"]
    assert complete(api, "timon", "TIMON:") == peft_text(TIMON, "TIMON:", 8)
    again = post("load_lora_adapter", {"lora_name": "timon", "lora_path": TIMON})
    assert again.status_code == 400
    assert again.json()["error"]["message"] == "The lora adapter 'timon' has already been loaded."
    bad = post("load_lora_adapter", {"lora_name": "bad", "lora_path": "/no/such/dir"})
    assert bad.status_code == 400 and "/no/such/dir/adapter_config.json: no such file" in bad.text
    assert post("load_lora_adapter", {"lora_name": "x"}).status_code == 400
    r = post("unload_lora_adapter", {"lora_name": "timon"})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'timon' removed successfully."
    with pytest.raises(openai.NotFoundError):
        complete(api, "timon")
    gone = post("unload_lora_adapter", {"lora_name": "timon"})
    assert gone.status_code == 404
    assert gone.json()["error"]["message"] == "The lora adapter 'timon' cannot be found."


def test_runtime_updating_needs_vllm_s_opt_in():
    llm = AsyncLLM(LLMEngine(device="cpu", block_size=8, num_kv_blocks=16, enable_lora=True))

    async def go():
        async with client(build_app(llm, model_name=MODEL)) as c:
            r = await c.post("/v1/load_lora_adapter", json={"lora_name": "t", "lora_path": TIMON})
            assert r.status_code == 404
            body = {"model": MODEL, "prompt": "ROMEO:", "max_tokens": 2}
            assert (await c.post("/v1/completions", json=body)).status_code == 200
            metrics = (await c.get("/metrics")).text
            assert 'vllm:lora_requests_info{max_lora="1",running_lora_adapters="",' \
                   'waiting_lora_adapters=""}' in metrics
        await llm.shutdown()

    asyncio.run(go())


def test_lora_requests_info_names_running_and_waiting_adapters():
    engine = LLMEngine(device="cpu", block_size=8, num_kv_blocks=16, enable_lora=True, max_loras=1)
    logger = PrometheusStatLogger(MODEL, max_lora=1)
    engine.add_logger("prometheus", logger)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    engine.add_request("a", "ADRIANA:", params, lora_request=LoRARequest("errors", 1, ERRORS))
    engine.add_request("b", "TIMON:", params, lora_request=LoRARequest("timon", 2, TIMON))
    engine.step()  # max_loras=1: timon waits
    assert engine.scheduler_stats.running_lora_adapters == {"errors": 1}
    assert engine.scheduler_stats.waiting_lora_adapters == {"timon": 1}
    [sample] = [s for m in logger.registry.collect() if m.name == "vllm:lora_requests_info"
                for s in m.samples]
    assert sample.labels == {"max_lora": "1", "running_lora_adapters": "errors",
                             "waiting_lora_adapters": "timon"}
