"""SamplingParams: vLLM's defaults, and every bad value rejected with the field named."""

import pytest

from workbench import SamplingParams


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.max_tokens, p.min_tokens, p.seed, p.logprobs) == (16, 0, None, None)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert p.stop_strings == () and p.stop_token_ids == []
    assert p.skip_special_tokens and not p.ignore_eos and not p.include_stop_str_in_output
    assert repr(p) == "SamplingParams()"


@pytest.mark.parametrize(
    "field, value, limit",
    [
        ("n", 0, ">= 1"),
        ("temperature", -0.5, "non-negative"),
        ("top_p", 0.0, "(0, 1]"),
        ("top_p", 1.5, "(0, 1]"),
        ("top_k", -2, ">= 0"),
        ("min_p", 1.5, "[0, 1]"),
        ("max_tokens", 0, ">= 1"),
        ("min_tokens", -1, ">= 0"),
        ("presence_penalty", 2.5, "[-2, 2]"),
        ("frequency_penalty", -3.0, "[-2, 2]"),
        ("repetition_penalty", 0.0, "(0, 2]"),
        ("logprobs", -2, ">= 0"),
        ("stop_token_ids", [-5], "non-negative"),
        ("seed", 1.5, "integer"),
    ],
)
def test_bad_values_name_field_value_and_range(field, value, limit):
    with pytest.raises(ValueError) as err:
        SamplingParams(**{field: value})
    message = str(err.value)
    assert message.startswith(field) and repr(value) in message and limit in message


def test_min_tokens_above_max_tokens_is_rejected():
    with pytest.raises(ValueError, match="min_tokens must be <= max_tokens=4, got 5"):
        SamplingParams(min_tokens=5, max_tokens=4)


def test_stop_normalised_and_greedy_flag():
    assert SamplingParams(stop="\n").stop_strings == ("\n",)
    assert SamplingParams(stop=["a", "bc"]).stop_strings == ("a", "bc")
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(temperature=0).greedy and not SamplingParams(temperature=0.7).greedy
    with pytest.raises(ValueError, match="stop"):
        SamplingParams(stop=[""])
