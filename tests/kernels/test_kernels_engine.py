"""End to end: the engine with ``attention_backend="triton"`` (every kernel of the forward through
the Triton interpreter) or ``"cpu"`` generates the same greedy tokens as
``attention_backend="torch"`` (the reference) on the embedded model, fp32 on CPU, over a batch that mixes chunked prefill, prefix-cache hits and
decode."""

from __future__ import annotations

import pytest

from workbench import LLMEngine, SamplingParams, default_model_path

PROMPTS = [
    "ROMEO:\nBut soft, what light through yonder window breaks? It is the east,",
    "ROMEO:\nBut soft, what light through yonder window breaks? It is the east, and",
    "LEAR:",
]


def generate(model_path, backend):
    engine = LLMEngine(model=str(model_path), dtype="float32", device="cpu", block_size=8,
                       num_kv_blocks=40, max_num_seqs=3, max_num_batched_tokens=12,
                       enable_prefix_caching=True, enable_chunked_prefill=True,
                       attention_backend=backend)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outs = {}
    engine.add_request("r0", PROMPTS[0], params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs[out.request_id] = out.outputs[0].token_ids
        if len(engine.history) == 3:  # r0's prompt is cached by now: r1 shares its blocks
            engine.add_request("r1", PROMPTS[1], params)
            engine.add_request("r2", PROMPTS[2], params)
    return outs, engine.history.to_dataframe()


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["triton", "cpu"])
def test_engine_matches_torch_engine_greedy(backend):
    path = default_model_path()
    expected, _ = generate(path, "torch")
    got, history = generate(path, backend)
    assert got == expected
    assert all(len(t) == 6 for t in got.values())
    assert history["prefix_hit_tokens"].sum() >= 8, "no prefix-cache hit happened"
    assert (history["prefill_tokens"] > 0).sum() >= 3, "no chunked prefill happened"
    assert ((history["prefill_tokens"] > 0) & (history["decode_tokens"] > 0)).any(), "no mixed step"
