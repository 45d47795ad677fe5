"""vLLM's reasoning-parser rules, restated for the embedded tokenizer (every tag arrives in
several tokens): DeepSeek-R1's empty reasoning and first ``<think>``; ``extract_content_ids``
and the content ids chat serving hands to the tool parser; Qwen3's ``<tool_call>`` that ends
the reasoning, its held-back partial tags, and ``enable_thinking: false``. Each reply is read
finished and streamed through a ReplyReader, one token per delta and in deltas of several
tokens cut anywhere (hypothesis): every split gives the same parts."""

from __future__ import annotations

import pytest
import transformers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from workbench import default_model_path
from workbench.entrypoints.openai.reply_parsing import ReplyReader
from workbench.entrypoints.openai.tool_parsers.hermes_tool_parser import Hermes2ProToolParser
from workbench.reasoning.deepseek_r1_reasoning_parser import DeepSeekR1ReasoningParser
from workbench.reasoning.qwen3_reasoning_parser import Qwen3ReasoningParser

from reply_support import cuts, finished, stream

SPLITS = settings(max_examples=25, derandomize=True, deadline=None,
                  suppress_health_check=[HealthCheck.function_scoped_fixture])
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def tok():
    return transformers.AutoTokenizer.from_pretrained(default_model_path())


def reader(parser, tools=None, **kw):
    return ReplyReader(parser, tools, tool_choice="auto" if tools else None, **kw)


# -- rule 2: DeepSeek-R1's empty reasoning is "" ---------------------------------------------

@pytest.mark.parametrize("text, want", [
    ("</think>It was the nightingale.", ("", "It was the nightingale.")),
    ("", ("", None)),
    ("<think></think>", ("", None)),
    ("<think>Is it the lark?</think>", ("Is it the lark?", None)),
])
def test_deepseek_r1_empty_reasoning_is_an_empty_string(tok, text, want):
    assert DeepSeekR1ReasoningParser(tok).extract_reasoning(text) == want
    fields, _ = finished(reader(DeepSeekR1ReasoningParser(tok)), text)
    assert (fields["reasoning"], fields["content"]) == want
    if text:  # streamed: the same text, one token per delta (nothing to send for "")
        s = stream(reader(DeepSeekR1ReasoningParser(tok)), tok, text)
        assert (s.reasoning, s.content or None) == want


@SPLITS
@given(data=st.data())
def test_deepseek_r1_empty_reasoning_split_anywhere(tok, data):
    text = "</think>It was the nightingale."
    s = stream(reader(DeepSeekR1ReasoningParser(tok)), tok, text, data.draw(cuts(tok, text)))
    assert (s.reasoning, s.content) == ("", "It was the nightingale.")


# -- rule 3: DeepSeek-R1 drops the first <think> wherever it stands ---------------------------

LEADING = "\n<think>Is it the lark?</think>It was the nightingale."


@pytest.mark.parametrize("text", [LEADING, " \n\n" + LEADING.lstrip(), LEADING.lstrip()])
def test_deepseek_r1_first_think_tag_after_a_blank(tok, text):
    want = ("Is it the lark?", "It was the nightingale.")
    assert DeepSeekR1ReasoningParser(tok).extract_reasoning(text) == want
    s = stream(reader(DeepSeekR1ReasoningParser(tok)), tok, text)
    assert (s.reasoning, s.content) == want
    # a stream cut where the blank ends, inside the tag, or not at all
    for at in range(1, len(tok.encode(text, add_special_tokens=False))):
        s = stream(reader(DeepSeekR1ReasoningParser(tok)), tok, text, [at])
        assert (s.reasoning, s.content) == want, at


@SPLITS
@given(data=st.data())
def test_deepseek_r1_first_think_tag_split_anywhere(tok, data):
    s = stream(reader(DeepSeekR1ReasoningParser(tok)), tok, LEADING, data.draw(cuts(tok, LEADING)))
    assert (s.reasoning, s.content) == ("Is it the lark?", "It was the nightingale.")


def test_deepseek_r1_a_think_tag_after_streamed_reasoning(tok):
    """vLLM's finished reply drops what precedes the tag; a stream has sent it already, and
    only the tag vanishes from it (as from vLLM's stream)."""
    text = "Hark.<think>Is it the lark?</think>Nay."
    assert DeepSeekR1ReasoningParser(tok).extract_reasoning(text) == ("Is it the lark?", "Nay.")
    s = stream(reader(DeepSeekR1ReasoningParser(tok)), tok, text)
    assert (s.reasoning, s.content) == ("Hark.Is it the lark?", "Nay.")
    # a <think> the content holds stays content
    s = stream(reader(DeepSeekR1ReasoningParser(tok)), tok, "Hm.</think>Say <think>.")
    assert (s.reasoning, s.content) == ("Hm.", "Say <think>.")


# -- rule 4: extract_content_ids, and the content ids handed to the tool parser --------------

def test_extract_content_ids(tok):
    parser = DeepSeekR1ReasoningParser(tok)

    def ids(text):
        return tok.encode(text, add_special_tokens=False)
    head, tail = ids("<think>Is it the lark?</think>"), ids("It was the nightingale.")
    assert parser.extract_content_ids(head + tail) == tail
    assert parser.extract_content_ids(head) == []  # vLLM: nothing after the end tag
    assert parser.extract_content_ids(ids("<think>Is it the lark?")) == []
    qwen = Qwen3ReasoningParser(tok)
    plan, call = ids("Let me look."), ids("<tool_call>\n<function=get_weather>")
    assert qwen.extract_content_ids(plan + call) == call  # from the <tool_call> on (vLLM)
    assert qwen.extract_content_ids(head + tail) == tail
    assert Qwen3ReasoningParser(tok, **NO_THINKING).extract_content_ids(plan) == plan


class RecordingHermes(Hermes2ProToolParser):
    """Hermes, keeping the token ids chat serving hands it with each delta."""

    def extract_tool_calls_streaming(self, previous_text, current_text, delta_text,
                                     previous_token_ids=(), current_token_ids=(),
                                     delta_token_ids=(), request=None):
        self.seen = (current_text, list(current_token_ids), list(delta_token_ids))
        assert list(previous_token_ids) + list(delta_token_ids) == list(current_token_ids)
        return super().extract_tool_calls_streaming(previous_text, current_text, delta_text)


THINK_THEN_CALL = ('<think>The sky, then.</think><tool_call>{"name": "get_weather", '
                   '"arguments": {"city": "Verona"}}</tool_call>')


@SPLITS
@given(data=st.data())
def test_the_tool_parser_gets_the_contents_token_ids(tok, data):
    tools = RecordingHermes(tok)
    s = stream(reader(DeepSeekR1ReasoningParser(tok), tools), tok, THINK_THEN_CALL,
               data.draw(cuts(tok, THINK_THEN_CALL)))
    assert s.reasoning == "The sky, then." and s.content == ""
    assert s.tool_calls() == [("get_weather", '{"city": "Verona"}')]
    text, ids, _ = tools.seen
    assert text == THINK_THEN_CALL[len("<think>The sky, then.</think>"):]
    assert ids == tok.encode(text, add_special_tokens=False)  # the content's ids, no more


# -- rule 5: Qwen3's <tool_call> ends the reasoning; partial tags wait ------------------------

XML_CALL = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nVerona\n</parameter>\n"
            "</function>\n</tool_call>")
PLAN = "Let me look at the sky."


@pytest.mark.parametrize("text, want", [
    (PLAN + XML_CALL, (PLAN, XML_CALL)),
    ("<think>" + PLAN + "\n\n" + XML_CALL, (PLAN + "\n\n", XML_CALL)),
    (PLAN + "</think>Verona.", (PLAN, "Verona.")),
    ("Is <tool_call> a tag? Aye.", ("Is <tool_call> a tag? Aye.", None)),  # no function
    (PLAN + "<tool_call>\n<functio", (PLAN + "<tool_call>\n<functio", None)),  # cut short
    (PLAN + "<to", (PLAN + "<to", None)),
])
def test_qwen3_tool_call_ends_the_reasoning(tok, text, want):
    assert Qwen3ReasoningParser(tok).extract_reasoning(text) == want
    fields, _ = finished(reader(Qwen3ReasoningParser(tok)), text)
    assert (fields["reasoning"], fields["content"]) == want
    s = stream(reader(Qwen3ReasoningParser(tok)), tok, text)
    assert (s.reasoning, s.content or None) == want


@SPLITS
@given(data=st.data())
def test_qwen3_tool_call_split_anywhere(tok, data):
    text = PLAN + XML_CALL
    s = stream(reader(Qwen3ReasoningParser(tok)), tok, text, data.draw(cuts(tok, text)))
    assert (s.reasoning, s.content) == (PLAN, XML_CALL)


def test_qwen3_holds_a_partial_tag_back_until_it_is_known(tok):
    parser = Qwen3ReasoningParser(tok)
    steps = [("Let me<to", "Let me", None), ("Let me<tool_call>", None, None),
             ("Let me<tool_call>\n<func", None, None),
             ("Let me<tool_call>\n<function=f>", None, "<tool_call>\n<function=f>")]
    previous = ""
    for text, reasoning, content in steps:
        delta = parser.extract_reasoning_streaming(previous, text, text[len(previous):])
        assert (delta and delta.reasoning, delta and delta.content) == (reasoning, content), text
        previous = text
    # text after the tag that cannot be a function tag releases it as reasoning
    parser = Qwen3ReasoningParser(tok)
    assert parser.extract_reasoning_streaming("", "A<tool_call> ", "A<tool_call> ").reasoning == "A"
    delta = parser.extract_reasoning_streaming("A<tool_call> ", "A<tool_call> is", "is")
    assert (delta.reasoning, delta.content) == ("<tool_call> is", None)


def test_qwen3_is_reasoning_end_on_a_tool_call(tok):
    parser = Qwen3ReasoningParser(tok)

    def ended(text):
        return parser.is_reasoning_end(tok.encode(text, add_special_tokens=False))
    assert ended(PLAN + "<tool_call>\n<function=f>")
    assert not ended(PLAN + "<tool_call> is a tag")
    assert not ended(PLAN + XML_CALL)  # paired: a prompt's example (vLLM's rule)
    assert not ended(PLAN + "<tool_call>\n<function=f>\n<think>")
    ids = tok.encode(PLAN + "<tool_call>\n<function=f>", add_special_tokens=False)
    n = len(tok.encode(PLAN + "<tool_call>\n<function", add_special_tokens=False))
    assert parser.is_reasoning_end_streaming(ids[:n + 1], ids[n:n + 1])
    assert not parser.is_reasoning_end_streaming(ids[:n], ids[n - 1:n])


# -- rule 6: Qwen3 with enable_thinking false ------------------------------------------------

@pytest.mark.parametrize("text", ["It was the nightingale.", PLAN + XML_CALL])
def test_qwen3_enable_thinking_false_is_all_content(tok, text):
    parser = Qwen3ReasoningParser(tok, **NO_THINKING)
    assert not parser.thinking_enabled and Qwen3ReasoningParser(tok).thinking_enabled
    assert parser.extract_reasoning(text) == (None, text)
    fields, _ = finished(reader(Qwen3ReasoningParser(tok, **NO_THINKING)), text)
    assert "reasoning" not in fields and fields["content"] == text
    s = stream(reader(Qwen3ReasoningParser(tok, **NO_THINKING)), tok, text)
    assert (s.reasoning, s.content) == ("", text)
    # thinking on (the default, or said so): the reply is reasoning
    on = Qwen3ReasoningParser(tok, chat_template_kwargs={"enable_thinking": True})
    assert on.extract_reasoning("It was the nightingale.") == ("It was the nightingale.", None)


@SPLITS
@given(data=st.data())
def test_qwen3_enable_thinking_false_split_anywhere(tok, data):
    text = "Nay, it was the nightingale, and not the lark."
    s = stream(reader(Qwen3ReasoningParser(tok, **NO_THINKING)), tok, text,
               data.draw(cuts(tok, text)))
    assert (s.reasoning, s.content) == ("", text)


def test_the_engines_parser_takes_no_template_kwargs(tok):
    """The engine builds its parser (for structured outputs) with the tokenizer alone."""
    assert DeepSeekR1ReasoningParser(tok).chat_template_kwargs == {}
    assert Qwen3ReasoningParser(tok).thinking_enabled
