"""Workloads mixing LoRA adapters: their JSON round trip, and compare_runs / the simulator
over max_loras (the same scheduler: the cap holds, and a tighter cap skips requests)."""

from __future__ import annotations

import pytest

from workbench import LoRARequest, Workload, compare_runs, teaching_config
from workbench.lab.workload import WorkloadRequest

A, B = LoRARequest("errors", 1, "/a"), LoRARequest("timon", 2, "/b")


def test_with_lora_requests_cycles_and_round_trips(tmp_path):
    wl = Workload.poisson(num_requests=5, seed=3).with_lora_requests([None, A, B])
    assert [r.lora_request for r in wl] == [None, A, B, None, A]
    wl.save(tmp_path / "w.json")
    back = Workload.load(tmp_path / "w.json")
    assert back == wl and [r.lora_request.lora_path if r.lora_request else None for r in back] == \
        [None, "/a", "/b", None, "/a"]
    assert WorkloadRequest.from_json(wl.requests[0].to_json()).lora_request is None
    with pytest.raises(ValueError, match="at least one adapter"):
        wl.with_lora_requests([])


def test_compare_runs_over_max_loras_simulated():
    wl = Workload.poisson(num_requests=12, rate=4.0, seed=1).with_lora_requests([None, A, B])
    cmp = compare_runs(wl, {"one": {"max_loras": 1}, "two": {"max_loras": 2}},
                       base=teaching_config(enable_lora=True), simulate=True)
    for name, cap in (("one", 1), ("two", 2)):
        run = cmp.results[name]
        assert run.summary()["num_finished"] == 12
        assert all(len(r.scheduler_output.lora_names) <= cap for r in run.history)
    skipped = [sum(len(r.scheduler_output.lora_skipped_request_ids) for r in cmp.results[n].history)
               for n in ("one", "two")]
    assert skipped[0] > skipped[1] >= 0
    assert any(len(r.scheduler_output.lora_names) == 2 for r in cmp.results["two"].history)
