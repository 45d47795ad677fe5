"""start_profile / stop_profile: torch.profiler over engine steps with the stages as ranges, a
trace with the engine timeline aligned beside it, the top operators; the engine unchanged."""

import asyncio
import json

import pytest

from serving_support import MODEL, client
from workbench import LLMEngine, SamplingParams
from workbench.engine.async_llm import AsyncLLM
from workbench.engine.profiler import TIMELINE_PID
from workbench.entrypoints.openai.api_server import build_app

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
RANGES = {"schedule", "execute", "forward", "sample", "output", "record"}


def run(engine, steps=None):
    engine.add_request("a", "ROMEO:", GREEDY)
    engine.add_request("b", "JULIET:", GREEDY)
    outs = {}
    for _ in range(steps or 10**6):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            outs[out.request_id] = out.outputs[0].token_ids
    return outs


def test_a_profile_holds_torch_ops_the_stage_ranges_and_the_aligned_engine_timeline(tmp_path, capsys):
    reference = run(LLMEngine(device="cpu", block_size=8, num_kv_blocks=16))
    engine = LLMEngine(device="cpu", block_size=8, num_kv_blocks=16)
    with pytest.raises(RuntimeError, match="not running"):
        engine.stop_profile()
    with pytest.raises(ValueError, match="torch_profiler_dir"):
        engine.start_profile()
    engine.start_profile(str(tmp_path))
    with pytest.raises(RuntimeError, match="already running"):
        engine.start_profile(str(tmp_path))
    run(engine, steps=3)
    path = engine.stop_profile()
    assert "Self CPU" in capsys.readouterr().out  # the top-operators table
    trace = json.loads(path.read_text())
    events = trace["traceEvents"]
    torch_events = [e for e in events if e.get("pid") != TIMELINE_PID]
    names = {e.get("name") for e in torch_events}
    assert any(str(n).startswith("aten::") for n in names)
    assert RANGES | {"step 0", "step 1", "step 2"} <= names
    timeline = [e for e in events if e.get("pid") == TIMELINE_PID and e.get("cat") == "step"]
    assert [e["name"] for e in timeline] == ["step 0", "step 1", "step 2"]
    anchor = next(e for e in torch_events if e.get("name") == "step 0" and e.get("ph") == "X")
    assert timeline[0]["ts"] == pytest.approx(float(anchor["ts"]), abs=1e-3)
    # Stopped: the engine's own methods show through again and it generates as before.
    assert not {"step", "_record"} & set(vars(engine)) and "schedule" not in vars(engine.scheduler)
    assert "execute" not in vars(engine.runner) and not engine.runner.model._forward_hooks
    assert run_rest(engine) == reference  # cumulative outputs: every token of both requests


def run_rest(engine):
    outs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs[out.request_id] = out.outputs[0].token_ids
    return outs


def test_the_server_profiles_when_a_profiler_directory_is_set(tmp_path):
    plain = AsyncLLM(LLMEngine(device="cpu", block_size=8, num_kv_blocks=16))
    profiled = AsyncLLM(LLMEngine(device="cpu", block_size=8, num_kv_blocks=16, torch_profiler_dir=str(tmp_path)))

    async def go():
        async with client(build_app(plain, model_name=MODEL)) as c:
            assert (await c.post("/start_profile")).status_code == 404
        async with client(build_app(profiled, model_name=MODEL)) as c:
            assert (await c.post("/stop_profile")).status_code == 400
            assert (await c.post("/start_profile")).status_code == 200
            body = {"model": MODEL, "prompt": "ROMEO:", "max_tokens": 3, "temperature": 0}
            assert (await c.post("/v1/completions", json=body)).status_code == 200
            assert (await c.post("/stop_profile")).status_code == 200
        await plain.shutdown()
        await profiled.shutdown()

    asyncio.run(go())
    (path,) = tmp_path.glob("profile-*.json")
    names = {e.get("name") for e in json.loads(path.read_text())["traceEvents"]}
    assert RANGES <= names
