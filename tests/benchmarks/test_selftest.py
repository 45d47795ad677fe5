"""``workbench selftest`` on the CPU with tiny shapes (what CI can run of the GPU check): every kernel
through the Triton interpreter (fp32) and the cpu backend, greedy parity with transformers, a tiny
``bench throughput --compare hf`` with dummy weights, and the import check without the extras."""

from __future__ import annotations

import json

import pytest

from workbench.benchmarks.datasets import sample_requests
from workbench.benchmarks.selftest import main


@pytest.mark.slow
def test_selftest_cpu_small(tmp_path):
    rc = main(["--device", "cpu", "--small", "--out", str(tmp_path), "--budget-s", "600"])
    report = json.loads((tmp_path / "selftest.json").read_text())
    failed = [r for r in report["checks"] if r["ok"] is False]
    assert rc == 0 and not failed, failed or report["steps"]
    status = {s["step"]: s["status"] for s in report["steps"]}
    assert status == {"env": "PASS", "kernels": "PASS", "parity": "PASS", "throughput": "PASS",
                      "bench-kernels": "SKIPPED"}
    names = [r["name"] for r in report["checks"]]
    assert "engine and kernels import without fastapi, uvicorn, ipywidgets" in names
    for backend in ("triton", "cpu"):
        for kind in ("decode", "mixed", "prefill", "spec_decode"):
            assert f"paged_attention {kind} window=48 [qwen3-like float32 {backend}]" in names
    assert sum("greedy parity" in n for n in names) == 2
    tput = {r["name"].split(": ")[1]: r for r in report["checks"] if r["step"] == "throughput"}
    assert set(tput) == {"workbench", "hf-generate", "hf-generate_batch"}
    expected = sum(r.output_len for r in sample_requests(4, (4, 12), (2, 6), 4096, {0, 1, 2}, 0))
    assert {r["output_tokens"] for r in tput.values()} == {expected}
    assert "| throughput | PASS |" in (tmp_path / "selftest.md").read_text()


def test_selftest_rejects_unknown_steps(tmp_path, capsys):
    assert main(["--device", "cpu", "--out", str(tmp_path), "--steps", "env,warp"]) == 2
    assert "unknown step(s) ['warp']" in capsys.readouterr().err
