"""Workload.from_trace: the four trace formats, window / count / rate options, length fitting,
Mooncake blocks as real shared prefixes, and the shipped excerpts."""

import json
import math
import pathlib

import pytest
from transformers import AutoTokenizer

from workbench import Workload
from workbench.lab import traces
from workbench.lab.sim import simulate
from workbench.model.loader import default_model_path

DATA = pathlib.Path(__file__).resolve().parents[2] / "data" / "traces"


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(str(default_model_path()))


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return path


AZURE = """TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:15:46.6805900,374,44
2023-11-16 18:15:50.9951690,396,109
2023-11-16 18:15:51.2224670,0,55
2023-11-16 18:16:01.0000000,91,16
"""


def test_azure_arrivals_and_lengths_are_the_traces(tmp_path):
    w = Workload.from_trace(write(tmp_path, "a.csv", AZURE))
    assert w.clock == "wall" and w.info["format"] == "azure"
    assert len(w) == 3  # the row with 0 context tokens is not a request
    # Seconds from the first request, to the 100 ns tick: 50.9951690 - 46.6805900, 61.0 - 46.68059.
    assert [r.arrival_time for r in w] == pytest.approx([0.0, 4.314579, 14.31941], abs=1e-6)
    assert [r.arrival_step for r in w] == [0, 4, 14]
    assert [len(r.prompt) for r in w] == [374, 396, 91]
    assert [r.params.max_tokens for r in w] == [44, 109, 16]
    assert all(r.params.ignore_eos for r in w)
    assert "lengths unchanged" in repr(w)


def test_window_count_and_rate_options(tmp_path):
    path = write(tmp_path, "a.csv", AZURE)
    w = Workload.from_trace(path, window=(4.0, 20.0))
    assert [r.arrival_time for r in w] == pytest.approx([0.0, 14.31941 - 4.314579], abs=1e-6)
    assert len(Workload.from_trace(path, max_requests=2)) == 2
    fast = Workload.from_trace(path, rate_scale=2.0)
    assert [r.arrival_time for r in fast] == pytest.approx([0.0, 4.314579 / 2, 14.31941 / 2], abs=1e-6)
    at = Workload.from_trace(path, rate=1.0)
    assert at.rate == pytest.approx(1.0) and at[-1].arrival_time == pytest.approx(2.0)
    with pytest.raises(ValueError, match="no request of the trace arrives"):
        Workload.from_trace(path, window=(100.0, 200.0))
    with pytest.raises(ValueError, match="rate_scale or rate"):
        Workload.from_trace(path, rate=1.0, rate_scale=2.0)


def test_fitting_lengths_to_the_context_is_stated(tmp_path):
    path = write(tmp_path, "a.csv", AZURE)
    # The longest request is 396 + 109 = 505 tokens: scaled by 200 / 505.
    w = Workload.from_trace(path, max_model_len=200, fit="scale")
    s = 200 / 505
    assert [len(r.prompt) for r in w] == [math.floor(374 * s), math.floor(396 * s), math.floor(91 * s)]
    assert [r.params.max_tokens for r in w] == [math.floor(44 * s), math.floor(109 * s), math.floor(16 * s)]
    assert all(len(r.prompt) + r.params.max_tokens <= 200 for r in w)
    assert "scaled x0.396" in w.info["fit"] and "3 of 3 requests changed" in repr(w)
    c = Workload.from_trace(path, max_model_len=200, fit="clip")
    assert [(len(r.prompt), r.params.max_tokens) for r in c] == [(156, 44), (100, 100), (91, 16)]
    assert "2 of 3 requests changed" in c.info["fit"]
    d = Workload.from_trace(path, max_model_len=200, fit="drop")
    assert [len(r.prompt) for r in d] == [91] and "2 of 3 requests left out" in d.info["fit"]
    with pytest.raises(ValueError, match="trace request 0: prompt 374 \\+ output 44 tokens does not fit max_model_len 200"):
        Workload.from_trace(path, max_model_len=200, fit=None)


def test_burstgpt_leaves_out_failed_requests(tmp_path):
    path = write(tmp_path, "b.csv", "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
                 "5,ChatGPT,472,18,490,Conversation log\n7,ChatGPT,100,0,100,API log\n"
                 "45,GPT-4,417,276,693,Conversation log\n")
    w = Workload.from_trace(path)
    assert w.info["format"] == "burstgpt"
    assert [(r.arrival_time, len(r.prompt), r.params.max_tokens) for r in w] == [(0.0, 472, 18), (40.0, 417, 276)]


def test_mooncake_hash_ids_become_shared_prefixes(tmp_path, tok):
    rows = [{"timestamp": 0, "input_length": 1100, "output_length": 5, "hash_ids": [0, 1, 2]},
            {"timestamp": 500, "input_length": 700, "output_length": 3, "hash_ids": [0, 1]},
            {"timestamp": 1500, "input_length": 600, "output_length": 4, "hash_ids": [0, 3]}]
    path = write(tmp_path, "m.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
    w = Workload.from_trace(path, max_model_len=2048)
    assert [r.arrival_time for r in w] == [0.0, 0.5, 1.5]
    a, b, c = (r.prompt for r in w)
    assert [len(a), len(b), len(c)] == [1100, 700, 600]
    assert a[0] == b[0] == c[0] == tok.bos_token_id
    # bos + block 0 (512) + block 1 (512): requests 0 and 1 share their first 1 + 700 - 1 tokens...
    assert a[:700] == b
    # ... request 2 shares bos + block 0 only: it differs right after it.
    assert a[:513] == c[:513] and a[513:600] != c[513:600]
    # Scaled to a 256-token context, a block is round(512 * 256 / 1105) = 119 tokens, still shared.
    s = Workload.from_trace(path, max_model_len=256)
    a, b, c = (r.prompt for r in s)
    assert "119-token shared prompt blocks" in s.info["fit"]
    assert a[:120] == c[:120] and a[120:125] != c[120:125] and a[: len(b)] == b


def test_sharegpt_prompts_are_the_conversation_text(tmp_path, tok):
    convs = [{"id": "x", "conversations": [{"from": "human", "value": "ROMEO: What light?"},
                                           {"from": "gpt", "value": "It is the east."}]},
             {"id": "y", "conversations": [{"from": "gpt", "value": "alone"}]}]
    path = write(tmp_path, "s.json", json.dumps(convs))
    with pytest.raises(ValueError, match="no arrival times: give rate="):
        Workload.from_trace(path)
    w = Workload.from_trace(path, rate=2.0, text=True)
    assert len(w) == 1 and w[0].prompt == "ROMEO: What light?"
    assert w[0].params.max_tokens == len(tok("It is the east.", add_special_tokens=False).input_ids)
    ids = Workload.from_trace(path, rate=2.0)
    assert list(ids[0].prompt) == tok("ROMEO: What light?").input_ids


def test_at_rate_rescales_any_workload():
    w = Workload.poisson(20, rate=3.0, seed=4, clock="wall")
    fast = w.at_rate(12.0)
    assert fast.rate == pytest.approx(12.0)
    assert [r.arrival_time for r in fast] == pytest.approx([r.arrival_time * w.rate / 12.0 for r in w])
    assert all(r.arrival_step == math.floor(r.arrival_time) for r in fast)
    with pytest.raises(ValueError, match="rate must be a finite number > 0"):
        w.at_rate(0)


@pytest.mark.parametrize("name", sorted(traces.SHIPPED))
def test_every_shipped_excerpt_loads_and_is_described(name):
    readme = (DATA / "README.md").read_text()
    assert traces.SHIPPED[name] in readme and f"`{name}`" in readme
    rate = 2.0 if name.startswith("sharegpt") else None
    w = Workload.from_trace(name, max_requests=40, rate=rate)
    assert len(w) == 40 and w.clock == "wall"
    assert all(len(r.prompt) + r.params.max_tokens <= 1024 for r in w)
    if "synthetic" in name:
        assert "SYNTHETIC" in readme.split(traces.SHIPPED[name])[1].split("\n")[0]


def test_a_shipped_trace_replays_simulated_on_both_clocks():
    w = Workload.from_trace("mooncake_conversation", max_requests=30, fit="clip")
    wall = simulate(w, {"block_size": 16, "num_kv_blocks": 512, "max_num_seqs": 8})
    assert wall.summary()["num_finished"] == 30 and wall.clock == "wall"
    assert wall.summary()["prefix_hit_rate"] > 0.3  # block 0 (512 tokens) is every request's prefix
    steps = simulate(w.on_clock("steps"), {"block_size": 16, "num_kv_blocks": 512, "max_num_seqs": 8})
    assert steps.summary()["num_finished"] == 30
