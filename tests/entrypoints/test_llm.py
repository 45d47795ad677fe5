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
