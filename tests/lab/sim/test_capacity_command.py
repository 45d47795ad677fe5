"""`workbench simulate capacity` on a shipped trace, one capacity per --grid configuration."""

import pytest

from workbench.config import EngineConfig
from workbench.entrypoints.cli import main
from workbench.lab.capacity import capacity
from workbench.lab.workload import Workload


def test_capacity_command_prints_each_configs_capacity(capsys):
    args = ["simulate", "capacity", "--trace", "azure_conv", "--max-requests", "30", "--slo", "ttft_s_p99=0.05",
            "--grid", "max_num_seqs=2,8", "--num-kv-blocks", "128", "--rel-tol", "0.1"]
    assert main(args) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("Workload(30 requests") and "trace azure_conv (azure)" in lines[0]
    assert lines[1].split() == ["max_num_seqs", "capacity", "(sim)", "bounded", "rates_tried"]
    workload = Workload.from_trace("azure_conv", max_requests=30)
    for line, seqs in zip(lines[2:], (2, 8)):
        found = capacity(workload, EngineConfig(max_num_seqs=seqs, num_kv_blocks=128), {"ttft_s_p99": 0.05},
                         rel_tol=0.1, progress=False)
        cells = line.split()
        assert int(cells[0]) == seqs and float(cells[1]) == pytest.approx(found.rate, rel=1e-5)


@pytest.mark.parametrize("extra, message", [
    ([], "capacity needs --slo"),
    (["--slo", "ttft_s_p99"], "--slo: expected KEY=VALUE"),
    (["--slo", "ttft_p99=1"], "unknown metric 'ttft_p99'"),
])
def test_capacity_command_names_bad_flags(extra, message, capsys):
    assert main(["simulate", "capacity", "--trace", "azure_conv", "--max-requests", "5", *extra]) == 2
    assert message in capsys.readouterr().err
