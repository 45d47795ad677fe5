"""vLLM's LoRA API on the engine and its entry points: add/remove/list/pin_lora, lora_request=
on LLMEngine.add_request, LLM.generate / chat and AsyncLLM.generate; a LoRA request with LoRA
disabled is vLLM's ValueError; a bad adapter is refused at add time naming its file, and the
requests in flight finish as if it had never been tried."""

from __future__ import annotations

import asyncio

import pytest
from lora_support import make_peft_adapter

from workbench import LLM, LLMEngine, LoRARequest, SamplingParams
from workbench.engine.async_llm import AsyncLLM

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    paths = {}
    for i, name in enumerate(("a", "b")):
        paths[name] = tmp_path_factory.mktemp(name)
        make_peft_adapter(paths[name], r=4, seed=i, targets=("q_proj", "v_proj", "down_proj"))
    return {name: LoRARequest(name, i + 1, str(p)) for i, (name, p) in enumerate(paths.items())}


def engine(**kw):
    return LLMEngine(device="cpu", dtype="float32", block_size=4, num_kv_blocks=64, **kw)


def drain(e):
    out = {}
    while e.has_unfinished_requests():
        for o in e.step():
            if o.finished:
                out[o.request_id] = o.outputs[0].token_ids
    return out


def test_lora_disabled_is_vllm_s_value_error(adapters):
    e = engine()
    with pytest.raises(ValueError, match=r"Got lora_request LoRARequest\(lora_name='a', lora_int_id=1\) "
                                         r"but LoRA is not enabled!"):
        e.add_request("r", "ROMEO:", GREEDY, lora_request=adapters["a"])
    with pytest.raises(ValueError, match="LoRA is not enabled"):
        e.add_lora(adapters["a"])
    assert not e.has_unfinished_requests()


def test_lora_request_checks_its_fields():
    with pytest.raises(ValueError, match="id must be > 0, got 0"):
        LoRARequest("a", 0, "/x")
    with pytest.raises(ValueError, match="lora_name must be a non-empty string"):
        LoRARequest("", 1, "/x")
    assert LoRARequest("a", 1, "/x") == LoRARequest("a", 2, "/y")  # vLLM: the same name


def test_add_remove_list_pin(adapters):
    e = engine(enable_lora=True, max_loras=1, max_cpu_loras=2)
    a, b = adapters["a"], adapters["b"]
    assert e.list_loras() == set()
    assert e.add_lora(a) is True and e.add_lora(a) is False
    assert e.add_lora(b) is True and e.list_loras() == {1, 2}
    assert e.pin_lora(2) is True
    with pytest.raises(ValueError, match="LoRA 7 is not registered"):
        e.pin_lora(7)
    with pytest.raises(ValueError, match=r"all max_loras=1 device slots hold pinned adapters \['b'\]"):
        e.add_request("r", "ROMEO:", GREEDY, lora_request=a)  # it could never get a slot
    e.add_request("p", "ROMEO:", GREEDY, lora_request=b)
    assert e.remove_lora(1) is True and e.remove_lora(1) is False and e.list_loras() == {2}
    assert len(drain(e)["p"]) == 8
    assert e.remove_lora(2) is True
    e.add_request("r", "ROMEO:", GREEDY, lora_request=a)  # loaded again at add time
    assert e.list_loras() == {1}
    e.step()
    with pytest.raises(ValueError, match=r"max_loras=1 device slots are taken by \['a'\]"):
        e.add_lora(b), e.pin_lora(2)  # a runs: pinning b would leave a no slot
    assert len(drain(e)["r"]) == 8 and e.pin_lora(2)


def test_a_bad_adapter_is_refused_and_the_others_run_on(adapters, tmp_path):
    clean = engine(enable_lora=True, max_loras=2)
    clean.add_request("x", "ROMEO:", GREEDY, lora_request=adapters["a"])
    clean.add_request("y", "JULIET:", GREEDY)
    expected = drain(clean)

    e = engine(enable_lora=True, max_loras=2, max_lora_rank=4)
    e.add_request("x", "ROMEO:", GREEDY, lora_request=adapters["a"])
    e.add_request("y", "JULIET:", GREEDY)
    e.step()
    with pytest.raises(ValueError, match=f"{tmp_path}/adapter_config.json: no such file"):
        e.add_request("bad", "ROMEO:", GREEDY, lora_request=LoRARequest("bad", 3, str(tmp_path)))
    big = tmp_path / "big"
    make_peft_adapter(big, r=8)
    with pytest.raises(ValueError, match=f"{big}/adapter_config.json: LoRA rank 8 is greater than "
                                         "max_lora_rank 4"):
        e.add_request("big", "ROMEO:", GREEDY, lora_request=LoRARequest("big", 4, str(big)))
    assert e.get_unfinished_request_ids() == ["x", "y"] and e.list_loras() == {1}
    assert drain(e) == expected


def test_llm_generate_and_chat_take_one_or_one_per_prompt(adapters):
    llm = LLM(device="cpu", dtype="float32", num_kv_blocks=64, enable_lora=True, max_loras=2)
    prompts = ["ROMEO:", "JULIET:", "HAMLET:"]
    per_prompt = llm.generate(prompts, GREEDY, lora_request=[adapters["a"], None, adapters["b"]],
                              use_tqdm=False)
    for prompt, lora, out in zip(prompts, [adapters["a"], None, adapters["b"]], per_prompt):
        alone = llm.generate(prompt, GREEDY, lora_request=lora, use_tqdm=False)[0]
        assert alone.outputs[0].token_ids == out.outputs[0].token_ids
    assert per_prompt[0].outputs[0].token_ids != llm.generate(prompts[0], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="lora_request has 1 entries but there are 3 prompts"):
        llm.generate(prompts, GREEDY, lora_request=[adapters["a"]])
    chat = llm.chat([{"role": "user", "content": "Good morrow."}], GREEDY, lora_request=adapters["a"],
                    use_tqdm=False)
    assert len(chat[0].outputs[0].token_ids) == 8


def test_async_llm_generate_takes_a_lora_request(adapters):
    ref = LLM(device="cpu", dtype="float32", num_kv_blocks=64, enable_lora=True)
    expected = ref.generate("ROMEO:", GREEDY, lora_request=adapters["b"], use_tqdm=False)[0]

    async def main():
        llm = AsyncLLM(engine(enable_lora=True))
        try:
            outs = [o async for o in llm.generate("ROMEO:", GREEDY, "r0", lora_request=adapters["b"])]
        finally:
            await llm.shutdown()
        return outs[-1]

    assert asyncio.run(main()).outputs[0].token_ids == expected.outputs[0].token_ids
