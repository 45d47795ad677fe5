"""What a grammar does, per step and per constrained request, as the StepRecord, the
StepPlayer and the RequestTimeline show it, and as Prometheus counts it. Checked against
references the grammar code does not compute: the vocabulary filtered by ``re.fullmatch``
(how many tokens a regex allows first), a one-choice grammar (every token forced, so the
forced tokens spell the output), and counts by hand (compiles, cache hits)."""

from __future__ import annotations

import re
from concurrent.futures import Future

import prometheus_client
import pytest

from workbench import LLMEngine, SamplingParams
from workbench.metrics.prometheus import PrometheusStatLogger
from workbench.sampling_params import StructuredOutputsParams as S
from workbench.structured_output.manager import StructuredOutputManager
from workbench.viz.player import StepPlayer
from workbench.viz.timeline import RequestTimeline, request_spans


class HeldExecutor:
    """Runs nothing until ``release()``: the test chooses when the compile ends."""

    def __init__(self):
        self.jobs = []

    def submit(self, fn, *args):
        future = Future()
        self.jobs.append((future, fn, args))
        return future

    def release(self):
        for future, fn, args in self.jobs:
            future.set_result(fn(*args))
        self.jobs = []


def run(engine):
    while engine.has_unfinished_requests():
        engine.step()


@pytest.fixture(scope="module")
def engine():
    engine = LLMEngine(device="cpu", block_size=8, num_kv_blocks=64)
    engine.add_logger("prometheus", PrometheusStatLogger("tiny"))
    held = HeldExecutor()
    engine.scheduler.structured_output_manager = StructuredOutputManager(
        engine.tokenizer, engine.model_config.vocab_size, held)
    engine.add_request("free", "JULIET:", SamplingParams(temperature=0, max_tokens=6))
    engine.add_request("forced", "ROMEO:", SamplingParams(
        temperature=0, max_tokens=40, structured_outputs=S(choice=["O Romeo, Romeo!"])))
    engine.add_request("digits", "ROMEO:", SamplingParams(
        temperature=1.0, seed=2, max_tokens=8, structured_outputs=S(regex="[0-9]{3}")))
    engine.step()
    engine.step()  # two steps with both grammars still compiling
    held.release()
    engine.add_request("again", "ROMEO:", SamplingParams(  # the same grammar: a cache hit
        temperature=0, max_tokens=40, structured_outputs=S(choice=["O Romeo, Romeo!"])))
    run(engine)
    return engine


def test_a_choice_masks_what_extends_a_prefix_of_it_and_forces_the_end(engine):
    """By hand: a token is allowed iff the text so far plus the token's text is still a
    prefix of the choice; once the choice is complete only the end-of-sequence token is."""
    target, eos = "O Romeo, Romeo!", engine.tokenizer.eos_token_id
    pieces = [engine.tokenizer.decode([t]) for t in range(engine.model_config.vocab_size)]
    output = []
    for record in engine.history:
        if "forced" not in record.structured_output.rows:
            continue
        row = record.structured_output.rows["forced"]
        so_far = engine.tokenizer.decode(output)
        by_hand = sum(1 for t, p in enumerate(pieces)
                      if p and t != eos and target.startswith(so_far + p))
        by_hand += so_far == target
        assert row.num_allowed == by_hand, (so_far, row)
        sampled = record.sampled_token_ids["forced"]
        if row.num_allowed == 1:
            assert row.forced_token == sampled  # forced: the only token the sampler may pick
        output.append(sampled)
    assert engine.tokenizer.decode(output[:-1]) == target and output[-1] == eos
    assert row.forced_token == eos  # the last row: the grammar forced the end


def test_the_first_regex_mask_allows_the_tokens_a_fullmatch_allows(engine):
    vocab = engine.model_config.vocab_size
    by_hand = sum(1 for t in range(vocab)
                  if re.fullmatch(r"[0-9]{1,3}", engine.tokenizer.decode([t])))
    first = next(r.structured_output.rows["digits"] for r in engine.history
                 if "digits" in r.structured_output.rows)
    assert first.num_allowed == by_hand > 1 and first.forced_token is None


def test_the_player_shows_each_constrained_rows_mask(engine):
    player = StepPlayer(engine, live_updates=False)
    step = next(r.step for r in engine.history
                if {"forced", "digits"} <= set(r.structured_output.rows))
    player.show(step)
    record = engine.history[step - engine.history[0].step]
    grammar = {r["request_id"]: r["grammar"] for r in player.batch_rows}
    assert grammar.get("free") is None
    row = record.structured_output.rows["forced"]
    assert grammar["forced"] == {"num_allowed": 1,
                                 "forced": engine.tokenizer.decode([row.forced_token])}
    assert grammar["digits"]["num_allowed"] == record.structured_output.rows["digits"].num_allowed
    assert "grammar mask" in player.batch.value and "<b>forced</b>" in player.batch.value
    player.show(0)
    assert any("still wait for their grammar" in n and "WAITING_FOR_FSM" in n
               for n in player.notes)
    player.show(2)
    assert "forced's grammar is ready (xgrammar, compiled); it may be scheduled." in player.notes


def test_the_timeline_draws_the_wait_for_the_grammar_with_its_compile_time(engine):
    rows, spans = request_spans(engine.history)
    fsm = {s["request_id"]: s for s in spans if s["kind"] == "waiting_for_fsm"}
    assert set(fsm) == {"forced", "digits"}  # "again" found its grammar cached
    for span in fsm.values():
        assert (span["start"], span["end"]) == (0, 2) and span["compile_s"] > 0
    first_chunk = min(s["start"] for s in spans
                      if s["request_id"] == "forced" and s["kind"] == "prefill")
    assert first_chunk == 2  # scheduled in the step its grammar became ready
    timeline = RequestTimeline(engine)
    timeline.select_request("forced")
    assert re.search(r"waiting_for_fsm 0–1 \(grammar compiled in [0-9.]+ ms\)",
                     timeline.details.value)


def test_prometheus_counts_compiles_compile_times_and_cache_hits(engine):
    text = prometheus_client.generate_latest(
        engine.stat_loggers["prometheus"].registry).decode()

    def value(name):
        return float(re.search(rf'^{re.escape(name)}{{model_name="tiny"}} (\S+)$', text,
                               re.M).group(1))

    assert value("workbench:grammar_compiles_total") == 2  # two distinct constraints
    assert value("workbench:grammar_compile_seconds_count") == 2
    assert value("workbench:grammar_compile_seconds_sum") > 0
    assert value("workbench:grammar_cache_hits_total") == 1  # "again"
    assert engine.scheduler.structured_output_manager.num_compiles == 2
    assert engine.scheduler.structured_output_manager.num_cache_hits == 1
