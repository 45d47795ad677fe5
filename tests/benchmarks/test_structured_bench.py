"""``workbench bench throughput --structured-outputs``: both modes run the same requests, the
free one to its exact lengths, and each unique schema compiles once."""

from __future__ import annotations

from workbench.benchmarks.datasets import sample_requests
from workbench.benchmarks.structured import constraint, format_table, run_compare

SPEC = {"model": None, "load_format": "auto", "dtype": "auto", "device": "cpu", "threads": 1,
        "engine_kwargs": {}}


def test_unique_schemas_differ_and_each_holds_its_own_property():
    a, b = (constraint("json-unique", i) for i in (0, 1))
    assert a.json != b.json and "scene_0" in a.json["required"]
    assert constraint("json", 0) == constraint("json", 5)


def test_free_and_constrained_runs_report_the_same_workload():
    requests = sample_requests(3, (8, 12), (6, 10), 4096, {0, 1, 2}, seed=1)
    free, unique = run_compare(SPEC, requests, "json-unique", repeats=1)
    assert free["mode"] == "free" and unique["mode"] == "json-unique"
    assert free["requests"] == unique["requests"] == 3
    assert free["output_tokens"] == sum(r.output_len for r in requests)  # exact lengths
    assert 0 < unique["output_tokens"] <= free["output_tokens"]
    assert unique["grammars_compiled"] == 3 and free["grammars_compiled"] == 0
    assert unique["compile_mean_s"] > 0 and unique["mask_per_step_mean_s"] > 0
    assert free["mask_per_step_mean_s"] == 0
    table = format_table([free, unique])
    assert table.splitlines()[1].startswith("free") and "json-unique / free: TTFT mean x" in table
