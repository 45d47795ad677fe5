"""engine.fork(): a true copy, whatever the engine holds.

The reference is a fresh engine given the same inputs. Each example builds two engines of one
config on deterministic clocks (a counter): ``fresh`` runs the inputs straight through;
``original`` runs them to a drawn step and is forked there, both get the same late request,
and the original runs to the end before the fork does (a fork that shared anything a step
writes with it would then see it changed; a beam search steps the two in turn). Both must equal the fresh engine: every
StepRecord field but the wall-clock ones, every token, logprob, text and request metric.

The workloads mix the base model and the two shipped adapters (``data/loras``) on one or two
device slots (adapters evicted and reloaded), seeded and unseeded sampling, JSON-constrained
requests, shared prefixes (prefix-cache hits) in a small KV cache (preemptions), n-gram and
draft-model speculative decoding, and beam search. Grammars compile at submit (an inline
executor), so no schedule depends on a compile thread's timing.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import json
from concurrent.futures import Executor, Future

import pytest
import torch
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from workbench import LLMEngine, LoRARequest, SamplingParams, first_divergence, teaching_config
from workbench.config import SpeculativeConfig
from workbench.engine.async_llm import AsyncLLM
from workbench.entrypoints.beam_search import BeamSearchInstance
from workbench.lab.replay import replay_workload
from workbench.lab.workload import Workload, WorkloadRequest
from workbench.sampling_params import BeamSearchParams, StructuredOutputsParams
from workbench.model.loader import embedded_lora_path
from workbench.structured_output.manager import StructuredOutputManager

ADAPTERS = {name: LoRARequest(name, i + 1, str(embedded_lora_path(name))) for i, name in enumerate(("errors", "timon"))}
PREFIX = [11, 12, 13, 14, 15, 16, 17, 18]  # two full blocks of 4: prefix-cache hits
SCHEMA = {"type": "object", "properties": {"lines": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["lines"]}
BASE = dict(enable_prefix_caching=True, num_kv_blocks=9, enable_lora=True)
CONFIGS = {
    "lora": dict(max_loras=1),  # one device slot: adapters are evicted and written back
    "ngram": dict(max_loras=2, speculative_config=SpeculativeConfig(
        method="ngram", num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3)),
    "draft_model": dict(max_loras=2, speculative_config=SpeculativeConfig(
        method="draft_model", model="tiny-shakespeare-draft", num_speculative_tokens=2)),
}
#: Few examples, no shrinking (each runs three engines), the same ones every run.
EXAMPLES = settings(max_examples=2, deadline=None, derandomize=True, database=None,
                    phases=[Phase.explicit, Phase.generate])


class Tick:
    """A deterministic clock: each read is 1 ms later."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        self.t += 0.001
        return self.t


class InlineExecutor(Executor):
    """Runs each grammar compile when it is submitted."""

    def submit(self, fn, /, *args, **kwargs) -> Future:
        future: Future = Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as exc:  # noqa: BLE001 - the compile's error, as a thread's would be
            future.set_exception(exc)
        return future


def make_engine(feature: str = "lora", **overrides) -> LLMEngine:
    engine = LLMEngine(teaching_config(**{**BASE, **CONFIGS[feature], **overrides}), clock=Tick())
    engine.scheduler.structured_output_manager = StructuredOutputManager(
        engine.tokenizer, engine.model_config.vocab_size, InlineExecutor(),
        config=engine.config.structured_outputs_config)
    return engine


def params(spec: dict) -> SamplingParams:
    constrained = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True) if spec["json"] else None
    return SamplingParams(temperature=spec["temperature"], max_tokens=spec["max_tokens"], seed=spec["seed"],
                          logprobs=spec["logprobs"], ignore_eos=True, structured_outputs=constrained)


def add(engine: LLMEngine, request_id: str, spec: dict) -> None:
    engine.add_request(request_id, spec["prompt"], params(spec), lora_request=ADAPTERS.get(spec["adapter"]))


def step(engine: LLMEngine, outputs: dict, n: int | None = None) -> dict:
    """Step ``n`` times (None: to the end), keeping each request's latest output: tokens,
    logprobs, text, finish reason and metrics."""
    while (n is None and engine.has_unfinished_requests()) or (n is not None and n > 0):
        for out in engine.step():
            c = out.outputs[0]
            outputs[out.request_id] = (c.token_ids, c.logprobs, c.cumulative_logprob, c.text,
                                       c.finish_reason, out.metrics)
        n = None if n is None else n - 1
    return outputs


def assert_same_record(a, b) -> None:
    """Equal but for the wall clock: ``timings``, the step's latencies (``iteration_stats``) and
    a grammar compile's seconds."""
    for f in dataclasses.fields(a):
        if f.name in ("timings", "iteration_stats"):
            continue
        x, y = getattr(a, f.name), getattr(b, f.name)
        if f.name == "batch" and x is not None:
            for g in dataclasses.fields(x):
                u, v = getattr(x, g.name), getattr(y, g.name)
                assert torch.equal(u, v) if isinstance(u, torch.Tensor) else u == v, (a.step, g.name)
        elif f.name == "structured_output":
            assert dataclasses.replace(x, compiled=list(x.compiled)) == \
                dataclasses.replace(y, compiled=list(y.compiled)), a.step
        else:
            assert x == y, (a.step, f.name)


def assert_same_run(engine, outputs, fresh, fresh_outputs) -> None:
    assert outputs == fresh_outputs
    assert len(engine.history) == len(fresh.history)
    for a, b in zip(engine.history, fresh.history):
        assert_same_record(a, b)
    assert engine.requests_dataframe().equals(fresh.requests_dataframe())
    engine.scheduler.check_invariants()


def check_fork(feature: str, specs: list[dict], late: dict, fork_after: int) -> tuple[LLMEngine, LLMEngine]:
    """The fork's check (see the module docstring); returns the original and its fork."""
    fresh, original = make_engine(feature), make_engine(feature)
    for engine in (fresh, original):
        for i, spec in enumerate(specs):
            add(engine, f"r{i}", spec)
    fresh_out, out = step(fresh, {}, fork_after), step(original, {}, fork_after)
    fork, fork_out = original.fork(), dict(out)
    for engine in (fresh, original, fork):
        add(engine, "late", late)
    step(fresh, fresh_out)
    assert_same_run(original, step(original, out), fresh, fresh_out)
    assert_same_run(fork, step(fork, fork_out), fresh, fresh_out)
    return original, fork


request_spec = st.fixed_dictionaries({
    "prompt": st.builds(lambda shared, tail, twice: (PREFIX if shared else []) + tail * (2 if twice else 1),
                        st.booleans(), st.lists(st.integers(30, 400), min_size=2, max_size=5), st.booleans()),
    "max_tokens": st.integers(3, 5),
    "temperature": st.sampled_from([0.0, 0.8]),
    "seed": st.one_of(st.none(), st.integers(0, 2**31 - 1)),  # unseeded rows draw from the shared generator
    "logprobs": st.one_of(st.none(), st.integers(0, 2)),
})


@st.composite
def workloads(draw) -> tuple[list[dict], dict]:
    """Three requests and a late one, rich even in the simplest draw: the base model and both
    adapters in turn, one request constrained (or none), the first and the late one on the
    shared prefix under the same adapter (a prefix-cache hit: blocks are keyed by adapter)."""
    specs = draw(st.lists(request_spec, min_size=4, max_size=4))
    rotation = draw(st.permutations([None, "errors", "timon"]))
    constrained = draw(st.integers(0, len(specs)))  # len(specs): none
    for i, spec in enumerate(specs):
        spec.update(adapter=rotation[i % 3], json=i == constrained)
    late = specs.pop()
    for spec in (specs[0], late):
        spec["prompt"] = PREFIX + spec["prompt"][-3:]
    late["adapter"] = specs[0]["adapter"]
    return specs, late


@pytest.mark.parametrize("feature", list(CONFIGS))
@EXAMPLES
@given(workload=workloads(), fork_after=st.integers(1, 8))
def test_an_unchanged_fork_steps_as_a_fresh_engine(feature, workload, fork_after):
    check_fork(feature, *workload, fork_after)


def pinned_specs() -> list[dict]:
    """Four requests on a shared prefix, under errors / none / timon / errors, seeded and not."""
    return [dict(prompt=PREFIX + [20 + i] * (3 + 2 * i), max_tokens=7, temperature=1.0,
                 seed=7 + i if i % 2 else None, logprobs=2, adapter=(["errors", None, "timon"] * 2)[i],
                 json=False) for i in range(4)]


def test_a_lora_fork_at_a_preemption_with_prefix_hits_has_its_own_modules_over_shared_weights():
    """The issue's case, sure to fork after a preemption and a prefix-cache hit, on one LoRA slot.
    The fork's modules, LoRA slot tensors and adapter manager are its own; the weights are the
    same storage."""
    late = dict(prompt=PREFIX + [90, 91], max_tokens=6, temperature=0.0, seed=None, logprobs=None,
                adapter="timon", json=False)
    original, fork = check_fork("lora", pinned_specs(), late, fork_after=10)
    before = [r for r in original.history if r.step < 10]
    assert any(r.scheduler_output.preempted_request_ids for r in before)
    assert sum(r.scheduler_output.num_prefix_cache_hit_tokens for r in before) > 0
    a, b = original.runner, fork.runner
    assert a.model is not b.model and a.lora_manager is not b.lora_manager
    assert all(pa is not pb and pa.data_ptr() == pb.data_ptr()
               for pa, pb in zip(a.model.parameters(), b.model.parameters()))
    layer_a, shard = a.lora_manager.modules["model.layers.0.self_attn.q_proj"]
    layer_b, _ = b.lora_manager.modules["model.layers.0.self_attn.q_proj"]
    assert layer_b is b.model.layers[0].self_attn.qkv_proj and layer_b.mapping is b.lora_manager.mapping
    assert layer_b.lora_a[shard].data_ptr() != layer_a.lora_a[shard].data_ptr()


def beam_search(engine, prompt, width, max_tokens, adapter, fork_after):
    """vLLM's beam search over ``engine``, one engine step at a time (each round adds one
    request per live beam, and advances once they all finished); forked, with its search
    state, after ``fork_after`` steps. Returns [(engine, its best beams)], the fork last."""

    class Search:
        def __init__(self) -> None:
            self.engine = engine
            self.beams = BeamSearchInstance(prompt, BeamSearchParams(beam_width=width, max_tokens=max_tokens,
                                                                     ignore_eos=True), engine.tokenizer.eos_token_id)
            self.round: list[str] = []
            self.done: dict = {}

        def step(self) -> None:
            if not self.round:
                for j, p in enumerate(self.beams.prompts()):
                    rid = f"beam{self.beams.num_steps}-{j}"
                    self.engine.add_request(rid, p, self.beams.step_params(), lora_request=ADAPTERS.get(adapter))
                    self.round.append(rid)
            self.done.update((o.request_id, o) for o in self.engine.step() if o.finished)
            if all(rid in self.done for rid in self.round):
                self.beams.advance([self.done.pop(rid) for rid in self.round])
                self.round = []

    searches, steps = [Search()], 0
    while not all(s.beams.done for s in searches):
        for s in searches:
            if not s.beams.done:
                s.step()
        steps += 1
        if steps == fork_after:
            searches.append(copy.deepcopy(searches[0], {id(engine): engine.fork()}))
    return [(s.engine, [(b.tokens, b.cum_logprob) for b in s.beams.best()]) for s in searches]


@EXAMPLES
@given(prompt=st.builds(lambda tail: PREFIX + tail, st.lists(st.integers(30, 400), min_size=1, max_size=5)),
       width=st.integers(2, 3), max_tokens=st.integers(3, 5), adapter=st.sampled_from([None, "errors", "timon"]),
       fork_after=st.integers(1, 3))  # a round takes a step or more: the fork comes mid-search
def test_a_fork_in_the_middle_of_a_beam_search_finishes_it_as_a_fresh_engine(prompt, width, max_tokens, adapter,
                                                                              fork_after):
    [(fresh, best)] = beam_search(make_engine(), prompt, width, max_tokens, adapter, fork_after=-1)
    runs = beam_search(make_engine(), prompt, width, max_tokens, adapter, fork_after)
    assert len(runs) == 2
    for engine, found in runs:
        assert found == best
        assert len(engine.history) == len(fresh.history)
        for a, b in zip(engine.history, fresh.history):
            assert_same_record(a, b)


def kv_bytes(engine) -> int:
    return sum(t.untyped_storage().nbytes() for kv in engine.runner.kv_caches for t in kv)


@pytest.mark.parametrize("level", [1, 2])
def test_sleeping_the_fork_leaves_the_original_as_a_fresh_engine(level):
    specs = pinned_specs()[:2]
    fresh, original = (make_engine(max_loras=2, enable_sleep_mode=True) for _ in range(2))
    for engine in (fresh, original):
        for i, spec in enumerate(specs):
            add(engine, f"r{i}", spec)
    fresh_out, out = step(fresh, {}, 4), step(original, {}, 4)
    fork = original.fork()
    fork.abort_request([f"r{i}" for i in range(len(specs))])
    step(fork, {})
    fork.sleep(level)
    with pytest.raises(RuntimeError, match=r"fork\(\): the engine is sleeping"):
        fork.fork()
    step(fresh, fresh_out)
    assert_same_run(original, step(original, out), fresh, fresh_out)
    fork.wake_up()  # and works: as a fresh engine for a request of its own
    alone = make_engine()
    for engine in (alone, fork):
        add(engine, "x", dict(specs[1], temperature=0.0, max_tokens=6, adapter="timon"))
    assert step(fork, {})["x"][0] == step(alone, {})["x"][0]


@pytest.mark.parametrize("level", [1, 2])
def test_a_fork_s_sleep_frees_its_own_kv_cache_not_the_weights_its_original_holds(level):
    original = make_engine(enable_sleep_mode=True)
    fork = original.fork()
    kv = kv_bytes(fork)
    assert fork.runner.sleep(level) == kv
    del fork
    weights = sum({p.data_ptr(): p.untyped_storage().nbytes() for p in original.runner.model.parameters()}.values())
    # alone now: level 2 frees the weights too (level 1 on a CPU keeps the very storage aside)
    assert original.runner.sleep(level) == kv + (weights if level == 2 else 0)


def test_profiling_the_fork_leaves_the_original_as_a_fresh_engine(tmp_path):
    fresh, original = make_engine(max_loras=2), make_engine(max_loras=2)
    for engine in (fresh, original):
        for i, spec in enumerate(pinned_specs()[:2]):
            add(engine, f"r{i}", dict(spec, max_tokens=4))
    fresh_out, out = step(fresh, {}, 2), step(original, {}, 2)
    original.start_profile(str(tmp_path / "original"))
    with pytest.raises(RuntimeError, match=r"fork\(\): the engine is being profiled.*stop_profile\(\) first"):
        original.fork()
    original.stop_profile()
    fork, fork_out = original.fork(), dict(out)
    fork.start_profile(str(tmp_path / "fork"))
    for _ in range(2):  # the original steps while its fork is profiled
        step(original, out, 1)
        step(fork, fork_out, 1)
    assert not original.runner.model._forward_hooks and "execute" not in vars(original.runner)
    assert fork.stop_profile().is_file()
    step(fresh, fresh_out)
    assert_same_run(original, step(original, out), fresh, fresh_out)
    assert_same_run(fork, step(fork, fork_out), fresh, fresh_out)


def test_a_served_engine_forks_only_on_its_engine_thread():
    engine = make_engine()
    llm = AsyncLLM(engine)
    with pytest.raises(RuntimeError, match=r"being served .*async_llm.submit\(engine.fork\).result\(\).*%llm stop"):
        engine.fork()
    fork = llm.submit(engine.fork).result(timeout=30)  # between two steps, on the engine thread
    fork.fork()  # nobody serves the fork
    asyncio.run(llm.shutdown())
    engine.fork()


def _req(rid, prompt, max_tokens, step, **kw):
    return WorkloadRequest(rid, tuple(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True, **kw),
                           arrival_step=step)


def test_fork_at_branches_a_lora_run():
    """A run replayed on a live engine whose adapter slots are filled already: an unchanged
    branch repeats it, tokens and logprobs."""
    workload = Workload([
        _req("a", PREFIX + [30, 31, 32], 6, 0, temperature=0.0, logprobs=0),
        _req("b", PREFIX + [40] * 5, 6, 0, temperature=1.0, seed=5, logprobs=0),
        _req("c", PREFIX + [50, 51], 5, 1, temperature=0.0, logprobs=0),
    ]).with_lora_requests([ADAPTERS["errors"], None, ADAPTERS["timon"]])
    engine = make_engine()
    engine.add_request("warm", "ROMEO:", SamplingParams(max_tokens=3), lora_request=ADAPTERS["timon"])
    step(engine, {})
    real = replay_workload(engine, workload, clock="steps", forkable=True)
    same = real.fork_at(real.history[0].step + 2)
    assert first_divergence(real, same) is None

    def outputs(run):
        return {rid: (o.outputs[0].token_ids, o.outputs[0].logprobs) for rid, o in run.outputs.items()}
    assert outputs(same) == outputs(real) and len(outputs(real)) == 3


def test_a_fork_is_independent_of_its_original():
    """Aborting and adding on the fork leaves the original's queues, blocks, KV tensors and
    adapter slots as they were (the adapter read into host memory is shared: immutable)."""
    engine = make_engine()
    spec = dict(max_tokens=8, temperature=0.0, seed=None, logprobs=None, adapter="errors", json=False)
    add(engine, "r0", dict(spec, prompt=PREFIX + [40, 41]))
    add(engine, "r1", dict(spec, prompt=PREFIX + [50]))
    engine.step()
    kv = [t.clone() for t in engine.runner.kv_caches[0]]
    tables = {rid: engine.kv_cache.block_table(rid) for rid in ("r0", "r1")}
    fork = engine.fork()
    assert fork.runner.lora_manager.manager.registered[1] is engine.runner.lora_manager.manager.registered[1]
    fork.abort_request("r0")
    fork.add_request("x", [60, 61, 62], SamplingParams(max_tokens=4), lora_request=ADAPTERS["timon"])
    for _ in range(3):
        fork.step()
    assert {rid: engine.kv_cache.block_table(rid) for rid in ("r0", "r1")} == tables
    assert all(torch.equal(a, b) for a, b in zip(kv, engine.runner.kv_caches[0]))
    assert [r.request_id for r in engine.scheduler.running] == ["r0", "r1"]
    assert engine.runner.lora_manager.active_adapters() == {1: 1}
    assert len(engine.history) == 1 and len(fork.history) == 4
    assert fork.history[0] is engine.history[0]  # records are immutable: shared, not copied
    assert fork.history.kv_state(0) == engine.history.kv_state(0)
    engine.scheduler.check_invariants()
    fork.scheduler.check_invariants()


def test_a_fork_continues_a_constrained_request_on_its_own_grammar():
    """A JSON-constrained request sampled at temperature 1 (its grammar compiled on the engine's
    own thread), forked mid-output: its grammar on the fork is a new matcher fed the tokens so
    far, so both engines finish the same valid JSON."""
    engine = LLMEngine(teaching_config(enable_prefix_caching=True), clock=Tick())
    engine.add_request("json", "ROMEO:", SamplingParams(
        temperature=1.0, max_tokens=40, structured_outputs=StructuredOutputsParams(json=SCHEMA,
                                                                                   disable_any_whitespace=True)))
    while not engine.scheduler.requests["json"].num_output_tokens >= 3:
        engine.step()
    fork = engine.fork()
    grammar = fork.scheduler.structured_output_manager._grammars["json"]
    assert grammar.request is fork.scheduler.requests["json"]
    assert grammar.grammar is not engine.scheduler.structured_output_manager._grammars["json"].grammar
    a, b = step(engine, {}), step(fork, {})
    assert a == b and a["json"][4] == "stop"
    assert json.loads(a["json"][3])["lines"] in range(100)
    for ra, rb in zip(engine.history, fork.history):
        assert_same_record(ra, rb)
