"""Greedy speculative decoding is plain greedy decoding, token for token.

References: the same engine without speculation (hypothesis-drawn workloads under a tight
pool: chunked prefill, preemption, prefix hits, aborts, eos / stop strings / max_tokens firing
inside accepted runs) and transformers' greedy ``generate`` of each prompt alone.
"""

import functools
from pathlib import Path

import pytest
import torch
import transformers
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from workbench import LLMEngine, SamplingParams, default_model_path
from workbench.benchmarks.checks import generate, hf_greedy

PASSAGE = ("ROMEO:\nBut soft, what light through yonder window breaks?\nIt is the east, and "
           "Juliet is the sun.\n\nJULIET:\nSay it again:\nROMEO:\nBut soft, what light")
PROMPTS = [
    PASSAGE,
    "HAMLET:\nTo be, or not to be, that is the question: to be, or not to be,",
    PASSAGE[:60],  # shares the passage's first blocks: a prefix-cache hit
    "LEAR:",
    "MACBETH:\nTomorrow, and tomorrow, and tomorrow, creeps in this petty pace",
]
NGRAM = {"method": "ngram", "prompt_lookup_max": 3, "prompt_lookup_min": 1}


def tight_engine(num_kv_blocks=40, **kw):
    return LLMEngine(dtype="float32", device="cpu", block_size=4, num_kv_blocks=num_kv_blocks,
                     max_num_seqs=6, max_num_batched_tokens=24, **kw)


DRAFT = {"method": "draft_model", "model": str(Path(__file__).resolve().parents[2] / "data" / "tiny-shakespeare-draft")}


@functools.cache
def engine(method: str | None, k: int = 0) -> LLMEngine:
    """A tighter pool (18 blocks of 4: the longest request fits alone): a few requests preempt."""
    spec = None if method is None else {**(NGRAM if method == "ngram" else DRAFT), "num_speculative_tokens": k}
    return tight_engine(18, speculative_config=spec)


@pytest.fixture(scope="module")
def tiny():
    path = default_model_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    return model, [tokenizer(p).input_ids for p in PROMPTS]


def spec_counts(engine):
    drafted = sum(r.num_draft_tokens for rec in engine.history for r in rec.spec_decode.values())
    accepted = sum(r.num_accepted for rec in engine.history for r in rec.spec_decode.values())
    return drafted, accepted


def test_ngram_speculation_matches_transformers_greedy(tiny):
    model, prompts = tiny
    eng = tight_engine(speculative_config={**NGRAM, "num_speculative_tokens": 4})
    outs = generate(eng, prompts, SamplingParams(temperature=0, max_tokens=20))
    for ids, out in zip(prompts, outs):
        expected, _ = hf_greedy(model, ids, 20, stop_at_eos=True)
        assert out.token_ids == expected
    drafted, accepted = spec_counts(eng)
    assert drafted > accepted > 0  # drafts were both accepted and rejected
    rows = eng.history.to_dataframe()
    assert rows["preempted"].sum() > 0 and rows["prefix_hit_tokens"].sum() > 0


request_st = st.tuples(
    st.integers(0, len(PROMPTS) - 1),
    st.integers(0, 3),  # arrival step
    st.integers(1, 20),  # max_tokens
    st.sampled_from([(), ("the",), ("\n\n",), ("o", "Romeo")]),  # stop strings
    st.booleans(),  # ignore_eos
    st.one_of(st.none(), st.integers(1, 30)),  # abort at this step
)


def run(eng, reqs, aborts: bool):
    """Add each request at its arrival step; abort at its step (if ``aborts``); the final
    outputs by id. Invariants are checked after every step."""
    base = len(eng.history)
    outs = {}
    step = 0
    while step < 400:
        for i, (p, arrival, max_tokens, stop, ignore_eos, abort) in enumerate(reqs):
            if arrival == step:
                eng.add_request(f"q{i}", PROMPTS[p], SamplingParams(
                    temperature=0, max_tokens=max_tokens, stop=list(stop), ignore_eos=ignore_eos))
            if aborts and abort == step and f"q{i}" in eng.get_unfinished_request_ids():
                eng.abort_request(f"q{i}")
        if step > max(r[1] for r in reqs) and not eng.has_unfinished_requests():
            break
        for out in eng.step():
            outs[out.request_id] = out
        eng.scheduler.check_invariants()
        step += 1
    assert eng.kv_cache.num_free_blocks == eng.kv_cache.num_blocks, "blocks leaked"
    return outs, list(eng.history)[base:]


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(method=st.sampled_from(["ngram", "draft_model"]), k=st.integers(1, 6),
       reqs=st.lists(request_st, min_size=2, max_size=5))
def test_greedy_outputs_with_speculation_equal_those_without(method, k, reqs):
    want, _ = run(engine(None), reqs, aborts=False)
    got, records = run(engine(method, k), reqs, aborts=True)
    event(method)
    for i, r in enumerate(reqs):
        rid = f"q{i}"
        ref = want[rid].outputs[0]
        if rid not in got:  # aborted before its first output (an abort gives none: vLLM's rule)
            event("aborted")
            continue
        out = got[rid].outputs[0]
        if out.finish_reason is None:  # aborted: its last output before the abort
            assert ref.token_ids[: len(out.token_ids)] == out.token_ids
            event("aborted")
        else:
            assert (out.token_ids, out.text, out.finish_reason, out.stop_reason) == (
                ref.token_ids, ref.text, ref.finish_reason, ref.stop_reason), rid
            event(f"finish {out.finish_reason}")
    accepted = [s.num_accepted for rec in records for s in rec.spec_decode.values()]
    event("drafts accepted" if any(accepted) else "no draft accepted")
    event("preempted" if any(rec.scheduler_output.preempted_request_ids for rec in records) else "no preemption")
