"""engine.fork(): an unchanged fork steps bitwise like its original.

Both engines run on a deterministic clock (a counter), so every StepRecord field but the
wall-clock ``timings`` must be equal -- request timestamps included -- as must every token,
logprob and text. The original runs to the end first and the fork afterwards: a fork that
shared KV tensors, blocks, generators or detokenizers with it would then see them changed.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from workbench import LLMEngine, SamplingParams, teaching_config


class Tick:
    """A deterministic clock: each read is 1 ms later."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        self.t += 0.001
        return self.t


@pytest.fixture(scope="module")
def blank():
    """An engine that never stepped: its forks are fresh engines, without loading the model again."""
    return LLMEngine(teaching_config(enable_prefix_caching=True, num_kv_blocks=12), clock=Tick())


PREFIX = [11, 12, 13, 14, 15, 16, 17, 18]  # two full blocks of 4: prefix-cache hits


def assert_same_record(a, b) -> None:
    for f in dataclasses.fields(a):
        if f.name == "timings":
            continue
        x, y = getattr(a, f.name), getattr(b, f.name)
        if f.name == "batch" and x is not None:
            for g in dataclasses.fields(x):
                u, v = getattr(x, g.name), getattr(y, g.name)
                assert torch.equal(u, v) if isinstance(u, torch.Tensor) else u == v, (a.step, g.name)
        else:
            assert x == y, (a.step, f.name)


def finish(engine) -> dict:
    """Step to the end; the final output of each request: tokens, logprobs, text, metrics."""
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            c = out.outputs[0]
            final[out.request_id] = (c.token_ids, c.logprobs, c.cumulative_logprob, c.text, c.finish_reason,
                                     out.metrics)
    return final


def add_requests(engine, specs) -> None:
    for i, (prompt, max_tokens, temperature, seed, logprobs) in enumerate(specs):
        engine.add_request(f"r{i}", prompt, SamplingParams(temperature=temperature, max_tokens=max_tokens,
                                                           seed=seed, logprobs=logprobs, ignore_eos=True))


def check_fork_is_identical(original, fork_after: int) -> tuple[int, int]:
    """Fork ``original`` after ``fork_after`` steps and run both out; returns the preemptions
    and prefix-hit tokens seen before the fork."""
    for _ in range(fork_after):
        original.step()
    before = list(original.history)
    preempted = sum(len(r.scheduler_output.preempted_request_ids) for r in before)
    hits = sum(r.scheduler_output.num_prefix_cache_hit_tokens for r in before)
    fork = original.fork()
    fork.scheduler.check_invariants()
    assert fork.kv_cache.pool.free_queue.block_ids() == original.kv_cache.pool.free_queue.block_ids()
    assert fork.kv_cache is not original.kv_cache and fork.runner.model is original.runner.model
    a = finish(original)
    b = finish(fork)
    assert a == b
    assert len(original.history) == len(fork.history)
    for ra, rb in zip(original.history, fork.history):
        assert_same_record(ra, rb)
    assert original.requests_dataframe().equals(fork.requests_dataframe())
    return preempted, hits


def test_a_fork_at_a_preemption_with_prefix_hits_continues_identically(blank):
    """A pinned case that is sure to fork after a preemption and a prefix-cache hit, with
    seeded and unseeded sampling side by side."""
    engine = blank.fork()
    specs = [(PREFIX + [20 + i] * (3 + 2 * i), 12, 1.0, (7 + i if i % 2 else None), 2) for i in range(4)]
    add_requests(engine, specs)
    preempted, hits = check_fork_is_identical(engine, fork_after=10)
    assert preempted > 0 and hits > 0


request_spec = st.tuples(
    st.builds(lambda shared, tail: (PREFIX if shared else []) + tail,
              st.booleans(), st.lists(st.integers(30, 400), min_size=1, max_size=10)),
    st.integers(2, 12),  # max_tokens
    st.sampled_from([0.0, 0.8, 1.5]),  # temperature
    st.one_of(st.none(), st.integers(0, 2**31 - 1)),  # seed: unseeded rows draw from the shared generator
    st.one_of(st.none(), st.integers(0, 3)),  # logprobs
)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture],
          phases=[Phase.explicit, Phase.reuse, Phase.generate])  # no shrinking: each example runs a model
@given(specs=st.lists(request_spec, min_size=2, max_size=4), fork_after=st.integers(0, 12))
def test_an_unchanged_fork_is_bitwise_identical(blank, specs, fork_after):
    engine = blank.fork()
    add_requests(engine, specs)
    check_fork_is_identical(engine, fork_after)


def test_a_fork_is_independent_of_its_original(blank):
    """Aborting and adding on the fork leaves the original's queues, blocks and KV tensors as they were."""
    engine = blank.fork()
    add_requests(engine, [(PREFIX + [40, 41], 8, 0.0, None, None), (PREFIX + [50], 8, 0.0, None, None)])
    engine.step()
    kv = [t.clone() for t in engine.runner.kv_caches[0]]
    tables = {rid: engine.kv_cache.block_table(rid) for rid in ("r0", "r1")}
    fork = engine.fork()
    fork.abort_request("r0")
    fork.add_request("x", [60, 61, 62], SamplingParams(max_tokens=4))
    for _ in range(3):
        fork.step()
    assert {rid: engine.kv_cache.block_table(rid) for rid in ("r0", "r1")} == tables
    assert all(torch.equal(a, b) for a, b in zip(kv, engine.runner.kv_caches[0]))
    assert [r.request_id for r in engine.scheduler.running] == ["r0", "r1"]
    assert len(engine.history) == 1 and len(fork.history) == 4
    assert fork.history[0] is engine.history[0]  # records are immutable: shared, not copied
    assert fork.history.kv_state(0) == engine.history.kv_state(0)
    engine.scheduler.check_invariants()
    fork.scheduler.check_invariants()


def test_a_fork_continues_a_constrained_request_on_its_own_grammar(blank):
    """A JSON-constrained request sampled at temperature 1, forked mid-output: its grammar on the
    fork is a new matcher fed the tokens so far, so both engines finish the same valid JSON."""
    import json

    from workbench.sampling_params import StructuredOutputsParams

    engine = blank.fork()
    schema = {"type": "object", "properties": {"lines": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["lines"]}
    engine.add_request("json", "ROMEO:", SamplingParams(
        temperature=1.0, max_tokens=40, structured_outputs=StructuredOutputsParams(json=schema,
                                                                                   disable_any_whitespace=True)))
    while not engine.scheduler.requests["json"].num_output_tokens >= 3:
        engine.step()
    fork = engine.fork()
    grammar = fork.structured_output._grammars["json"]
    assert grammar.request is fork.scheduler.requests["json"] and grammar.grammar is not engine.structured_output._grammars["json"].grammar
    a, b = finish(engine), finish(fork)
    assert a == b and a["json"][4] == "stop"
    assert json.loads(a["json"][3])["lines"] in range(100)
    for ra, rb in zip(engine.history, fork.history):
        assert_same_record(ra, rb)
