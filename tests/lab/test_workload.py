"""Workload: reproducible generators, exact prompt and output lengths, JSON round trip."""

import math

import numpy as np
import pytest
from transformers import AutoTokenizer

from workbench import SamplingParams, Workload, WorkloadRequest
from workbench.model.loader import default_model_path


@pytest.fixture(scope="module")
def tok():
    """The engine's own tokenizer: the lengths must be the ones the engine will count."""
    return AutoTokenizer.from_pretrained(str(default_model_path()))


def test_poisson_is_reproducible_and_exact(tok):
    w = Workload.poisson(num_requests=12, rate=4.0, input_len=(8, 40), output_len=(4, 16), seed=1)
    assert w == Workload.poisson(num_requests=12, rate=4.0, input_len=(8, 40), output_len=(4, 16), seed=1)
    assert w != Workload.poisson(seed=2)
    assert len(w) == 12 and len(set(w.request_ids)) == 12
    times = [r.arrival_time for r in w]
    assert times[0] == 0.0 and times == sorted(times)
    assert all(r.arrival_step == math.floor(r.arrival_time) for r in w)
    # 11 exponential gaps of mean 1/rate: the span is of the order of 11/4 units.
    assert 0.5 < times[-1] < 8
    for r in w:
        assert isinstance(r.prompt, str)
        assert 8 <= len(tok(r.prompt).input_ids) <= 40
        assert 4 <= r.params.max_tokens <= 16 and r.params.ignore_eos and r.params.temperature == 0.0


def test_explicit_lengths_are_exact_in_tokens(tok):
    lengths = [5, 9, 17, 33, 64]
    w = Workload.poisson(num_requests=5, input_len=lengths, output_len=[1, 2, 3, 4, 5], seed=7)
    assert [len(tok(r.prompt).input_ids) for r in w] == lengths
    assert [r.params.max_tokens for r in w] == [1, 2, 3, 4, 5]
    ids = Workload.poisson(num_requests=5, input_len=lengths, seed=7, text=False)
    assert [len(r.prompt) for r in ids] == lengths
    assert all(r.prompt[0] == tok.bos_token_id for r in ids)


def test_length_distribution_callable_draws_from_the_seed(tok):
    def lognormal(rng, n):
        return np.clip(rng.lognormal(3.0, 0.5, n), 4, 60).astype(int)

    w = Workload.poisson(num_requests=6, input_len=lognormal, seed=11)
    assert w == Workload.poisson(num_requests=6, input_len=lognormal, seed=11)
    lengths = [len(tok(r.prompt).input_ids) for r in w]
    assert all(4 <= x <= 60 for x in lengths) and len(set(lengths)) > 1
    with pytest.raises(ValueError, match="input_len lists 2 lengths for 6 requests"):
        Workload.poisson(num_requests=6, input_len=lambda rng, n: [5, 6])


def test_shared_prefix_groups_share_their_tokens(tok):
    w = Workload.burst(num_requests=6, num_prefix_groups=2, prefix_len=12, input_len=(14, 30), seed=3)
    enc = [tok(r.prompt).input_ids for r in w]
    for i in range(6):
        assert enc[i][:12] == enc[i % 2][:12]
        assert 14 <= len(enc[i]) <= 30
    assert enc[0][:12] != enc[1][:12]
    assert enc[0][12:] != enc[2][12:]  # the rest differs


def test_bursts_and_priorities():
    w = Workload.burst(num_requests=6, num_bursts=3, interval=10, priorities=(0, 5), seed=2)
    assert [r.arrival_step for r in w] == [0, 0, 10, 10, 20, 20]
    assert {r.priority for r in w} == {0, 5}


def test_a_workload_says_which_clock_its_arrivals_are_on():
    params = SamplingParams(max_tokens=2)
    timed = [WorkloadRequest("a", "x", params, arrival_time=0.5), WorkloadRequest("b", "y", params)]
    stepped = [WorkloadRequest("c", "x", params, arrival_step=3)]
    assert Workload(timed).clock == "wall" and Workload(stepped).clock == "steps"
    assert Workload([WorkloadRequest("d", "x", params)]).clock == "steps"  # the default
    assert Workload.burst(4, num_bursts=2, interval=2.5, clock="wall").clock == "wall"
    with pytest.raises(ValueError, match="'c' has arrival_step but no arrival_time, and this workload's arrivals "
                                         "are on the wall clock"):
        Workload([*timed, *stepped])
    with pytest.raises(ValueError, match="'a' has arrival_time but no arrival_step.*clock='wall'"):
        Workload(timed, clock="steps")
    with pytest.raises(ValueError, match="clock must be one of"):
        Workload.poisson(2, clock="seconds")
    # on_clock reads the same numbers in the other unit, by name
    w = Workload.poisson(6, rate=2.0, seed=4)
    moved = w.on_clock("wall")
    assert moved.clock == "wall" and moved.info["clock"] == "wall" and moved.requests == w.requests
    assert moved != w and moved == Workload.poisson(6, rate=2.0, seed=4, clock="wall")
    with pytest.raises(ValueError, match="has arrival_time but no arrival_step"):
        Workload(timed).on_clock("steps")


def test_json_round_trip(tmp_path):
    w = Workload.burst(num_requests=3, params=SamplingParams(temperature=0.7, seed=3, stop=["\n\n"]), seed=4)
    w = Workload([*w, WorkloadRequest("ids", (0, 5, 6), SamplingParams(max_tokens=2), arrival_step=4, priority=-1)], w.info)
    path = tmp_path / "w.json"
    w.save(path)
    back = Workload.load(path)
    assert back == w and back[0].params.temperature == 0.7 and back[-1].prompt == (0, 5, 6)
    assert back.info["generator"] == "burst"
    assert repr(back) == repr(w) and "4 requests" in repr(w)
    timed = Workload.poisson(3, clock="wall")
    timed.save(path)
    assert Workload.load(path).clock == "wall" and Workload.load(path) == timed


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(rate=0), "rate must be a finite number > 0"),
        (dict(num_requests=0), "num_requests must be an integer >= 1"),
        (dict(input_len=(10, 5)), "input_len high must be an integer >= 10"),
        (dict(output_len=[1, 2]), "output_len lists 2 lengths for 12 requests"),
        (dict(num_prefix_groups=2, prefix_len=16, input_len=(8, 40)), "longer than prefix_len=16"),
        (dict(input_len=1), "input_len 1 is too short"),
    ],
)
def test_bad_arguments_name_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Workload.poisson(**kwargs)


def test_requests_are_validated():
    with pytest.raises(ValueError, match="arrival_step must be an integer >= 0"):
        WorkloadRequest("a", "x", SamplingParams(), arrival_step=-1)
    with pytest.raises(ValueError, match="appears twice"):
        Workload([WorkloadRequest("a", "x", SamplingParams())] * 2)
    with pytest.raises(ValueError, match="prompt must be non-empty"):
        WorkloadRequest("a", "", SamplingParams())
    with pytest.raises(ValueError, match="prompt token ids must be integers"):
        WorkloadRequest("a", [1, "x"], SamplingParams())
    assert WorkloadRequest("a", [np.int64(3), 4], SamplingParams()).prompt == (3, 4)
