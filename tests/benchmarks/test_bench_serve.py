"""``workbench bench serve`` against our own server on 127.0.0.1 (uvicorn in a thread), tiny workload."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest

from workbench import LLMEngine
from workbench.benchmarks.serve import (RequestResult, arrival_gaps, main, parse_goodput,
                                   summarize)
from workbench.engine.async_llm import AsyncLLM
from workbench.entrypoints.openai.api_server import build_app


@pytest.fixture(scope="module")
def base_url():
    import uvicorn

    llm = AsyncLLM(LLMEngine(device="cpu", block_size=8, num_kv_blocks=128))
    app = build_app(llm, model_name="tiny")
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    server.should_exit = True
    thread.join(timeout=10)
    asyncio.run(llm.shutdown())


def test_bench_serve_measures_every_request(base_url, tmp_path, capsys):
    out = tmp_path / "serve.json"
    rc = main(["--base-url", base_url, "--num-prompts", "6", "--input-len-range", "4:12",
               "--output-len-range", "3:6", "--request-rate", "50", "--max-concurrency", "3",
               "--goodput", "ttft:60000", "--output-json", str(out), "--disable-tqdm"])
    assert rc == 0
    data = json.loads(out.read_text())
    summary = data["summary"]
    assert (summary["completed"], summary["failed"]) == (6, 0)
    assert summary["total_output_tokens"] == sum(r["output_len"] for r in data["requests"])
    assert all(3 <= r["output_len"] <= 6 for r in data["requests"])
    assert summary["good_requests"] == 6 and summary["request_goodput"] > 0
    for name in ("ttft", "tpot", "itl", "e2el"):
        assert summary[f"p50_{name}_ms"] <= summary[f"p90_{name}_ms"] <= summary[f"p99_{name}_ms"]
    assert all(0 < r["ttft"] <= r["e2el"] for r in data["requests"])
    printed = capsys.readouterr().out
    assert "TTFT" in printed and "output throughput" in printed


def test_bench_serve_exact_lengths_match_the_workload(base_url, tmp_path):
    out = tmp_path / "serve.json"
    args = ["--num-prompts", "4", "--input-len-range", "5:9", "--output-len-range", "2:7", "--seed", "3"]
    assert main(["--base-url", base_url, *args, "--output-json", str(out), "--disable-tqdm"]) == 0
    from transformers import AutoTokenizer

    from workbench import default_model_path
    from workbench.benchmarks.datasets import sample_requests

    tok = AutoTokenizer.from_pretrained(str(default_model_path()))
    expected = sample_requests(4, (5, 9), (2, 7), len(tok), set(tok.all_special_ids), 3)
    got = json.loads(out.read_text())["requests"]
    assert [(r["prompt_len"], r["output_len"]) for r in got] == [
        (len(e.prompt_token_ids), e.output_len) for e in expected]


def test_unreachable_server_and_bad_options_are_named(capsys):
    assert main(["--base-url", "http://127.0.0.1:9", "--num-prompts", "1"]) == 1
    assert "cannot list the models" in capsys.readouterr().err
    assert main(["--goodput", "latency:5"]) == 2
    assert "--goodput metric must be one of" in capsys.readouterr().err
    assert main(["--request-rate", "0"]) == 2
    assert "--request-rate must be > 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--input-len-range", "9:3"])


def test_arrivals_and_summary_by_hand():
    assert arrival_gaps(3, float("inf"), "poisson", 0) == [0.0, 0.0, 0.0]
    assert arrival_gaps(2, 4.0, "fixed", 0) == [0.25, 0.25]
    gaps = arrival_gaps(4000, 10.0, "poisson", 1)
    assert abs(sum(gaps) / len(gaps) - 0.1) < 0.01  # exponential gaps of mean 1/rate
    assert parse_goodput(["ttft:500", "e2el:2000"]) == {"ttft": 0.5, "e2el": 2.0}
    results = [RequestResult(10, 5, ttft=0.1, e2el=0.5, itl=[0.1] * 4),
               RequestResult(20, 3, ttft=0.3, e2el=0.7, itl=[0.2, 0.2]),
               RequestResult(5, error="HTTP 400: bad")]
    s = summarize(results, 2.0, {"ttft": 0.2})
    assert (s["completed"], s["failed"], s["total_output_tokens"]) == (2, 1, 8)
    assert s["output_throughput"] == 4.0 and s["request_throughput"] == 1.0
    assert s["good_requests"] == 1 and s["request_goodput"] == 0.5
    assert s["mean_tpot_ms"] == pytest.approx(150.0)  # (0.4 / 4 + 0.4 / 2) / 2
    assert s["errors"] == ["HTTP 400: bad"]


def test_compare_multiprocessing_runs_one_workload_in_both_modes(tmp_path, capsys):
    out = tmp_path / "modes.json"
    rc = main(["--compare-multiprocessing", "--num-prompts", "3", "--input-len-range", "4:8",
               "--output-len-range", "3:5", "--disable-tqdm", "--device", "cpu",
               "--num-kv-blocks", "32", "--block-size", "8", "--output-json", str(out)])
    assert rc == 0
    table = capsys.readouterr().out
    assert "in process" in table and "core process" in table
    assert any(line.startswith("ITL mean (ms)") for line in table.splitlines())
    summaries = json.loads(out.read_text())
    inproc, mp = summaries["in process"], summaries["core process"]
    assert inproc["completed"] == mp["completed"] == 3 and inproc["failed"] == mp["failed"] == 0
    # the same workload: exactly the same tokens asked for and generated (ignore_eos)
    assert inproc["total_input_tokens"] == mp["total_input_tokens"]
    assert inproc["total_output_tokens"] == mp["total_output_tokens"]
