"""cache_salt (vLLM's fix for CVE-2025-46570): the salt is mixed into the first block's hash,
so requests with different salts (or none) share no prefix-cache block; the same salt does.
The reference is the block tables themselves: which physical blocks each request holds."""

from __future__ import annotations

import pytest

from workbench import LLMEngine, SamplingParams

PROMPT = "JULIET:\nO Romeo, Romeo! wherefore art thou Romeo? Deny thy father and refuse thy name."
LONG = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.fixture()
def engine():
    return LLMEngine(device="cpu", block_size=8, num_kv_blocks=64)


def prompt(salt: str | None) -> dict:
    return {"prompt": PROMPT} if salt is None else {"prompt": PROMPT, "cache_salt": salt}


def tables_after_prefill(engine, salts: dict[str, str | None]) -> dict[str, list[int]]:
    """Run the first request's prefill alone (its blocks get cached), then add the others and
    run one step: every request's block table while all are running."""
    first, *rest = salts
    engine.add_request(first, prompt(salts[first]), LONG)
    engine.step()
    for rid in rest:
        engine.add_request(rid, prompt(salts[rid]), LONG)
    engine.step()
    return {rid: engine.kv_cache.block_table(rid) for rid in salts}


def test_different_salts_share_no_block_and_the_same_salt_shares_the_prefix(engine):
    tables = tables_after_prefill(engine, {"alice": "tenant-a", "bob": "tenant-b",
                                           "plain": None, "alice2": "tenant-a"})
    full = (engine.scheduler.requests["alice"].num_prompt_tokens - 1) // 8
    assert full >= 2
    assert not set(tables["alice"]) & set(tables["bob"])
    assert not set(tables["alice"]) & set(tables["plain"])
    assert not set(tables["bob"]) & set(tables["plain"])
    assert tables["alice2"][:full] == tables["alice"][:full]  # the same tenant hits its cache
    assert engine.scheduler.requests["alice2"].num_cached_tokens == full * 8
    assert engine.scheduler.requests["bob"].num_cached_tokens == 0
    outs = {}
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o for o in engine.step()})
    # the salt changes which blocks are shared, never the tokens
    assert len({tuple(o.outputs[0].token_ids) for o in outs.values()}) == 1


def test_unsalted_requests_still_share(engine):
    tables = tables_after_prefill(engine, {"a": None, "b": None})
    assert tables["a"][0] == tables["b"][0]


@pytest.mark.parametrize("salt, words", [
    ("", "must be a non-empty string"),
    (5, "must be a non-empty string"),
    ("x" * 129, "at most 128 characters"),
    ("a/b", "must not contain '@', '/'"),
    ("a@b", "must not contain"),
])
def test_bad_salts_are_refused_with_vllms_message(engine, salt, words):
    with pytest.raises(ValueError, match="Parameter 'cache_salt'") as info:
        engine.add_request("bad", {"prompt": PROMPT, "cache_salt": salt}, LONG)
    assert words in str(info.value)
    assert not engine.has_unfinished_requests()
