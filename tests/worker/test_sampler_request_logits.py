"""The sampler's per-request logits work (logits_processors, allowed_token_ids, bad_words,
logit_bias) and its fault isolation. Expectations are worked out by hand on a 5-token
distribution; isolation is checked against the same batch without the faulty row."""

from __future__ import annotations

import math

import pytest
import torch

from workbench.request import Request
from workbench.worker.sampler import Sampler
from workbench.sampling_params import SamplingParams

# token 2 is the most likely, then 4, 0, 1, 3
LOGITS = [math.log(p) for p in (0.15, 0.10, 0.40, 0.05, 0.30)]


def req(rid="r", output=(), bad_words_token_ids=None, **params) -> Request:
    sp = SamplingParams(bad_words_token_ids=bad_words_token_ids, **params)
    return Request(rid, [1], sp, eos_token_id=None, output_token_ids=list(output))


def sample(*requests: Request, seed: int = 0):
    rows = torch.tensor([LOGITS] * len(requests), dtype=torch.float32)
    return Sampler(seed=seed)(rows, list(requests))


def test_logit_bias_moves_the_argmax_and_leaves_logprobs_raw():
    # ln .05 + 2 = -0.996 > ln .40 = -0.916? no: -2.996 + 2 = -0.996 < -0.916, token 2 stays
    out = sample(req(temperature=0, logit_bias={3: 2.0}, logprobs=0))
    assert out.token_ids == [2]
    # + 2.1: -0.896 > -0.916, token 3 wins; its logprob is still the raw ln .05
    out = sample(req(temperature=0, logit_bias={"3": 2.1}, logprobs=0))
    assert out.token_ids == [3]
    assert out.logprobs[0].logprob == pytest.approx(math.log(0.05), abs=1e-5)
    assert sample(req(temperature=0, logit_bias={2: -100})).token_ids == [4]


def test_allowed_token_ids_restrict_sampling():
    rows = [req(f"r{i}", allowed_token_ids=[1, 3]) for i in range(200)]
    tokens = set(sample(*rows).token_ids)
    assert tokens == {1, 3}  # P(only one of them in 200 draws) = (2/3)^200 + (1/3)^200


def test_bad_words_ban_the_last_token_after_the_prefix():
    # a one-token bad word is always banned; [0, 2] only right after a 0
    ban_2_after_0 = [[0, 2]]
    assert sample(req(temperature=0, output=[1], bad_words_token_ids=ban_2_after_0)).token_ids == [2]
    assert sample(req(temperature=0, output=[0], bad_words_token_ids=ban_2_after_0)).token_ids == [4]
    assert sample(req(temperature=0, bad_words_token_ids=[[2], [4]])).token_ids == [0]


def test_logits_processor_sees_output_tokens_and_rewrites_logits():
    seen = []

    def prefer_last_output(output_token_ids, logits):
        seen.append(list(output_token_ids))
        logits = logits.clone()
        logits[output_token_ids[-1]] += 10
        return logits

    out = sample(req(temperature=0, output=[4, 1], logits_processors=[prefer_last_output]))
    assert out.token_ids == [1] and seen == [[4, 1]] and out.failed == {}


def test_three_argument_logits_processor_gets_the_prompt_too():
    """vLLM calls a per-request processor with three parameters as (prompt_token_ids,
    output_token_ids, logits); two-parameter ones keep (output_token_ids, logits)."""
    seen = []

    def prefer_prompt_token(prompt_token_ids, output_token_ids, logits):
        seen.append((list(prompt_token_ids), list(output_token_ids)))
        logits = logits.clone()
        logits[prompt_token_ids[0]] += 10  # token 3 (.05) becomes the argmax
        return logits

    def two_args(output_token_ids, logits):
        seen.append(list(output_token_ids))
        return logits

    r = Request("r", [3, 1], SamplingParams(temperature=0, logits_processors=[
        prefer_prompt_token, two_args]), eos_token_id=None, output_token_ids=[4])
    out = sample(r)
    assert out.failed == {} and out.token_ids == [3]
    assert seen == [([3, 1], [4]), [4]]


def boom(output_token_ids, logits):
    raise RuntimeError("injected fault")


@pytest.mark.parametrize(
    "faulty, expected",
    [
        ({"logits_processors": [boom]}, "RuntimeError: injected fault"),
        ({"logits_processors": [lambda ids, x: x[:2]]}, "TypeError: logits processor"),
        ({"logits_processors": [lambda ids, x: x * float("nan")]}, "ValueError: no token"),
        ({"allowed_token_ids": [1], "bad_words_token_ids": [[1]]}, "ValueError: no token"),
        ({"logit_bias": {99: 1.0}}, "ValueError: request 'bad': logit_bias"),
    ],
)
def test_a_faulty_request_fails_alone(faulty, expected):
    healthy = [req(f"ok{i}", seed=100 + i, logprobs=2) for i in range(3)]
    healthy.insert(1, req("greedy", temperature=0))
    alone = sample(*healthy, seed=7)
    mixed = sample(healthy[0], req("bad", seed=5, **faulty), *healthy[1:], seed=7)
    assert list(mixed.failed) == ["bad"] and mixed.failed["bad"].startswith(expected)
    assert mixed.token_ids[1] == -1 and mixed.logprobs[1] is None
    assert mixed.token_ids[:1] + mixed.token_ids[2:] == alone.token_ids
    assert mixed.logprobs[:1] + mixed.logprobs[2:] == alone.logprobs


def test_seeded_generator_fault_fails_its_row_only(monkeypatch):
    sampler = Sampler(seed=0)
    real = sampler._request_generator

    def generator(request, device):
        if request.request_id == "bad":
            raise OverflowError("seed out of range")
        return real(request, device)

    monkeypatch.setattr(sampler, "_request_generator", generator)
    rows = torch.tensor([LOGITS] * 2, dtype=torch.float32)
    out = sampler(rows, [req("bad", seed=1), req("ok", seed=1)])
    assert out.failed == {"bad": "OverflowError: seed out of range"}
    assert out.token_ids[0] == -1
    assert out.token_ids[1] == sample(req("ok", seed=1)).token_ids[0]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"temperature": float("nan")}, "temperature must be a finite number"),
        ({"top_p": float("inf")}, "top_p must be a finite number"),
        ({"seed": 2**63}, "seed must be an integer in [-9223372036854775808, 9223372036854775807]"),
        ({"n": True}, "n must be an integer, got True"),
        ({"max_tokens": 1.5}, "max_tokens must be an integer, got 1.5"),
        ({"logit_bias": {1: 100.5}}, "logit_bias values must be numbers in [-100, 100]"),
        ({"logit_bias": {"x": 1}}, "logit_bias keys must be token ids"),
        ({"allowed_token_ids": []}, "allowed_token_ids must be a non-empty list"),
        ({"bad_words": [" "]}, "bad_words must be a list of non-blank strings"),
        ({"logits_processors": [3]}, "logits_processors must be a list of callables"),
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens must be an integer >= 1, or -1"),
        ({"prompt_logprobs": -2}, "prompt_logprobs must be an integer >= 0"),
    ],
)
def test_new_fields_are_validated(kwargs, message):
    with pytest.raises(ValueError) as err:
        SamplingParams(**kwargs)
    assert str(err.value).startswith(message)


def test_repr_names_callables_without_addresses():
    def my_processor(ids, logits):
        return logits

    sp = SamplingParams(logits_processors=[my_processor], logit_bias={"7": 1})
    assert repr(sp) == (
        "SamplingParams(logit_bias={7: 1}, logits_processors="
        "[test_repr_names_callables_without_addresses.<locals>.my_processor])"
    )
