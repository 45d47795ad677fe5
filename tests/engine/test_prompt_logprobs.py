"""prompt_logprobs against transformers: log_softmax of the same weights over the same prompt.

vLLM's format: ``RequestOutput.prompt_logprobs[0]`` is None (nothing predicts the first
token); entry ``i`` maps prompt token ``i`` (first) and the top-k tokens to Logprob(value,
rank, decoded). A request asking for them computes its whole prompt (no prefix-cache hit),
and chunked prefill or preemption must not change a value.
"""

import pytest
import torch
import transformers

from workbench import LLMEngine, SamplingParams, default_model_path
from workbench.sampling_params import RequestOutputKind

PROMPT = "KING HENRY:\nOnce more unto the breach, dear friends, once more; or close the wall"
K = 3


@pytest.fixture(scope="module")
def reference():
    """(prompt ids, [P, vocab] fp32 log-probabilities of the next token at each position)."""
    path = default_model_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = transformers.AutoTokenizer.from_pretrained(path)(PROMPT).input_ids
    with torch.inference_mode():
        logits = model(torch.tensor([ids])).logits[0].float()
    return ids, torch.log_softmax(logits, dim=-1)


def engine(**kw):
    return LLMEngine(device="cpu", dtype="float32", block_size=4, **kw)


def run(engine, rid, params):
    engine.add_request(rid, PROMPT, params)
    outs = []
    while engine.has_unfinished_requests():
        outs.extend(o for o in engine.step() if o.request_id == rid)
        engine.scheduler.check_invariants()
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks
    return outs


def assert_matches(prompt_logprobs, reference):
    ids, logprobs = reference
    assert len(prompt_logprobs) == len(ids) and prompt_logprobs[0] is None
    for i in range(1, len(ids)):
        row = logprobs[i - 1]  # position i - 1 predicts token i
        entry = prompt_logprobs[i]
        first = next(iter(entry))
        assert first == ids[i]  # the prompt token comes first
        assert entry[ids[i]].logprob == pytest.approx(row[ids[i]].item(), abs=1e-4)
        assert entry[ids[i]].rank == int((row > row[ids[i]]).sum()) + 1
        top_vals, top_ids = row.topk(K)
        for rank, (t, v) in enumerate(zip(top_ids.tolist(), top_vals.tolist()), start=1):
            assert t in entry and entry[t].logprob == pytest.approx(v, abs=1e-4)
            if t != ids[i]:
                assert entry[t].rank == rank
        assert len(entry) in (K, K + 1)


@pytest.mark.parametrize("budget", [512, 7])  # whole prompt in one step; chunks of 7 tokens
def test_prompt_logprobs_match_transformers(reference, budget):
    eng = engine(num_kv_blocks=64, max_num_batched_tokens=budget)
    run(eng, "warm", SamplingParams(temperature=0, max_tokens=1))
    outs = run(eng, "p", SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=K,
                                        ignore_eos=True))  # CUMULATIVE
    # One output per generated token (prefill chunks make none), each with the whole list.
    assert [len(o.outputs[0].token_ids) for o in outs] == [1, 2, 3]
    assert all(o.prompt_logprobs == outs[-1].prompt_logprobs for o in outs)
    out = outs[-1]
    assert out.num_cached_tokens == 0, "a prompt_logprobs request must not use the prefix cache"
    assert_matches(out.prompt_logprobs, reference)
    decoded = out.prompt_logprobs[1][reference[0][1]].decoded_token
    assert decoded == eng.tokenizer.decode([reference[0][1]])
    if budget < len(reference[0]):
        assert sum(1 for r in eng.history for s in r.scheduler_output.scheduled
                   if s.request_id == "p" and s.is_prefill) > 1, "no chunked prefill happened"
    # The same prompt without prompt_logprobs does hit the cache the runs above filled.
    (again,) = run(eng, "again", SamplingParams(temperature=0, max_tokens=1))
    assert again.num_cached_tokens > 0 and again.prompt_logprobs is None


def test_prompt_logprobs_survive_preemption_and_come_once_in_a_delta_stream(reference):
    eng = engine(num_kv_blocks=12, max_num_batched_tokens=16, max_num_seqs=3)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, prompt_logprobs=K,
                            output_kind=RequestOutputKind.DELTA)
    for i in range(2):
        eng.add_request(f"other{i}", "HAMLET:\nTo be, or not to be",
                        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    outs = run(eng, "p", params)
    assert eng.history.to_dataframe()["preempted"].sum() > 0, "no preemption happened"
    # vLLM's DELTA rule (LogprobsProcessor.pop_prompt_logprobs): the first output carries them
    # whole, every later one an empty list (None only when prompt logprobs are off)
    assert len(outs) > 1 and all(o.prompt_logprobs == [] for o in outs[1:])
    assert_matches(outs[0].prompt_logprobs, reference)
    # FINAL_ONLY and CUMULATIVE keep the whole list in every output they give
    final = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, prompt_logprobs=K,
                           output_kind=RequestOutputKind.FINAL_ONLY)
    (out,) = run(eng, "final", final)
    assert_matches(out.prompt_logprobs, reference)
    off = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True,
                         output_kind=RequestOutputKind.DELTA)
    assert all(o.prompt_logprobs is None for o in run(eng, "off", off))


def test_a_prompt_logprobs_fault_fails_only_its_request(monkeypatch):
    import workbench.worker.model_runner as runner

    eng = engine(num_kv_blocks=64, max_num_batched_tokens=512)
    real = runner.gather_logprobs

    def fragile(logits, token_ids, num_logprobs):
        if num_logprobs[0] == 2:
            raise MemoryError("no room for the top-k")
        return real(logits, token_ids, num_logprobs)

    monkeypatch.setattr(runner, "gather_logprobs", fragile)
    eng.add_request("ok", PROMPT, SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=1))
    outs = run(eng, "bad", SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=2))
    assert outs[-1].finished and outs[-1].error == "MemoryError: no room for the top-k"
    assert outs[-1].outputs[0].token_ids == []
    assert eng.history[0].finished_request_ids == ("bad",)
