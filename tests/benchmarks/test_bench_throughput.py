"""``workbench bench throughput``: the workload generator, the table, bad input. A tiny run beside both
transformers paths is part of the selftest's CI run (tests/benchmarks/test_selftest.py)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import pytest

from workbench.benchmarks.throughput import ThroughputResult, format_spec_table, format_table, main
from workbench.benchmarks.datasets import parse_range, sample_requests


def test_workload_is_seeded_exact_and_avoids_special_ids():
    a = sample_requests(50, (3, 9), (2, 5), vocab_size=40, special_ids={0, 1, 2}, seed=7)
    assert a == sample_requests(50, (3, 9), (2, 5), vocab_size=40, special_ids={0, 1, 2}, seed=7)
    assert a != sample_requests(50, (3, 9), (2, 5), vocab_size=40, special_ids={0, 1, 2}, seed=8)
    assert {len(r.prompt_token_ids) for r in a} == set(range(3, 10))  # both ends drawn
    assert {r.output_len for r in a} == {2, 3, 4, 5}
    assert all(3 <= t < 40 for r in a for t in r.prompt_token_ids)
    assert repr(a[0]).startswith("BenchRequest(prompt_len=")


def test_ranges_parse_and_name_the_rule():
    assert parse_range("32:192") == (32, 192)
    assert parse_range("64") == (64, 64)
    for bad in ("0:4", "9:3", "a:b", "1:2:3"):
        with pytest.raises(argparse.ArgumentTypeError, match="1 <= A <= B|A <= B"):
            parse_range(bad)


def test_table_ratios_are_ours_over_theirs():
    rows = [ThroughputResult("workbench", 300, 1.0, 3), ThroughputResult("hf-generate", 300, 2.0, 3,
                                                                           {"batch_size": 2})]
    table = format_table(rows).splitlines()
    assert table[1].split()[:5] == ["workbench", "300.0", "3.00", "1.00", "1.00"]
    assert table[2].split()[:5] == ["hf-generate", "150.0", "1.50", "2.00", "2.00"]
    assert rows[1].to_dict()["output_tokens_per_s"] == 150.0


def test_requests_longer_than_the_model_are_refused(capsys):
    assert main(["--num-prompts", "2", "--input-len-range", "1000:1000",
                 "--output-len-range", "100:100"]) == 2
    assert "max_model_len" in capsys.readouterr().err


def test_lora_rows_name_their_adapters():
    from workbench.benchmarks.throughput import _adapter_rank, lora_specs
    from workbench.model.loader import embedded_lora_path

    specs = lora_specs(["errors", "mine=/some/dir"])
    assert specs == [("errors", str(embedded_lora_path("errors"))), ("mine", "/some/dir")]
    assert _adapter_rank(specs[0][1]) == 8  # data/loras/errors/adapter_config.json
    with pytest.raises(ValueError, match="No embedded LoRA adapter 'nope'"):
        lora_specs(["nope"])


def test_quote_prompts_repeat_the_start_of_their_passage():
    from workbench.benchmarks.datasets import QUOTE_TOKENS

    a = sample_requests(6, (40, 80), (8, 8), vocab_size=2048, seed=3, dataset="quote")
    assert a == sample_requests(6, (40, 80), (8, 8), vocab_size=2048, seed=3, dataset="quote")
    for r in a:
        ids = r.prompt_token_ids
        assert 40 <= len(ids) <= 80 and r.output_len == 8
        q = min(QUOTE_TOKENS, (len(ids) - 1) // 4)  # fewer in a short prompt
        assert ids[0] == 0 and ids[1:1 + q] == ids[-q:]  # after bos: the passage starts as the prompt ends
    with pytest.raises(ValueError, match="dataset must be one of"):
        sample_requests(1, (40, 80), (8, 8), vocab_size=2048, dataset="nope")


def test_spec_table_by_hand_names_where_speculation_stops_paying():
    def pair(batch, off_s, on_s):
        off = ThroughputResult("workbench", 100, off_s, 2, {"num_steps": 100, "cpu_s": off_s})
        on = ThroughputResult("workbench-spec", 100, on_s, 2, {"num_steps": 60, "cpu_s": on_s,
                                                               "spec_acceptance_rate": 0.4,
                                                               "spec_mean_acceptance_length": 2.2})
        return batch, off, on

    lines = format_spec_table([pair(1, 2.0, 1.0), pair(4, 1.0, 0.8), pair(16, 0.5, 0.625)]).splitlines()
    assert lines[1].split() == ["1", "50.0", "100.0", "2.00x", "2.00x", "40.0%", "2.20", "100", "60"]
    assert lines[3].split()[3] == "0.80x"
    assert lines[-1] == "speculation stops paying at batch 16"
    assert format_spec_table([pair(1, 2.0, 1.0)]).splitlines()[-1] == \
        "speculation paid at every batch size measured (up to 1)"


def test_spec_table_shows_the_range_of_the_alternated_rounds():
    off = ThroughputResult("workbench", 100, 2.0, 2, {"num_steps": 100, "cpu_s": 2.0})
    on = ThroughputResult("workbench-spec", 100, 1.25, 2, {"num_steps": 60, "cpu_s": 1.0,
                                                           "spec_acceptance_rate": 0.4,
                                                           "spec_mean_acceptance_length": 2.2})
    lines = format_spec_table([(1, off, on)], [[1.5, 1.7, 1.45]]).splitlines()
    assert lines[0].split()[:5] == ["batch", "off", "tok/s", "on", "tok/s"] and "rounds" in lines[0]
    assert lines[1].split() == ["1", "50.0", "80.0", "1.60x", "1.45-1.70x", "2.00x", "40.0%", "2.20",
                                "100", "60"]


def test_spec_pair_alternates_both_engines_in_one_process_and_reports_medians():
    """``_run_spec_pair`` on a tiny workload, in this process: the passes alternate (off, on,
    on, off, off, on), each side's result is its median pass, and greedy tokens agree."""
    from workbench.benchmarks import throughput
    from workbench.benchmarks.throughput import DEFAULT_SPEC_CONFIG, _run_spec_pair

    order, real = [], throughput._timed_pass

    def timed(llm, prompts, params, requests):
        out = real(llm, prompts, params, requests)
        order.append("on" if llm.engine.proposer is not None else "off")
        return out

    requests = sample_requests(2, (40, 48), (6, 6), vocab_size=4096, seed=1, dataset="quote")
    base = {"model": None, "load_format": "auto", "dtype": "auto", "device": "cpu", "threads": None,
            "engine_kwargs": {"max_num_seqs": 1, "max_history": 10_000}}
    on_spec = {**base, "engine_kwargs": {**base["engine_kwargs"], "speculative_config": DEFAULT_SPEC_CONFIG}}
    throughput._timed_pass = timed
    try:
        off, on, rounds = _run_spec_pair(base, on_spec, requests, 3)
    finally:
        throughput._timed_pass = real
    assert order == ["off", "on", "on", "off", "off", "on"]
    assert off.engine == "workbench" and on.engine == "workbench-spec" and len(rounds) == 3
    for r in (off, on):
        assert r.details["repeats"] == 3 and r.output_tokens == 12
        assert r.total_s == pytest.approx(sorted(r.details["runs_s"])[1], abs=1e-4)
    assert rounds == pytest.approx([a / b for a, b in zip(off.details["runs_s"], on.details["runs_s"])],
                                   rel=1e-2)
    from workbench.kernels import cpu_linear, ops  # the header names the CPU paths taken

    assert off.details["linear"] == on.details["linear"] == cpu_linear.describe()
    assert off.details["linear"].startswith("the few-rows kernel" if cpu_linear.few_rows_pays()
                                            else "oneDNN" if cpu_linear.onednn_pays() else "F.linear")
    assert off.details["cpu_ops"] == on.details["cpu_ops"] == ops.describe_cpu()
    assert off.details["cpu_ops"].startswith("numba RMSNorm")  # numba is a dependency


def _stat(pid: int) -> list[str] | None:
    """The fields of ``/proc/PID/stat`` after the command name (state first, then the
    parent's pid), or None where no such process is left."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None


def _alive(pid: int) -> bool:
    fields = _stat(pid)
    return fields is not None and fields[0] != "Z"


def _children(pid: int) -> set[int]:
    """Pids of the live processes whose parent is ``pid``."""
    return {int(e) for e in os.listdir("/proc") if e.isdigit() and _alive(int(e))
            and (_stat(int(e)) or ["", "0"])[1] == str(pid)}


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")
def test_a_benchmark_child_ends_when_its_parent_is_killed():
    """A killed benchmark leaves no engine process behind (it once held 470 MB for an hour)."""
    parent = subprocess.Popen([sys.executable, "-c", (
        "import time; from workbench.benchmarks.throughput import _in_own_process; "
        "_in_own_process(time.sleep, 120)")])
    try:
        deadline = time.monotonic() + 60
        while not _children(parent.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        children = _children(parent.pid)
        assert children, "the benchmark child did not start"
        time.sleep(3)  # the child has imported the benchmark and started its watch
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 30
    while any(_alive(pid) for pid in children) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [pid for pid in children if _alive(pid)]

