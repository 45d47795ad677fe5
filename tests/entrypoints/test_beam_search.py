"""Beam search (``LLM.beam_search``) against transformers, rules checked by hand, and the
prefix cache's sharing of the beams' blocks on a recorded history."""

import math

import pytest
import torch
import transformers

from workbench import LLM, BlockMap, default_model_path
from workbench.entrypoints.beam_search import (
    BeamSearchInstance,
    beam_search,
    get_beam_search_score,
)
from workbench.core.kv_events import BlockFreed
from workbench.outputs import CompletionOutput, Logprob, RequestOutput
from workbench.sampling_params import BeamSearchParams

PROMPTS = [
    "ROMEO:",
    "JULIET:\nO Romeo, Romeo! wherefore art thou Romeo?",
    "HAMLET:\nTo be, or not to be",
]
BLOCK_SIZE = 4


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="float32", block_size=BLOCK_SIZE, num_kv_blocks=256)


@pytest.fixture(scope="module")
def hf():
    path = default_model_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # EOS is an ordinary token: ignore_eos
    return model, transformers.AutoTokenizer.from_pretrained(path)


@pytest.mark.parametrize("beam_width,length_penalty", [(4, 1.0), (2, 0.5)])
def test_beams_and_scores_equal_transformers(llm, hf, beam_width, length_penalty):
    """With ``ignore_eos`` and ``max_tokens=T`` the two searches are the same algorithm when
    transformers runs ``generate(num_beams=W, num_return_sequences=W, do_sample=False,
    max_new_tokens=T, length_penalty=lp, early_stopping=True)`` with its
    ``generation_config.eos_token_id = None``: no beam ever finishes early on either side
    (so ``early_stopping`` and the length penalty cannot change which beams win: all have
    length T), transformers keeps the best W of the top 2W continuations of all beams and
    vLLM the best W of each beam's top 2W logprobs (the same set), both from the raw fp32
    log-softmax. transformers' ``sequences_scores`` are ``cum_logprob / T ** lp``; vLLM's
    ranking score divides by the whole length (prompt included), which ranks equal-length
    beams the same. EOS does occur mid-beam here (the third prompt), as an ordinary token.
    """
    model, tokenizer = hf
    T = 8
    outs = llm.beam_search(PROMPTS, BeamSearchParams(beam_width=beam_width, max_tokens=T,
                                                     ignore_eos=True, length_penalty=length_penalty))
    for prompt, out in zip(PROMPTS, outs):
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        ref = model.generate(ids, num_beams=beam_width, num_return_sequences=beam_width,
                             do_sample=False, early_stopping=True, length_penalty=length_penalty,
                             max_new_tokens=T, output_scores=True, return_dict_in_generate=True,
                             pad_token_id=tokenizer.pad_token_id)
        P = ids.shape[1]
        assert len(out.sequences) == beam_width
        for seq, ref_ids, ref_score in zip(out.sequences, ref.sequences, ref.sequences_scores):
            assert seq.tokens == ref_ids.tolist()
            assert seq.cum_logprob == pytest.approx(float(ref_score) * T ** length_penalty, abs=1e-4)
            assert seq.finish_reason == "length"
            assert seq.text == tokenizer.decode(seq.tokens)  # vLLM's LLM: the prompt included
    ended_with_eos = [t for o in outs for s in o.sequences for t in s.tokens[len(s.tokens) - T:]]
    assert tokenizer.eos_token_id in ended_with_eos  # EOS was generated and ignored


def output(logprobs: dict[int, float], rid="r") -> RequestOutput:
    lps = {t: Logprob(lp, rank=i + 1) for i, (t, lp) in enumerate(logprobs.items())}
    return RequestOutput(rid, None, [], [CompletionOutput(0, "", [next(iter(lps))], None, [lps])], True)


def test_one_step_by_hand():
    """Candidates are ranked by cumulative logprob across beams; EOS candidates are set
    aside as finished (any rank), the others fill the beam_width live beams."""
    EOS = 1
    inst = BeamSearchInstance([7, 8], BeamSearchParams(beam_width=2, max_tokens=3), EOS)
    assert inst.step_params().logprobs == 4 and inst.step_params().max_tokens == 1
    inst.advance([output({5: -0.1, EOS: -0.5, 6: -1.0, 9: -3.0})])
    assert [(b.tokens, b.cum_logprob) for b in inst.beams] == [([7, 8, 5], -0.1), ([7, 8, 6], -1.0)]
    assert [(b.tokens, b.finish_reason) for b in inst.completed] == [([7, 8, EOS], "stop")]
    inst.advance([output({4: -2.0, EOS: -0.2}), output({3: -0.3, 2: -0.4})])
    # -1.3 and -1.4 beat -2.1: both live beams now descend from the second one
    assert [(b.tokens, round(b.cum_logprob, 6)) for b in inst.beams] == [
        ([7, 8, 6, 3], -1.3), ([7, 8, 6, 2], -1.4)]
    assert [b.tokens for b in inst.completed] == [[7, 8, EOS], [7, 8, 5, EOS]]
    inst.advance([output({0: -1.0}), output({0: -0.1})])
    assert inst.done
    # scores: cum / len ** lp, a final EOS not counted: -0.5/2, -0.3/3, -2.3/5, -1.5/5
    best = inst.best()
    assert [b.tokens for b in best] == [[7, 8, 5, EOS], [7, 8, EOS]]
    assert get_beam_search_score([7, 8, 5, EOS], -0.3, EOS) == pytest.approx(-0.1)
    assert get_beam_search_score([7, 8, 6, 2, 0], -1.5, EOS, 2.0) == pytest.approx(-1.5 / 25)
    assert get_beam_search_score([7, 8, 6, 2, 0], -1.5, EOS, 0.0) == -1.5


def test_length_penalty_changes_the_winner():
    """A short finished beam beats a longer live one at length_penalty 0 (raw logprob) and
    loses at a large length_penalty (longer is favoured)."""
    EOS = 1
    for lp, winner in [(0.0, [7, EOS]), (3.0, [7, 5, 6])]:
        inst = BeamSearchInstance([7], BeamSearchParams(beam_width=1, max_tokens=2, length_penalty=lp), EOS)
        inst.advance([output({5: -0.4, EOS: -0.5})])
        inst.advance([output({6: -0.3})])
        assert inst.best()[0].tokens == winner


def test_params_are_validated():
    for kwargs, name in [({"beam_width": 0, "max_tokens": 4}, "beam_width"),
                         ({"beam_width": 2, "max_tokens": 0}, "max_tokens"),
                         ({"beam_width": 2, "max_tokens": 4, "temperature": -1.0}, "temperature"),
                         ({"beam_width": 2, "max_tokens": 4, "length_penalty": math.inf}, "length_penalty")]:
        with pytest.raises(ValueError, match=name):
            BeamSearchParams(**kwargs)


def test_a_bad_prompt_is_refused_before_anything_runs(llm):
    steps = len(llm.engine.history)
    with pytest.raises(ValueError, match=r"prompts\[1\]"):
        llm.beam_search(["ROMEO:", {"prompt_token_ids": []}], BeamSearchParams(beam_width=2, max_tokens=2))
    with pytest.raises(ValueError, match="max_tokens"):
        llm.beam_search(["ROMEO:"], BeamSearchParams(beam_width=2, max_tokens=10**6))
    with pytest.raises(ValueError, match=r"beam_width: .* 22 logprobs per step, more than max_logprobs=20"):
        llm.beam_search(["ROMEO:"], BeamSearchParams(beam_width=11, max_tokens=2))
    assert len(llm.engine.history) == steps


def test_beams_that_could_outgrow_the_kv_cache_are_refused_before_anything_runs():
    """Within the context but not the cache: a search's step requests grow to the prompt plus
    max_tokens - 1 tokens, all of whose K/V must fit 16 blocks of 4 (64 tokens)."""
    small = LLM(dtype="float32", block_size=BLOCK_SIZE, num_kv_blocks=16)
    n = len(small.get_tokenizer()("ROMEO:").input_ids)
    most = 64 - n + 1  # n + most - 1 == 64 tokens of K/V
    with pytest.raises(ValueError, match=rf"prompts\[0\]: .*max_tokens={most + 1}.* num_blocks=16"):
        small.beam_search(["ROMEO:"], BeamSearchParams(beam_width=2, max_tokens=most + 1))
    assert len(small.engine.history) == 0
    [out] = small.beam_search(["ROMEO:"], BeamSearchParams(beam_width=2, max_tokens=most, ignore_eos=True))
    assert len(out.sequences[0].tokens) == n + most


def test_beams_share_blocks_through_the_prefix_cache():
    """On the recorded history: after the first step every beam's request hits the prefix
    cache for all full blocks but the one holding its last token (its parent computed them
    one step before); during each step's forward a block is held by exactly the requests
    whose tokens agree up to that block's end; those ref counts rise as beams fork from a
    common parent and fall as the beams that shared a prefix are pruned. After the step
    every block is free again (cached)."""
    llm = LLM(dtype="float32", block_size=BLOCK_SIZE, num_kv_blocks=128)
    batches = []

    def generate(prompts, sp):
        batches.append([p["prompt_token_ids"] for p in prompts])
        return llm.generate(prompts, sp, use_tqdm=False)

    ids = llm.get_tokenizer()(PROMPTS[1]).input_ids
    beam_search(generate, [ids], BeamSearchParams(beam_width=3, max_tokens=10, ignore_eos=True),
                None, llm.get_tokenizer().decode)
    history = llm.engine.history
    assert len(history) == len(batches) == 10
    peaks = []
    for record, batch in zip(history, batches):
        scheduled = record.scheduler_output.scheduled
        assert len(scheduled) == len(batch)
        during = history.kv_state(record.step, during_forward=True)
        counts = {}
        for s, tokens in zip(scheduled, batch):
            full = (len(tokens) - 1) // BLOCK_SIZE  # the last token is always computed
            expected_hit = full * BLOCK_SIZE if record.step > 0 else 0
            assert s.num_cached_tokens == expected_hit
            for j in range(full):
                prefix = tokens[: (j + 1) * BLOCK_SIZE]
                sharing = sum(1 for other in batch if other[: len(prefix)] == prefix)
                block = during.blocks[s.block_ids[j]]
                assert block.ref_count == sharing, (record.step, j)
                counts[s.block_ids[j]] = sharing
        peaks.append(counts)
        after = history.kv_state(record.step)
        assert all(b.ref_count == 0 for b in after.blocks)
        releases = [e for e in record.kv_events if isinstance(e, BlockFreed)]
        assert releases and during.apply(releases) == after  # only the releases came later
    rose = any(c > peaks[i - 1].get(b, 0) for i in range(1, len(peaks)) for b, c in peaks[i].items())
    fell = any(c < peaks[i - 1][b] for i in range(1, len(peaks)) for b, c in peaks[i].items()
               if b in peaks[i - 1])
    assert rose and fell
    assert any(c > 1 for c in peaks[-1].values())
    # the BlockMap draws both moments: shared (×ref_count) cells only during the forward
    last = history[-1].step
    during, after = BlockMap(history, last, during_forward=True), BlockMap(history, last)
    assert during.summary["shared"] == sum(1 for c in peaks[-1].values() if c > 1) > 0
    assert after.summary["shared"] == after.summary["used"] == 0 and after.summary["cached"] > 0
    assert {c["block_id"]: c["ref_count"] for c in during.cells if c["ref_count"] > 1} == \
        {b: c for b, c in peaks[-1].items() if c > 1}
    assert f"during step {last}'s forward" in during.title.value and "×" in during.grid.value
