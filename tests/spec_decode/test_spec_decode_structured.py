"""Speculative decoding with structured outputs: a constrained request's drafts are cut to
the prefix its grammar accepts, each verified position is masked by the grammar after the
drafts before it, and the grammar advances on the accepted tokens only.

References: the same requests on an engine without speculation (greedy outputs equal token
for token, in a batch mixed with free requests) and ``jsonschema`` / ``re.fullmatch``.
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path

import jsonschema
import pytest
import torch

from workbench import LLMEngine, SamplingParams
from workbench.core.sched.output import ScheduledRequest, SchedulerOutput
from workbench.request import Request, RequestStatus
from workbench.sampling_params import StructuredOutputsParams as S
from workbench.structured_output.backends import grammar_key
from workbench.worker.sampler import unpack_bitmask

DRAFT = str(Path(__file__).resolve().parents[2] / "data" / "tiny-shakespeare-draft")
SCHEMA = {"type": "object", "properties": {"name": {"enum": ["Romeo", "Juliet"]},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "age"], "additionalProperties": False}
REGEX = r"(Romeo|Juliet)( (Romeo|Juliet)){2,5}"
CHOICE = ["Romeo and Juliet", "Hamlet, Prince of Denmark"]
# Prompts that hold the constrained text, so n-gram lookup finds drafts in them.
RECORD = '{"name":"Juliet","age":13}'
CONSTRAINED = {
    "json": (f"ROMEO:\n{RECORD}\n{RECORD}\n", S(json=SCHEMA, disable_any_whitespace=True)),
    "regex": ("JULIET:\nRomeo Romeo Juliet Romeo Juliet Romeo Romeo\n", S(regex=REGEX)),
    "choice": ("LEAR:\nRomeo and Juliet, Romeo and Juliet,", S(choice=CHOICE)),
}
FREE = {"free-a": "ROMEO:\nBut soft, what light through yonder window breaks? But soft,",
        "free-b": "HAMLET:\nTo be, or not to be, that is the question: to be,"}


@functools.cache
def engine(method: str | None, k: int = 0) -> LLMEngine:
    spec = None if method is None else {
        **({"method": "ngram", "prompt_lookup_max": 3, "prompt_lookup_min": 1}
           if method == "ngram" else {"method": "draft_model", "model": DRAFT}),
        "num_speculative_tokens": k}
    return LLMEngine(dtype="float32", device="cpu", block_size=8, num_kv_blocks=96,
                     max_num_seqs=8, speculative_config=spec)


def run(engine: LLMEngine, sampled: bool = False) -> dict[str, list[int]]:
    """The mixed batch on ``engine``: {request id: its output tokens}."""
    start = len(engine.history)
    for rid, (prompt, so) in CONSTRAINED.items():
        engine.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=48,
                                                       structured_outputs=so))
    for rid, prompt in FREE.items():
        engine.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    if sampled:
        prompt, so = CONSTRAINED["json"]
        engine.add_request("sampled", prompt, SamplingParams(temperature=0.8, seed=7, max_tokens=48,
                                                             structured_outputs=so))
    outs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs[out.request_id] = out.outputs[0]
        engine.scheduler.check_invariants()
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks
    engine.run_history = engine.history[start:]
    for rid in (*CONSTRAINED, *(("sampled",) if sampled else ())):
        assert outs[rid].finish_reason == "stop", (rid, outs[rid])
        validate(rid if rid != "sampled" else "json", outs[rid].text)
    return {rid: list(out.token_ids) for rid, out in outs.items()}


def validate(kind: str, text: str) -> None:
    if kind == "json":
        jsonschema.validate(json.loads(text), SCHEMA)
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), text
    else:
        assert text in CHOICE, text


def constrained_drafts(engine: LLMEngine) -> tuple[int, int]:
    """(drafts verified, drafts accepted) for the constrained requests of the last run."""
    results = [r for rec in engine.run_history for rid, r in rec.spec_decode.items()
               if rid in CONSTRAINED]
    return sum(r.num_draft_tokens for r in results), sum(r.num_accepted for r in results)


@pytest.fixture(scope="module")
def reference():
    return run(engine(None))


def drafts_outside_the_grammar(engine: LLMEngine, outputs: dict[str, list[int]]) -> list:
    """(request id, step) of each verified draft run of a constrained request in the last run
    that a fresh matcher, fed the request's output before that step, does not accept whole."""
    manager, bad = engine.scheduler.structured_output_manager, []
    for rid, (_, so) in CONSTRAINED.items():
        key = grammar_key(so)
        backend = manager._backend(key.backend)
        compiled, done = backend.compile(key), 0
        for rec in engine.run_history:
            if rid not in rec.sampled_token_ids:
                continue
            result = rec.spec_decode.get(rid)
            if result is not None and result.draft_token_ids:
                fresh = backend.make_grammar(compiled)
                assert all(fresh.accept_token(t) for t in outputs[rid][:done])
                drafts = list(result.draft_token_ids)
                if fresh.validate_tokens(drafts) != len(drafts):
                    bad.append((rid, rec.step))
            done += 1 + (0 if result is None else result.num_accepted)
    return bad


@pytest.mark.parametrize("method,k", [("ngram", 2), ("ngram", 3), ("ngram", 4), ("draft", 3)])
def test_greedy_constrained_equals_plain_decoding(reference, method, k):
    """The same tokens as without speculation, and every draft verified for a constrained
    request lies inside its grammar (the rest were cut before scheduling)."""
    spec = engine(method, k)
    outputs = run(spec)
    assert outputs == reference
    drafted, accepted = constrained_drafts(spec)
    assert drafted > 0 and accepted > 0, (drafted, accepted)  # the path under test ran
    assert drafts_outside_the_grammar(spec, outputs) == []


def test_one_mask_row_per_verified_position():
    """A verifying constrained request's mask row ``j`` is that of a fresh matcher fed its
    output and ``drafts[:j]``; its grammar is left as it was; the step's row is row 0's."""
    spec = engine(None)
    tok, vocab = spec.tokenizer, spec.model_config.vocab_size
    manager = spec.scheduler.structured_output_manager
    request = Request("r", tok("ROMEO:").input_ids, SamplingParams(structured_outputs=S(regex=REGEX)))
    manager.add_request(request)
    while manager.compiling:
        manager.wait_for_compile(1.0)
    manager.update_waiting({"r": request})
    request.output_token_ids += tok.encode("Romeo J", add_special_tokens=False)
    manager.accept_tokens([request])
    drafts = tuple(tok.encode("uliet", add_special_tokens=False))
    chunk = ScheduledRequest("r", request.num_tokens - 1, 1 + len(drafts),
                             (request.all_token_ids[-1], *drafts), (), False, True,
                             spec_token_ids=drafts)
    rows = manager.grammar_bitmask(SchedulerOutput(step=0, scheduled=(chunk,)))["r"]
    assert rows.shape[0] == len(drafts) + 1
    key = grammar_key(S(regex=REGEX))
    backend = manager._backend(key.backend)
    for j in range(len(drafts) + 1):
        fresh = backend.make_grammar(backend.compile(key))
        for token in (*request.output_token_ids, *drafts[:j]):
            assert fresh.accept_token(token)
        expected = torch.full((1, rows.shape[1]), -1, dtype=torch.int32)
        fresh.fill_bitmask(expected, 0)
        assert torch.equal(rows[j], expected[0]), j
    assert torch.equal(unpack_bitmask(rows[:1], vocab).sum(), torch.tensor(
        manager.take_step({"r": request}).rows["r"].num_allowed))
    assert manager.validate_tokens("r", list(drafts)) == len(drafts)  # rolled back: unchanged
    request.status = RequestStatus.FINISHED_ABORTED
    manager.remove(["r"])


def test_sampled_constrained_request_validates():
    run(engine("ngram", 3), sampled=True)
