"""vLLM v1's batch-level logits processors (``EngineArgs.logits_processors``, the server's
``--logits-processors``): loaded by qualified name, told how the batch changed before each
step, applied to the batch's logits; a request's settings come in ``extra_args`` and are
checked by ``validate_params`` when it is added."""

from __future__ import annotations

import pytest

from workbench import LLM, SamplingParams
from workbench.worker.logits_processor import load_logits_processors

from logits_processor_support import ForceTokens, RecordUpdates, force_args

FORCE = "logits_processor_support:ForceTokens"


@pytest.fixture(scope="module")
def llm():
    return LLM(logits_processors=[FORCE, "logits_processor_support.RecordUpdates"],
               block_size=8, num_kv_blocks=64, device="cpu")


def test_loaded_by_either_spelling():
    assert load_logits_processors([FORCE, "logits_processor_support.ForceTokens",
                                   ForceTokens]) == [ForceTokens] * 3
    for bad, words in [("logits_processor_support:Missing", "cannot load"),
                       ("no_such_module_here.Proc", "cannot load"),
                       ("logits_processor_support:NotAProcessor", "is not a subclass"),
                       ("logits_processor_support:unused", "is not a subclass")]:
        with pytest.raises(ValueError, match=words):
            load_logits_processors([bad])


def test_a_request_forced_beside_free_neighbours(llm):
    tok = llm.engine.tokenizer
    text = " O happy dagger!"
    forced = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                            extra_args=force_args(tok, text))
    free = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = llm.generate(["ROMEO:", "JULIET:", "NURSE:"], [free, forced, free], use_tqdm=False)
    assert outs[1].outputs[0].text.startswith(text)
    alone = LLM(block_size=8, num_kv_blocks=64, device="cpu").generate(
        ["ROMEO:", "NURSE:"], free, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in (outs[0], outs[2])] == [
        o.outputs[0].token_ids for o in alone]  # the neighbours' rows are untouched


def test_batch_updates_describe_the_rows(llm):
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (2, 4)]
    llm.generate(["ROMEO:", "JULIET:"], params, use_tqdm=False)
    updates = RecordUpdates.updates[-4:]  # this call's four sampling steps
    first, same, shrunk, last = updates
    assert first.batch_size == 2 and [a[0] for a in first.added] == [0, 1]
    assert [a[1].max_tokens for a in first.added] == [2, 4]
    assert same is None  # the same requests in the same rows
    assert shrunk.batch_size == 1 and shrunk.removed == [0, 1] and shrunk.added[0][0] == 0
    assert shrunk.added[0][1].max_tokens == 4 and last is None
    assert len(first.added[1][3]) == 4  # the live output list: by now all four tokens


def test_validate_params_refuses_a_request(llm):
    with pytest.raises(ValueError, match="extra_args.force must be a list of token ids"):
        llm.generate(["ROMEO:"], SamplingParams(extra_args={"force": "x"}), use_tqdm=False)
    with pytest.raises(ValueError, match="extra_args must be a dict"):
        SamplingParams(extra_args=["force"])
