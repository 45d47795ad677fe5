"""`workbench calibrate` and `workbench simulate` from the command line."""

import json

from workbench.entrypoints.cli import main
from workbench.lab.sim import CostModel


def test_calibrate_tiny_grid_saves_a_described_model(tmp_path, capsys):
    out = tmp_path / "cm.json"
    assert main(["calibrate", "--grid", "tiny", "--quiet", "--max-num-seqs", "8", "--output", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "decode_context" in printed and "r2=" in printed and f"saved to {out}" in printed
    model = CostModel.load(out)
    data = json.loads(out.read_text())
    assert data["model"]["name"] == "tiny-shakespeare" and data["model"]["num_layers"] == 4
    assert data["hardware"]["device"] == "cpu" and data["hardware"]["threads"] >= 1
    assert model.fit_stats["num_steps"] >= 10
    # a nonnegative fit that predicts some time (which coefficient carries it is the machine's load)
    assert min(model.coefficients.values()) >= 0 and sum(model.coefficients.values()) > 0


def test_calibrate_rejects_bad_repeats(capsys):
    assert main(["calibrate", "--grid", "tiny", "--repeats", "0", "--quiet"]) == 2
    assert "--repeats must be >= 1" in capsys.readouterr().err


def test_simulate_prints_the_run_and_its_speed(tmp_path, capsys):
    path = CostModel({"step": 0.01, "decode_seqs": 1e-4}).save(tmp_path / "cm.json")
    assert main(["simulate", "--num-requests", "30", "--rate", "20", "--token-ids", "--cost-model", str(path),
                 "--max-num-seqs", "8"]) == 0
    printed = capsys.readouterr().out
    assert "RunResult(30 requests, 30 finished" in printed and "simulated" in printed
    assert "ttft_s_p50" in printed and "requests/s" in printed


def test_simulate_runs_a_workload_file_on_its_own_clock(tmp_path, capsys):
    from workbench.lab.workload import Workload

    path = CostModel({"step": 0.01}).save(tmp_path / "cm.json")
    Workload.poisson(4, rate=2.0, output_len=2, text=False, seed=1).save(tmp_path / "w.json")  # step clock
    assert main(["simulate", "--workload", str(tmp_path / "w.json"), "--cost-model", str(path)]) == 0
    assert "clock=steps" in capsys.readouterr().out
    assert main(["simulate", "--workload", str(tmp_path / "w.json"), "--cost-model", str(path),
                 "--clock", "wall"]) == 2
    assert "arrivals are on the steps clock" in capsys.readouterr().err


def test_simulate_names_a_missing_cost_model(tmp_path, capsys):
    assert main(["simulate", "--cost-model", str(tmp_path / "nope.json")]) == 2
    assert "nope.json" in capsys.readouterr().err


def test_simulate_accuracy_flags_are_checked_before_anything_runs(tmp_path, capsys):
    path = CostModel({"step": 0.01}).save(tmp_path / "cm.json")
    assert main(["simulate", "accuracy", "--calibrate", "--cost-model", str(path)]) == 2
    assert "--calibrate goes with `simulate accuracy` and without --cost-model" in capsys.readouterr().err
    assert main(["simulate", "--calibrate"]) == 2
    assert "--calibrate goes with" in capsys.readouterr().err
    assert main(["simulate", "accuracy", "--real-runs", "0", "--cost-model", str(path)]) == 2
    assert "--real-runs must be >= 1, got 0" in capsys.readouterr().err
    assert main(["simulate", "accuracy", "--threads", "0", "--cost-model", str(path)]) == 2
    assert "--threads must be >= 1, got 0" in capsys.readouterr().err
    assert main(["calibrate", "--grid", "tiny", "--threads", "0", "--quiet"]) == 2
    assert "--threads must be >= 1, got 0" in capsys.readouterr().err
