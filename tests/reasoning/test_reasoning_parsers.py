"""The ``<think>...</think>`` reasoning parsers on hand-made replies, streamed split at every
position (so each tag is cut at every place) and one character at a time; ``is_reasoning_end``
on the embedded tokenizer's ids; and in the engine, structured outputs that start only once
the reasoning has ended (the reasoning itself forced by a per-request logits processor)."""

from __future__ import annotations

import re

import pytest
from logits_processor_support import forcing

from workbench import LLM, SamplingParams
from workbench.reasoning import ReasoningParserManager
from workbench.reasoning.deepseek_r1_reasoning_parser import DeepSeekR1ReasoningParser
from workbench.reasoning.qwen3_reasoning_parser import Qwen3ReasoningParser
from workbench.sampling_params import StructuredOutputsParams

REPLIES = {
    "<think>Is it the lark?</think>It was the nightingale.": ("Is it the lark?",
                                                             "It was the nightingale."),
    "Is it the lark?</think>It was the nightingale.": ("Is it the lark?",
                                                      "It was the nightingale."),
    "<think>Still thinking </thi": ("Still thinking </thi", None),
    "No tags at all < / >": ("No tags at all < / >", None),
    "<think></think>": ("", None),
    "<thi": ("<thi", None),
}


def streamed(parser, text, cuts):
    reasoning, content, bounds = "", "", [0, *cuts, len(text)]
    for a, b in zip(bounds, bounds[1:]):
        delta = parser.extract_reasoning_streaming(text[:a], text[:b], text[a:b])
        if delta is not None:
            reasoning += delta.reasoning or ""
            content += delta.content or ""
    return reasoning, content


def test_registered_by_vllms_names():
    assert ReasoningParserManager.get_reasoning_parser("deepseek_r1") is DeepSeekR1ReasoningParser
    assert ReasoningParserManager.get_reasoning_parser("qwen3") is Qwen3ReasoningParser
    with pytest.raises(KeyError, match="invalid reasoning parser: x"):
        ReasoningParserManager.get_reasoning_parser("x")


@pytest.mark.parametrize("text", list(REPLIES))
def test_finished_reply(text):
    assert DeepSeekR1ReasoningParser(None).extract_reasoning(text) == REPLIES[text]


@pytest.mark.parametrize("text", list(REPLIES))
def test_streamed_split_anywhere_joins_into_the_finished_reply(text):
    reasoning, content = DeepSeekR1ReasoningParser(None).parse_prefix(text)
    for cut in range(len(text) + 1):
        got = streamed(Qwen3ReasoningParser(None), text, [cut])
        # what is held back is a tag's possible beginning at the very end, never more
        assert reasoning.startswith(got[0]) and content == got[1], cut
        assert len(reasoning) - len(got[0]) < len("</think>")
    one_by_one = streamed(DeepSeekR1ReasoningParser(None), text, list(range(1, len(text))))
    assert one_by_one == (reasoning, content)


def test_a_tag_is_held_back_until_certain():
    parser = DeepSeekR1ReasoningParser(None)
    assert parser.extract_reasoning_streaming("", "<th", "<th") is None
    delta = parser.extract_reasoning_streaming("<th", "<think>Ay</", "ink>Ay</")
    assert (delta.reasoning, delta.content) == ("Ay", None)
    delta = parser.extract_reasoning_streaming("<think>Ay</", "<think>Ay</think>No", "think>No")
    assert (delta.reasoning, delta.content) == (None, "No")


@pytest.fixture(scope="module")
def llm():
    return LLM(reasoning_parser="deepseek_r1", block_size=8, num_kv_blocks=64, device="cpu")


def test_is_reasoning_end_on_token_ids(llm):
    tok = llm.engine.tokenizer
    parser = DeepSeekR1ReasoningParser(tok)
    assert parser.is_reasoning_end(tok.encode("<think>hmm</think>Ay", add_special_tokens=False))
    assert not parser.is_reasoning_end(tok.encode("<think>hmm", add_special_tokens=False))
    assert not parser.is_reasoning_end(tok.encode("a</think>b<think>c", add_special_tokens=False))
    ids = tok.encode("hmm</think>", add_special_tokens=False)
    assert parser.is_reasoning_end_streaming(ids, ids[-1:])
    assert not parser.is_reasoning_end_streaming(ids[:-1], ids[-2:-1])


def test_structured_outputs_start_when_the_reasoning_ends(llm):
    tok = llm.engine.tokenizer
    think = "<think>Shall I speak?</think>"
    regex = "(ay|nay), (sweet|good) (lady|lord)"
    forced = forcing(tok.encode(think, add_special_tokens=False))
    params = SamplingParams(temperature=0, max_tokens=40, logits_processors=[forced],
                            structured_outputs=StructuredOutputsParams(regex=regex))
    free = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    out, neighbour = llm.generate(["ROMEO:", "JULIET:"], [params, free], use_tqdm=False)
    text = out.outputs[0].text
    steps = [r.structured_output for r in llm.engine.history][-len(out.outputs[0].token_ids):]
    thinking = len(tok.encode(think, add_special_tokens=False))
    rid = out.request_id
    # the StepRecords show it reasoning, unmasked, until the tag's last token, then masked
    assert [rid in s.reasoning for s in steps[:thinking - 1]] == [True] * (thinking - 1)
    assert not any(rid in s.rows for s in steps[:thinking])
    assert all(rid not in s.reasoning and rid in s.rows for s in steps[thinking:])
    assert text.startswith(think), text  # the grammar (which allows no '<') waited
    assert re.fullmatch(regex, text[len(think):]), text
    assert out.outputs[0].finish_reason == "stop"  # the grammar ended the request
    alone = llm.generate(["JULIET:"], free, use_tqdm=False)[0]
    assert neighbour.outputs[0].token_ids == alone.outputs[0].token_ids
    # without a reasoning parser the grammar reads the request's first token: it refuses
    # the forced '<', and the request fails there (as in vLLM, with that token returned)
    plain = LLM(block_size=8, num_kv_blocks=64, device="cpu")
    failed = plain.generate(["ROMEO:"], params, use_tqdm=False)[0]
    first = tok.encode(think, add_special_tokens=False)[0]
    assert failed.outputs[0].finish_reason == "error"
    assert failed.outputs[0].token_ids == [first] and failed.outputs[0].text == tok.decode([first])
    assert "the grammar does not accept token" in failed.error
