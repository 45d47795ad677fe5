"""Structured outputs in the steppable engine (the embedded model): WAITING_FOR_FSM while a
grammar compiles, the compile cache, the grammar ending its request, length when it cannot
finish, and free requests untouched by constrained neighbours. Outputs are checked by
independent means: ``json.loads`` + ``jsonschema``, ``re.fullmatch``, the choice list."""

from __future__ import annotations

import json
import re
from concurrent.futures import Executor, Future

import jsonschema
import pytest
import torch

from workbench import LLMEngine, SamplingParams
from workbench.request import RequestStatus
from workbench.sampling_params import StructuredOutputsParams as S
from workbench.structured_output.manager import StructuredOutputManager

PROMPT = "ROMEO:"
SCHEMA = {"type": "object", "properties": {
    "speaker": {"enum": ["ROMEO", "JULIET"]},
    "lines": {"type": "integer", "minimum": 0, "maximum": 99},
    "aside": {"type": "boolean"}}, "required": ["speaker", "lines"]}


class HeldExecutor(Executor):
    """Runs nothing until ``release()``: the compile's end is the test's to choose."""

    def __init__(self):
        self.jobs = []

    def submit(self, fn, *args, **kwargs):
        future = Future()
        self.jobs.append((future, fn, args, kwargs))
        return future

    def release(self):
        for future, fn, args, kwargs in self.jobs:
            future.set_result(fn(*args, **kwargs))
        self.jobs = []


@pytest.fixture()
def engine():
    return LLMEngine(device="cpu", block_size=8, num_kv_blocks=64)


def run(engine):
    outs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs[out.request_id] = out
        engine.scheduler.check_invariants()
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks
    return {rid: out.outputs[0] for rid, out in outs.items()}


def constrained(**kw):
    so = kw.pop("so")
    return SamplingParams(max_tokens=kw.pop("max_tokens", 80), structured_outputs=so, **kw)


def test_waiting_for_fsm_until_compiled_others_run_and_the_cache_skips_the_wait(engine):
    held = HeldExecutor()
    engine.scheduler.structured_output_manager = StructuredOutputManager(engine.tokenizer,
                                                       engine.model_config.vocab_size, held)
    json_so = S(json=SCHEMA, disable_any_whitespace=True)
    engine.add_request("json", PROMPT, constrained(so=json_so, temperature=0))
    engine.add_request("free", PROMPT, SamplingParams(temperature=0, max_tokens=3))
    request = engine.scheduler.requests["json"]
    assert request.status is RequestStatus.WAITING_FOR_FSM
    assert re.search(r"json:0/\d+ \(fsm\)", repr(engine.scheduler))
    for _ in range(3):  # the free request runs; the constrained one keeps waiting
        engine.step()
        record = engine.history[-1]
        assert record.structured_output.waiting_for_fsm == ("json",)
        assert "waiting_for_fsm=['json']" in repr(record)
        assert request in list(engine.scheduler.waiting)
    engine.add_request("json2", PROMPT, constrained(so=json_so, temperature=0))
    assert engine.scheduler.requests["json2"].status is RequestStatus.WAITING_FOR_FSM
    assert len(held.jobs) == 1  # json2's grammar is json's, still compiling: one compile
    held.release()
    engine.step()
    record = engine.history[-1]
    assert set(record.structured_output.compiled) == {"json", "json2"}
    assert not record.structured_output.waiting_for_fsm
    engine.add_request("json3", PROMPT, constrained(so=json_so, temperature=0))
    assert engine.scheduler.requests["json3"].status is RequestStatus.WAITING  # cached
    assert not held.jobs
    outs = run(engine)
    for rid in ("json", "json2", "json3"):
        assert outs[rid].finish_reason == "stop", outs[rid]
        jsonschema.validate(json.loads(outs[rid].text), SCHEMA)


def test_every_kind_of_constraint_holds_greedy_and_sampled_beside_free_requests(engine):
    alone = LLMEngine(device="cpu", block_size=8, num_kv_blocks=64)
    free = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    alone.add_request("free", "JULIET:", free)
    reference = run(alone)["free"].token_ids
    kinds = {
        "json": S(json=SCHEMA, disable_any_whitespace=True),
        "object": S(json_object=True, disable_any_whitespace=True),
        "regex": S(regex=r"[0-9]{3}-[a-z]{2,4}"),
        "choice": S(choice=["to be", "not to be"]),
        "grammar": S(grammar='root ::= "O " name "!"\nname ::= "Romeo" | "Juliet"'),
    }
    engine.add_request("free", "JULIET:", free)
    for name, so in kinds.items():
        engine.add_request(f"{name}-greedy", PROMPT, constrained(so=so, temperature=0))
        engine.add_request(f"{name}-sampled", PROMPT, constrained(so=so, temperature=1.0,
                                                                 seed=3, max_tokens=200))
    outs = run(engine)
    assert outs["free"].token_ids == reference  # constrained neighbours change nothing
    for mode in ("greedy", "sampled"):
        jsonschema.validate(json.loads(outs[f"json-{mode}"].text), SCHEMA)
        obj = outs[f"object-{mode}"]  # any keys: the model may still be writing one
        if obj.finish_reason == "stop":
            assert isinstance(json.loads(obj.text), dict)
        else:
            assert obj.text.startswith("{") and obj.finish_reason == "length"
        assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", outs[f"regex-{mode}"].text)
        assert outs[f"choice-{mode}"].text in ("to be", "not to be")
        assert re.fullmatch(r"O (Romeo|Juliet)!", outs[f"grammar-{mode}"].text)
        for name in kinds.keys() - {"object"}:
            assert outs[f"{name}-{mode}"].finish_reason == "stop", (name, mode)


def test_a_finished_grammar_ends_the_request_even_with_ignore_eos(engine):
    engine.add_request("c", PROMPT, constrained(so=S(choice=["Romeo"]), temperature=0,
                                                ignore_eos=True))
    outs = run(engine)
    assert (outs["c"].text, outs["c"].finish_reason) == ("Romeo", "stop")
    rows = [r.structured_output.rows["c"] for r in engine.history if "c" in r.structured_output.rows]
    eos = engine.tokenizer.eos_token_id  # once "Romeo" is out, the grammar forces its end
    assert rows[-1].num_allowed == 1 and rows[-1].forced_token == eos
    assert outs["c"].token_ids[-1] == eos and all(row.num_allowed >= 1 for row in rows)


def test_a_grammar_that_cannot_finish_within_max_tokens_ends_with_length(engine):
    engine.add_request("long", PROMPT, constrained(so=S(regex="a{200}"), temperature=0,
                                                   max_tokens=5))
    engine.add_request("free", PROMPT, SamplingParams(temperature=0, max_tokens=5))
    outs = run(engine)
    assert outs["long"].finish_reason == "length" and len(outs["long"].token_ids) == 5
    assert re.fullmatch("a+", outs["long"].text)  # the partial output, inside the grammar
    assert outs["free"].finish_reason in ("length", "stop")


def test_under_preemption_and_chunked_prefill_outputs_still_hold():
    engine = LLMEngine(device="cpu", block_size=8, num_kv_blocks=12, max_num_batched_tokens=16)
    prompt = "JULIET:\\nO Romeo, Romeo! wherefore art thou Romeo?"
    for i in range(4):
        engine.add_request(f"j{i}", prompt, constrained(
            so=S(json=SCHEMA, disable_any_whitespace=True), temperature=1.0, seed=i))
    outs = run(engine)
    assert sum(r.scheduler_stats.num_preemptions for r in engine.history) > 0
    for out in outs.values():
        jsonschema.validate(json.loads(out.text), SCHEMA)


def test_a_bad_schema_is_refused_before_the_engine_with_the_compilers_message(engine):
    with pytest.raises(ValueError, match='structured_outputs: Unsupported type "objectx"'):
        engine.add_request("bad", PROMPT, constrained(so=S(json={"type": "objectx"})))
    assert not engine.has_unfinished_requests()


def test_an_id_used_again_after_its_request_ended_gets_its_own_grammar(engine):
    engine.add_request("x", PROMPT, constrained(so=S(choice=["ay"]), temperature=0))
    assert run(engine)["x"].text == "ay"
    engine.add_request("x", PROMPT, constrained(so=S(choice=["nay"]), temperature=0))
    assert run(engine)["x"].text == "nay"  # not lost when the first "x" is forgotten


def test_a_step_with_only_compiling_grammars_waits_on_them_instead_of_spinning(engine):
    held = HeldExecutor()
    manager = StructuredOutputManager(engine.tokenizer, engine.model_config.vocab_size, held)
    engine.scheduler.structured_output_manager = manager
    waits = []
    real_wait = manager.wait_for_compile
    manager.wait_for_compile = lambda timeout: waits.append(timeout) or real_wait(0)
    engine.add_request("j", PROMPT, constrained(so=S(choice=["ay"]), temperature=0))
    engine.add_request("free", PROMPT, SamplingParams(temperature=0, max_tokens=2))
    engine.step()  # the free request is there to run: no wait
    assert waits == []
    while "free" in engine.scheduler.requests:
        engine.step()
    engine.step()  # only the compiling grammar is left
    assert len(waits) == 1 and waits[0] > 0
    held.release()
    assert run(engine)["j"].text == "ay"


class FailingExecutor(Executor):
    """Every compile fails, as one the parser let through but the compiler refused."""

    def submit(self, fn, *args, **kwargs):
        future = Future()
        future.set_exception(ValueError("the compiler refused it"))
        return future


def test_a_grammar_that_fails_to_compile_fails_its_request_only(engine):
    engine.scheduler.structured_output_manager = StructuredOutputManager(
        engine.tokenizer, engine.model_config.vocab_size, FailingExecutor())
    engine.add_request("bad", PROMPT, constrained(so=S(regex="a+"), temperature=0))
    engine.add_request("free", PROMPT, SamplingParams(temperature=0, max_tokens=4))
    outs = {}
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o for o in engine.step()})
    assert outs["bad"].outputs[0].finish_reason == "error"
    assert "the compiler refused it" in outs["bad"].error
    assert outs["free"].outputs[0].finish_reason == "length"
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks


@pytest.mark.parametrize("kind", ["DELTA", "FINAL_ONLY"])
def test_a_refused_token_ends_the_request_with_an_error_and_is_still_returned(engine, kind):
    """vLLM's scheduler finishes a request whose grammar refuses its sampled token with
    FINISHED_ERROR, and that token still reaches the output. A per-request logits processor
    (applied after the grammar's mask) forces "ay, " and then "X", which the grammar
    "(ay|nay), (sweet|good) lady" refuses: the output is "ay, X", finish_reason "error"."""
    from workbench.sampling_params import RequestOutputKind

    tok = engine.tokenizer
    forced = tok.encode("ay, X", add_special_tokens=False)
    refused = len(tok.encode("ay, ", add_special_tokens=False))
    assert forced[:refused] == tok.encode("ay, ", add_special_tokens=False)

    def force(output_ids, logits):
        logits = torch.full_like(logits, -float("inf"))
        logits[forced[min(len(output_ids), len(forced) - 1)]] = 0.0
        return logits

    params = constrained(so=S(regex="(ay|nay), (sweet|good) lady"), temperature=0,
                         logits_processors=[force], logprobs=0,
                         output_kind=RequestOutputKind[kind])
    engine.add_request("refused", PROMPT, params)
    engine.add_request("free", PROMPT, SamplingParams(temperature=0, max_tokens=4))
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.request_id == "refused"]
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks
    final = outs[-1]
    if kind == "DELTA":
        token_ids = [t for o in outs for t in o.outputs[0].token_ids]
        text = "".join(o.outputs[0].text for o in outs)
        logprobs = [p for o in outs for p in o.outputs[0].logprobs]
    else:
        assert len(outs) == 1
        token_ids, text = final.outputs[0].token_ids, final.outputs[0].text
        logprobs = final.outputs[0].logprobs
    assert token_ids == forced[: refused + 1]  # the refused token is the last one returned
    assert text == tok.decode(forced[: refused + 1]) == "ay, X"
    assert len(logprobs) == refused + 1 and forced[refused] in logprobs[-1]
    assert final.finished and final.outputs[0].finish_reason == "error"
    assert f"does not accept token {forced[refused]}" in final.error
