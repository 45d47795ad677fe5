"""InputProcessor: tokenization as the Hugging Face tokenizer does it, vLLM's checks against the
model (vocabulary, context, max_logprobs), truncation, bad words, and chat rendering with the
template's own errors."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from workbench import SamplingParams, default_model_path
from workbench.engine.input_processor import ChatTemplateError, InputProcessor

CTX, VOCAB = 64, 4096
USER = [{"role": "user", "content": "Good morrow."}]


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(str(default_model_path()))


@pytest.fixture(scope="module")
def ip(tok):
    return InputProcessor(tok, max_model_len=CTX, vocab_size=VOCAB, max_logprobs=5)


@pytest.mark.parametrize("text", ["ROMEO:", "héllo <|eos|> wörld", "  two  spaces\n"])
@pytest.mark.parametrize("special", [True, False])
def test_text_prompts_tokenize_as_the_tokenizer(ip, tok, text, special):
    got_text, ids, _ = ip.process(text, SamplingParams(), add_special_tokens=special)
    assert got_text == text and ids == tok(text, add_special_tokens=special).input_ids


def test_max_tokens_filled_and_not_capped_offline(ip, tok):
    n = len(tok("ROMEO:").input_ids)
    assert ip.process("ROMEO:", SamplingParams(max_tokens=None))[2].max_tokens == CTX - n
    # beyond the context is the engine's business offline (it stops with "length")
    assert ip.process("ROMEO:", SamplingParams(max_tokens=500))[2].max_tokens == 500
    with pytest.raises(ValueError, match=rf"'max_tokens' or 'max_completion_tokens' is too large: "
                                         rf"500. This model's maximum context length is {CTX} "
                                         rf"tokens and your request has {n} input tokens "
                                         rf"\(500 > {CTX} - {n}\)."):
        ip.check_context_length(n, 500)
    ip.check_context_length(n, CTX - n)  # exactly fits


@pytest.mark.parametrize("prompt, params, message", [
    ([], SamplingParams(), "The decoder prompt cannot be empty"),
    ([1] * CTX, SamplingParams(), f"The decoder prompt (length {CTX}) plus the number of "
                                  f"requested output tokens (at least 1)"),
    ([1, VOCAB], SamplingParams(), f"Token id {VOCAB} is out of vocabulary"),
    ([1, -1], SamplingParams(), f"prompt_token_ids must be integers in [0, {VOCAB})"),
    ([1, True], SamplingParams(), "prompt_token_ids must be integers, got True"),
    ({"text": "x"}, SamplingParams(), "must have 'prompt' (text) or 'prompt_token_ids'"),
    ("ROMEO:", SamplingParams(logprobs=6), "logprobs: Requested sample logprobs of 6, which "
                                           "is greater than max allowed: 5"),
    ("ROMEO:", SamplingParams(prompt_logprobs=6), "Requested prompt logprobs of 6"),
    ("ROMEO:", SamplingParams(logit_bias={VOCAB: 1.0}), f"logit_bias must be integers in "
                                                        f"[0, {VOCAB})"),
    ("ROMEO:", SamplingParams(allowed_token_ids=[VOCAB + 3]), "allowed_token_ids must be"),
    ("ROMEO:", SamplingParams(truncate_prompt_tokens=CTX + 1), "greater than max_model_len"),
])
def test_rejections_name_the_field_and_limit(ip, prompt, params, message):
    with pytest.raises(ValueError) as err:
        ip.process(prompt, params)
    assert message in str(err.value)


def test_truncate_prompt_tokens_keeps_the_last_tokens(ip, tok):
    ids = list(range(10, 200))
    assert ip.process(ids, SamplingParams(truncate_prompt_tokens=7))[1] == ids[-7:]
    # -1 keeps max_model_len - max_tokens (vLLM V1's TokenizeParams; SamplingParams: 16)
    assert ip.process(ids, SamplingParams(truncate_prompt_tokens=-1))[1] == ids[-(CTX - 16):]
    assert ip.process(ids, SamplingParams(truncate_prompt_tokens=-1, max_tokens=3))[1] == \
        ids[-(CTX - 3):]
    with pytest.raises(ValueError, match="cannot be greater than max_model_len - max_tokens"):
        ip.process(ids, SamplingParams(truncate_prompt_tokens=CTX - 2, max_tokens=3))
    # 0 left to generate: refused by the length check, in the engine's words or the server's
    with pytest.raises(ValueError, match="plus the number of requested output tokens"):
        ip.process(ids, SamplingParams(truncate_prompt_tokens=-1, max_tokens=None))
    with pytest.raises(ValueError, match="maximum context length"):
        ip.process(ids, SamplingParams(truncate_prompt_tokens=-1, max_tokens=None), serving=True)
    text = "ROMEO:\nBut soft, what light through yonder window breaks?"
    got_text, got, _ = ip.process(text, SamplingParams(truncate_prompt_tokens=4))
    assert got == tok(text).input_ids[-4:] and got_text == tok.decode(got)


def test_bad_words_are_tokenized_with_and_without_a_space(ip, tok):
    params = ip.process("ROMEO:", SamplingParams(bad_words=["night", " morrow"]))[2]
    expected = []
    for word in ("night", "morrow"):
        for spelling in (word, " " + word):
            ids = tok(spelling, add_special_tokens=False).input_ids
            if ids not in expected:
                expected.append(ids)
    assert params.bad_words_token_ids == expected


def test_render_chat_matches_the_tokenizer_and_reports_template_errors(ip, tok):
    assert ip.render_chat(USER) == tok.apply_chat_template(USER, tokenize=False,
                                                           add_generation_prompt=True)
    convo = USER + [{"role": "assistant", "content": "Good morrow"}]
    assert ip.render_chat(convo, add_generation_prompt=False, continue_final_message=True) == \
        tok.apply_chat_template(convo, tokenize=False, continue_final_message=True)
    custom = "{{ greeting }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    assert ip.render_chat(USER, chat_template=custom,
                          chat_template_kwargs={"greeting": "HAMLET:"}) == "HAMLET:Good morrow."
    with pytest.raises(ChatTemplateError, match="role must be system, user, assistant or tool, got "
                                                "villain"):
        ip.render_chat([{"role": "villain", "content": "Ha"}])
    with pytest.raises(ChatTemplateError):
        ip.render_chat(USER, chat_template="{% for m in messages %}")
    with pytest.raises(ValueError, match="Cannot set both"):
        ip.render_chat(convo, continue_final_message=True)
    with pytest.raises(ValueError, match="last message to have role 'assistant'"):
        ip.render_chat(USER, add_generation_prompt=False, continue_final_message=True)
    with pytest.raises(ValueError, match=r"messages\[0\] must be a dict with a 'role'"):
        ip.render_chat([{"content": "hi"}])
    with pytest.raises(ValueError, match="Found unexpected chat template kwargs from request"):
        ip.render_chat(USER, chat_template_kwargs={"tokenize": True})  # vLLM V1's rule
    with pytest.raises(ValueError, match="chat_template_kwargs may not set"):
        ip.render_chat(USER, chat_template_kwargs={"messages": []})
    # the explicit argument wins over the same key in chat_template_kwargs (vLLM V1)
    assert ip.render_chat(USER, add_generation_prompt=True,
                          chat_template_kwargs={"add_generation_prompt": False}) == \
        ip.render_chat(USER, add_generation_prompt=True)
    assert ip.render_chat(USER, add_generation_prompt=True) != \
        ip.render_chat(USER, add_generation_prompt=False)


def test_reprs_are_plain_and_deterministic(ip):
    assert repr(ip) == f"InputProcessor(max_model_len={CTX}, vocab_size={VOCAB}, max_logprobs=5)"
    assert "chat template" in ip._repr_html_() and "0x" not in ip._repr_html_()
    params = SamplingParams(temperature=0, logit_bias={3: 1.0})
    assert "temperature" in params._repr_html_() and "logit_bias" in params._repr_html_()
    assert "(all defaults)" in SamplingParams()._repr_html_()
