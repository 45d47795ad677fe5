"""SamplingParams.detokenize (vLLM's): False gives token ids only, the same ids, empty text."""

import pytest

from workbench import LLM, SamplingParams


def test_detokenize_false_gives_the_same_tokens_and_no_text():
    llm = LLM()
    with_text, without = (
        llm.generate(["ROMEO:"], SamplingParams(temperature=0, max_tokens=8, detokenize=d), use_tqdm=False)[0]
        for d in (True, False)
    )
    assert without.outputs[0].token_ids == with_text.outputs[0].token_ids
    assert with_text.outputs[0].text and without.outputs[0].text == ""
    assert without.outputs[0].finish_reason == "length"


def test_stop_strings_need_detokenize():
    with pytest.raises(ValueError, match="stop strings are only supported when detokenize is True"):
        SamplingParams(stop=["\n"], detokenize=False)
    with pytest.raises(ValueError, match="detokenize must be a bool"):
        SamplingParams(detokenize="no")
