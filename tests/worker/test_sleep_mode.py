"""Sleep mode: the freed tensor storage at each level, identical greedy outputs after waking
(the reference: the same engine's outputs before it slept), refusals, the dev-mode endpoints."""

import asyncio

import pytest

from serving_support import MODEL, client
from workbench import LLMEngine, SamplingParams
from workbench.engine.async_llm import AsyncLLM
from workbench.entrypoints.openai.api_server import build_app

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPTS = ["ROMEO:", "JULIET:\nO Romeo"]


def generate(engine):
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"g{i}", prompt, GREEDY)
    outs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs[out.request_id] = out.outputs[0].token_ids
    return [outs[f"g{i}"] for i in range(len(PROMPTS))]


def storage(tensors) -> int:
    return sum(t.untyped_storage().nbytes() for t in tensors)


@pytest.fixture(scope="module")
def engine():
    return LLMEngine(device="cpu", block_size=8, num_kv_blocks=16, enable_sleep_mode=True)


def test_level_1_frees_the_kv_cache_keeps_the_weights_in_host_memory_and_wakes_identical(engine):
    before = generate(engine)
    model = engine.runner.model
    weights = storage(model.parameters())
    kv = storage(t for layer in engine.runner.kv_caches for t in layer)
    assert weights > 0 and kv > 0
    engine.sleep(1)
    assert engine.is_sleeping() and engine.runner.kv_caches == []
    assert storage(model.parameters()) == 0 and storage(model.buffers()) == 0
    assert storage(engine.runner.sleep_mode._weights.values()) == weights  # kept in host memory
    with pytest.raises(ValueError, match="The engine is sleeping: wake_up"):
        engine.add_request("late", "ROMEO:", GREEDY)
    engine.sleep(1)  # asleep already: a warning, nothing done
    engine.wake_up()
    assert not engine.is_sleeping() and storage(model.parameters()) == weights
    assert storage(t for layer in engine.runner.kv_caches for t in layer) == kv
    assert generate(engine) == before


def test_level_2_frees_both_and_reloads_the_checkpoint_waking_one_tag_at_a_time(engine):
    before = generate(engine)
    model = engine.runner.model
    weights = storage(model.parameters())
    engine.sleep(2)
    assert storage(model.parameters()) == 0 and engine.runner.sleep_mode._weights == {}
    engine.wake_up(["weights"])
    assert engine.is_sleeping() and storage(model.parameters()) == weights and engine.runner.kv_caches == []
    engine.wake_up(["kv_cache"])
    assert not engine.is_sleeping()
    assert generate(engine) == before


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_frees_the_packed_weight_copies_and_waking_packs_the_weights_again(monkeypatch, level):
    """With oneDNN's packed copies in use (kernels/cpu_linear.py): sleep frees them, and the
    woken engine packs its weights again and generates the same tokens."""
    monkeypatch.setenv("WORKBENCH_CPU_GEMM", "onednn")
    engine = LLMEngine(device="cpu", block_size=8, num_kv_blocks=16, enable_sleep_mode=True)
    def copies():
        return [m.packed for m in engine.runner.model.modules() if getattr(m, "packed", None) is not None]

    before = generate(engine)
    held = copies()
    assert held and all(c.nbytes > 0 for c in held)  # the prefill's rows took oneDNN
    engine.sleep(level)
    assert all(c.nbytes == 0 for c in held)
    engine.wake_up()
    assert generate(engine) == before
    assert all(c.nbytes > 0 for c in copies())  # level 2's reload gives fresh copies


def test_sleep_is_refused_with_requests_in_flight_and_nothing_is_lost(engine):
    engine.add_request("busy", "ROMEO:", GREEDY)
    engine.step()
    with pytest.raises(RuntimeError, match=r"Failed to reset prefix cache because some blocks \(\d+\) are not freed yet"):
        engine.sleep(1)
    assert not engine.is_sleeping() and engine.scheduler.requests["busy"]
    while engine.has_unfinished_requests():
        engine.step()
    with pytest.raises(ValueError, match="level must be 1 or 2, got 3"):
        engine.sleep(3)
    with pytest.raises(ValueError, match=r"tags: unknown \['gpu'\]"):
        engine.wake_up(["gpu"])
    plain = LLMEngine(device="cpu", block_size=8, num_kv_blocks=8)
    for call in (plain.sleep, plain.wake_up):  # vLLM's LLMEngine asserts, in both
        with pytest.raises(AssertionError, match="^Sleep mode is not enabled in the model config$"):
            call()
    assert not plain.is_sleeping()


def test_dev_mode_endpoints_sleep_and_wake_the_served_engine(monkeypatch):
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")
    llm = AsyncLLM(LLMEngine(device="cpu", block_size=8, num_kv_blocks=16, enable_sleep_mode=True))
    body = {"model": MODEL, "prompt": "ROMEO:", "max_tokens": 5, "temperature": 0, "ignore_eos": True}

    async def go():
        async with client(build_app(llm, model_name=MODEL)) as c:
            first = (await c.post("/v1/completions", json=body)).json()["choices"][0]["text"]
            assert (await c.get("/is_sleeping")).json() == {"is_sleeping": False}
            assert (await c.post("/sleep", params={"level": 2})).status_code == 200
            assert (await c.get("/is_sleeping")).json() == {"is_sleeping": True}
            asleep = await c.post("/v1/completions", json=body)
            assert asleep.status_code == 400 and "sleeping" in asleep.json()["error"]["message"]
            bad = await c.post("/wake_up", params={"tags": "gpu"})
            assert bad.status_code == 400 and "unknown ['gpu']" in bad.json()["error"]["message"]
            assert (await c.post("/wake_up", params=[("tags", "weights"), ("tags", "kv_cache")])).status_code == 200
            assert (await c.get("/is_sleeping")).json() == {"is_sleeping": False}
            again = (await c.post("/v1/completions", json=body)).json()["choices"][0]["text"]
            assert again == first
        await llm.shutdown()

    asyncio.run(go())
    monkeypatch.delenv("VLLM_SERVER_DEV_MODE")
    plain = AsyncLLM(LLMEngine(device="cpu", block_size=8, num_kv_blocks=8))

    async def closed():
        async with client(build_app(plain, model_name=MODEL)) as c:
            assert (await c.post("/sleep")).status_code == 404
        await plain.shutdown()

    asyncio.run(closed())
