"""Speculative decoding in the views, checked against independent records: the requests' own
output tokens (the engine's RequestOutputs), the KV pool rebuilt from block events, and
hand-built StepRecords whose counts are worked out by hand."""

import re

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402

from workbench import LLMEngine, SamplingParams  # noqa: E402
from workbench.core.sched.output import ScheduledRequest, SchedulerOutput, SpecDecodeResult  # noqa: E402
from workbench.engine.history import StepRecord  # noqa: E402
from workbench.viz import RequestTimeline, StepPlayer  # noqa: E402
from workbench.metrics.spec_stats import spec_decode_summary  # noqa: E402
from workbench.metrics.spec_stats import acceptance_by_position  # noqa: E402
from workbench.viz.spec_decode import (  # noqa: E402
    budget_split, draft_fates, draft_slots, plot_acceptance, plot_tokens_per_step,
)

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
#: A prompt that quotes a passage twice and starts it a third time: prompt lookup finds drafts.
QUOTE = ("ROMEO: But soft, what light through yonder window breaks? It is the east, and Juliet is "
         "the sun. ROMEO: But soft, what light through yonder window breaks? ROMEO: But soft,")


@pytest.fixture(scope="module")
def run():
    engine = LLMEngine(device="cpu", block_size=8, num_kv_blocks=64, max_num_batched_tokens=64,
                       speculative_config=NGRAM)
    engine.add_request("quote", QUOTE, SamplingParams(temperature=0, max_tokens=40))
    engine.add_request("plain", "JULIET:", SamplingParams(temperature=0, max_tokens=13))
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update({o.request_id: o for o in engine.step() if o.finished})
    assert any(r.spec_decode for r in engine.history), "the workload must speculate"
    assert any(res.num_accepted for r in engine.history for res in r.spec_decode.values())
    return engine, outputs


def test_the_records_drafts_rebuild_each_requests_output(run):
    engine, outputs = run
    timeline = RequestTimeline(engine)
    for rid, out in outputs.items():
        assert timeline.output_token_ids(rid) == list(out.outputs[0].token_ids)
        # tokens emitted per decode step, plus the prefill's first token, are the output's length
        emitted = sum(sum(s.get("emitted", ())) for s in timeline.spans if s["request_id"] == rid)
        assert emitted + 1 == len(out.outputs[0].token_ids)
    spans = [s for s in timeline.spans if s["request_id"] == "quote" and s["kind"] == "decode"]
    assert max(max(s["emitted"]) for s in spans) > 1


def test_player_marks_every_draft_and_splits_the_budget(run):
    engine, _ = run
    player = StepPlayer(engine, controls=False, live_updates=False)
    tok = engine.tokenizer
    for record in engine.history[:]:
        player.show(record.step)
        split = budget_split(record)
        assert sum(split.values()) == record.num_scheduled_tokens
        assert split["drafts"] == sum(len(c.token_ids) - 1 for c in record.scheduler_output.scheduled
                                      if c.spec_token_ids)
        for row in player.batch_rows:
            result = record.spec_decode.get(row["request_id"])
            if result is None:
                assert row["drafts"] == []
                continue
            fates = [d["fate"] for d in row["drafts"]]
            k, a = result.num_draft_tokens, result.num_accepted
            assert fates == ["accepted"] * a + ["rejected"] * (k - a) + ["bonus" if a == k else "recovered"]
            assert [d["text"] for d in row["drafts"][:-1]] == [tok.decode([t]) for t in result.draft_token_ids]
            marks = "✓" * a + "✕" * (k - a) + ("+" if a == k else "↳")
            tr = next(t for t in player.batch.value.split("<tr>") if f">{row['request_id']}</span>" in t)
            assert "".join(re.findall(r'class="wb-draft wb-draft-\w+"[^>]*>(.)', tr)) == marks
            assert f"{k} draft tokens: {a} accepted" in " ".join(player.notes)


def test_draft_slots_are_where_the_pool_holds_the_accepted_drafts(run):
    engine, _ = run
    checked = 0
    for record in engine.history[:]:
        if not record.spec_decode:
            continue
        state = engine.history.kv_state(record.step)
        slots = draft_slots(record, state.block_size)
        for chunk in record.scheduler_output.scheduled:
            result = record.spec_decode.get(chunk.request_id)
            if result is None:
                continue
            first = chunk.seq_len - len(chunk.spec_token_ids)
            for j, token in enumerate(result.draft_token_ids):
                block_id = chunk.block_ids[(first + j) // state.block_size]
                slot = (first + j) % state.block_size
                rid, fate = slots[block_id][slot]
                assert rid == chunk.request_id
                block = state.blocks[block_id]
                if j < result.num_accepted:  # the pool holds the accepted draft in that slot
                    assert fate == "accepted" and block.token_ids[slot] == token
                    checked += 1
                else:  # a rejected draft's slot holds no token of the request: reused
                    assert fate == "rejected"
                    assert slot >= len(block.token_ids) or chunk.request_id not in block.owners
    assert checked


def test_block_map_draws_the_draft_slots_with_marks(run):
    engine, _ = run
    step = next(r.step for r in engine.history[:] for res in r.spec_decode.values() if 0 < res.num_accepted
                < res.num_draft_tokens)
    player = StepPlayer(engine, controls=False, live_updates=False)
    player.show(step)
    grid = player.block_map.grid.value
    assert player.block_map.slots and 'class="wb-slots"' in grid
    assert "✓" in grid and "✕" in grid and "slot strip" in player.block_map.legend.value


def hand_record(step, results):
    """A StepRecord with one decoding chunk per (request id, drafts, accepted): the i-th
    has 10 computed tokens and blocks (2i, 2i + 1)."""
    chunks, spec, sampled = [], {}, {}
    for i, (rid, drafts, accepted) in enumerate(results):
        chunks.append(ScheduledRequest(rid, 10, 1 + len(drafts), (7, *drafts), (2 * i, 2 * i + 1), False, True,
                                       spec_token_ids=tuple(drafts)))
        spec[rid] = SpecDecodeResult(tuple(drafts), accepted)
        sampled[rid] = 99
    so = SchedulerOutput(step=step, scheduled=tuple(chunks), token_budget=32)
    return StepRecord(step, so, None, sampled, (), spec_decode=spec)


def test_acceptance_by_position_and_summary_by_hand():
    # step 0: a drafts (1, 2, 3), 2 accepted; b drafts (4, 5), none accepted. step 1: a (6,), accepted.
    records = [hand_record(0, [("a", (1, 2, 3), 2), ("b", (4, 5), 0)]), hand_record(1, [("a", (6,), 1)])]
    assert [(r["drafted"], r["accepted"]) for r in acceptance_by_position(records)] == [(3, 2), (2, 1), (1, 0)]
    assert spec_decode_summary(records) == {
        "spec_num_drafts": 3, "spec_num_draft_tokens": 6, "spec_num_accepted_tokens": 3,
        "spec_acceptance_rate": 0.5, "spec_mean_acceptance_length": 2.0}
    assert draft_fates(records[1], "a") == [(6, "accepted"), (99, "bonus")]
    assert draft_fates(records[0], "b") == [(4, "rejected"), (5, "rejected"), (99, "recovered")]
    # drafts sit at positions 11.. (after the last known token, 10): block 1 (of block size 8)
    # slots 3..5 for a, block 3 slots 3..4 for b
    assert draft_slots(records[0], 8) == {1: {3: ("a", "accepted"), 4: ("a", "accepted"), 5: ("a", "rejected")},
                                          3: {3: ("b", "rejected"), 4: ("b", "rejected")}}
    assert budget_split(records[0]) == {"prefill": 0, "decode": 2, "drafts": 5}


def test_plots_draw_acceptance_and_tokens_per_step(run):
    from workbench.viz.figures import new_figure

    engine, _ = run
    ax = plot_acceptance(engine.history, ax=new_figure(5, 3).subplots())  # not pyplot's: no figure left open
    rows = acceptance_by_position(engine.history[:])
    assert [b.get_height() for b in ax.patches] == pytest.approx([r["rate"] for r in rows])
    ax = plot_tokens_per_step(engine.history, ax=new_figure(8, 3).subplots())
    records = engine.history[:]
    heights = {}
    for bar in ax.patches:
        step = round(bar.get_x() + bar.get_width() / 2)
        heights[step] = heights.get(step, 0) + bar.get_height()
    for record in records:
        emitted = len(record.sampled_token_ids) + sum(r.num_accepted for r in record.spec_decode.values())
        assert heights[record.step] == emitted


def test_compare_runs_puts_speculation_beside_none():
    from workbench import Workload, compare_runs, teaching_config

    workload = Workload.poisson(num_requests=3, rate=1.0, input_len=(8, 20), output_len=(6, 10), seed=1)
    comparison = compare_runs(workload, {"off": {}, "ngram": {"speculative_config": NGRAM}}, base=teaching_config())
    on, off = comparison.results["ngram"], comparison.results["off"]
    assert on.config.speculative_config.num_speculative_tokens == 4 and off.config.speculative_config is None
    # greedy: speculation changes the steps, never the tokens
    assert {r: o.outputs[0].token_ids for r, o in on.outputs.items()} == \
        {r: o.outputs[0].token_ids for r, o in off.outputs.items()}
    summary = spec_decode_summary(on.history)
    assert on.summary()["spec_acceptance_rate"] == summary["spec_acceptance_rate"]
    assert on.summary()["spec_mean_acceptance_length"] == summary["spec_mean_acceptance_length"]
    assert "spec_acceptance_rate" not in off.summary()
    assert list(comparison.table.index) == ["off", "ngram"] and "spec_acceptance_rate" in comparison.table.columns
