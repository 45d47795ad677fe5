"""Draft tokens against a grammar (for speculative decoding): ``validate_tokens`` counts the
leading drafts the grammar accepts and leaves it as it was; ``rollback(n)`` undoes the last n
accepted tokens. Both backends, directly and through the manager; the drafts are single
characters written by hand, so how many are valid is known without the grammar code."""

from __future__ import annotations

from concurrent.futures import Future

import pytest
import torch

from transformers import AutoTokenizer

from workbench.model.loader import default_model_path
from workbench.request import Request
from workbench.sampling_params import SamplingParams
from workbench.sampling_params import StructuredOutputsParams as S
from workbench.structured_output.backend_guidance import GuidanceBackend
from workbench.structured_output.backend_xgrammar import XgrammarBackend
from workbench.structured_output.backends import grammar_key
from workbench.structured_output.manager import StructuredOutputManager

REGEX = "[0-9]{3}-[a-z]{2}"


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(default_model_path())


def chars(tokenizer, text):
    """One token per character (each character of these strings is a token of its own)."""
    ids = [tokenizer.convert_tokens_to_ids(c) for c in text]
    assert all(isinstance(i, int) and i != tokenizer.unk_token_id for i in ids), text
    assert tokenizer.decode(ids) == text
    return ids


def mask(grammar, vocab):
    bitmask = torch.full((1, -(-vocab // 32)), -1, dtype=torch.int32)
    grammar.fill_bitmask(bitmask, 0)
    return bitmask.clone()


@pytest.fixture(scope="module", params=["xgrammar", "guidance"])
def make(request, tokenizer):
    vocab = len(tokenizer)
    backend = (XgrammarBackend if request.param == "xgrammar" else GuidanceBackend)(
        tokenizer, vocab)
    key = grammar_key(S(regex=REGEX))._replace(backend=request.param)
    compiled = backend.compile(key)
    return lambda: backend.make_grammar(compiled)


@pytest.mark.parametrize("draft, n_valid", [
    ("123-ab", 6), ("12x-ab", 2), ("1234", 3), ("123-a1", 5), ("a", 0), ("", 0)])
def test_validate_counts_the_valid_prefix_and_changes_nothing(tokenizer, make, draft, n_valid):
    grammar, vocab = make(), len(tokenizer)
    for token in chars(tokenizer, "1"):  # one accepted token first: validation starts there
        assert grammar.accept_token(token)
    before = mask(grammar, vocab)
    tokens = chars(tokenizer, draft[1:] if draft.startswith("1") else draft) if draft else []
    expected = n_valid - 1 if draft.startswith("1") else n_valid
    assert grammar.validate_tokens(tokens) == expected
    assert torch.equal(mask(grammar, vocab), before)
    assert not grammar.is_terminated()


def test_validate_stops_at_the_end_token_and_rollback_restores_the_state(tokenizer, make):
    grammar, vocab, eos = make(), len(tokenizer), tokenizer.eos_token_id
    start = mask(grammar, vocab)
    assert grammar.validate_tokens(chars(tokenizer, "123-ab") + [eos, eos]) == 7
    for token in chars(tokenizer, "123"):
        assert grammar.accept_token(token)
    after_three = mask(grammar, vocab)
    for token in chars(tokenizer, "-ab") + [eos]:
        assert grammar.accept_token(token)
    assert grammar.is_terminated()
    grammar.rollback(4)  # the target model rejected the last four drafts
    assert not grammar.is_terminated()
    assert torch.equal(mask(grammar, vocab), after_three)
    grammar.rollback(3)
    assert torch.equal(mask(grammar, vocab), start)
    assert grammar.validate_tokens(chars(tokenizer, "9x")) == 1


class Now:
    def submit(self, fn, *args):
        future = Future()
        future.set_result(fn(*args))
        return future


def test_the_manager_validates_drafts_and_rolls_back_with_the_request(tokenizer):
    manager = StructuredOutputManager(tokenizer, len(tokenizer), Now())
    request = Request("r", chars(tokenizer, "ab"), SamplingParams(
        structured_outputs=S(regex=REGEX)), eos_token_id=tokenizer.eos_token_id)
    free = Request("free", chars(tokenizer, "ab"), SamplingParams(),
                   eos_token_id=tokenizer.eos_token_id)
    manager.add_request(request)
    manager.add_request(free)
    assert manager.validate_tokens("r", chars(tokenizer, "12x")) == 2
    assert manager.validate_tokens("free", chars(tokenizer, "12x")) == 3  # no grammar
    request.output_token_ids += chars(tokenizer, "12")  # two drafts accepted in one step
    assert manager.accept_tokens([request]) == ([], {})
    assert manager.validate_tokens("r", chars(tokenizer, "3-ab")) == 4
    assert manager.validate_tokens("r", chars(tokenizer, "-")) == 0  # needs a third digit
    manager.rollback("r", 1)  # "2" rejected after all: the grammar is back after "1"
    assert manager.validate_tokens("r", chars(tokenizer, "23-")) == 3
    with pytest.raises(ValueError, match="accepted 1 tokens, cannot undo 2"):
        manager.rollback("r", 2)
