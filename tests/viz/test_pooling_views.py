"""A pooling request in the timeline and the player: prefill-only spans, marked, ending in a
"pooled" finish on the step that computed its prompt (a hand-worked schedule)."""

import matplotlib

matplotlib.use("Agg")

from workbench import LLMEngine, SamplingParams  # noqa: E402
from workbench.pooling_params import PoolingParams  # noqa: E402
from workbench.viz import RequestTimeline, StepPlayer  # noqa: E402
from workbench.viz.timeline import request_spans  # noqa: E402


def test_a_pooling_request_is_a_marked_prefill_only_span():
    # Budget 8: "gen" (3-token prompt) prefills in step 0; the 25-token embedding takes the
    # other 5 tokens of step 0, then 7, 7 and its last 6 in steps 1-3 beside gen's decodes
    # (8 - 1 each); step 3 computes its last prompt token, pools it and finishes it.
    engine = LLMEngine(device="cpu", block_size=4, num_kv_blocks=32, max_num_batched_tokens=8)
    gen = engine.tokenizer("ROMEO:").input_ids
    text = "HAMLET: To be, or not to be, that is the question: whether 'tis nobler in the mind"
    emb = engine.tokenizer(text).input_ids
    assert (len(gen), len(emb)) == (3, 25)
    engine.add_request("gen", gen, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    engine.add_request("emb", emb, PoolingParams())
    while engine.has_unfinished_requests():
        engine.step()
    rows, spans = request_spans(engine.history[:])
    own = [(s["kind"], s["start"], s["end"], s["tokens"], s.get("pooled", False))
           for s in spans if s["request_id"] == "emb"]
    assert own == [("prefill", 0, 1, 5, True), ("prefill", 1, 2, 7, True),
                   ("prefill", 2, 3, 7, True), ("prefill", 3, 4, 6, True), ("finish", 3, 4, 0, False)]
    finish = next(s for s in spans if s["request_id"] == "emb" and s["kind"] == "finish")
    assert finish["reason"] == "pooled"
    assert not any(s.get("pooled") for s in spans if s["request_id"] == "gen")
    assert RequestTimeline(engine).spans == spans
    player = StepPlayer(engine, live_updates=False)
    player.show(3)
    assert any(n.startswith("emb was pooled (prefill-only") for n in player.notes)


def test_an_aborted_pooling_request_is_not_marked_pooled():
    engine = LLMEngine(device="cpu", block_size=4, num_kv_blocks=32, max_num_batched_tokens=8)
    engine.add_request("emb", "HAMLET: To be, or not to be, that is the question", PoolingParams())
    engine.step()  # one chunk of its prompt
    engine.abort_request("emb")
    engine.step()  # records the abort
    (finish,) = [s for s in request_spans(engine.history[:])[1] if s["kind"] == "finish"]
    assert finish["reason"] == "abort"
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks
