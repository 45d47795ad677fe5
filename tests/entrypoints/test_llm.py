"""The offline LLM's sleep-mode and profiler methods (vLLM's names): they act on its engine.
Reference: the same LLM's greedy output before it slept; the trace file the profiler names."""

import pathlib

from workbench import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def test_llm_sleeps_wakes_and_generates_the_same_tokens():
    llm = LLM(block_size=8, num_kv_blocks=16, enable_sleep_mode=True)
    before = llm.generate(["ROMEO:"], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    llm.sleep(level=1)
    assert llm.is_sleeping() and llm.engine.is_sleeping()
    llm.wake_up()
    assert not llm.is_sleeping()
    assert llm.generate(["ROMEO:"], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == before


def test_llm_profiles_its_generate_calls(tmp_path):
    llm = LLM(block_size=8, num_kv_blocks=16)
    llm.start_profile(str(tmp_path))
    llm.generate(["ROMEO:"], GREEDY, use_tqdm=False)
    path = pathlib.Path(llm.stop_profile())
    assert path.exists() and path.parent == tmp_path


def test_chat_renders_tools_and_template_kwargs_as_vllms_llm_chat():
    llm = LLM(num_kv_blocks=16, block_size=8)
    tools = [{"type": "function", "function": {"name": "ring_bell", "parameters": {
        "type": "object", "properties": {"times": {"type": "integer"}}}}}]
    messages = [{"role": "user", "content": "Ring!"}]
    tok = llm.engine.tokenizer
    params = SamplingParams(temperature=0, max_tokens=1)
    out = llm.chat(messages, params, tools=tools, use_tqdm=False)[0]
    text = tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    assert "- ring_bell(times)" in text and out.prompt == text
    out = llm.chat(messages, params, use_tqdm=False, chat_template="{{ effort }}",
                   chat_template_kwargs={"effort": "high"})[0]
    assert out.prompt == "high"
