"""`workbench simulate --token-ids` on the SimulatedRunner imports no torch (nor triton): the
engine's device is a SimulatedDevice, and model/worker modules load torch only when a real
model runs. Run in a fresh interpreter, since this test process has torch loaded already."""

import json
import subprocess
import sys

HEAVY = ("torch", "triton")

SCRIPT = """
import json, sys
from workbench.entrypoints.cli import main
sys.argv = ["workbench", "simulate", "--num-requests", "40", "--rate", "200", "--token-ids",
            "--input-len", "8", "64", "--output-len", "4", "16", "--num-kv-blocks", "200",
            "--block-size", "16", "--max-num-seqs", "8"]
rc = main()
heavy = sorted({m.split(".")[0] for m in sys.modules} & set(%r))
print("RESULT", json.dumps({"rc": rc, "heavy": heavy}))
""" % (HEAVY,)


def test_simulate_with_token_ids_imports_no_torch():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")][-1]
    result = json.loads(line.removeprefix("RESULT "))
    assert result["rc"] in (0, None)
    assert result["heavy"] == [], f"simulate --token-ids imported {result['heavy']}"
    assert "simulated 40 requests" in proc.stdout  # the run did happen, to its summary


def test_the_check_sees_a_torch_import():
    """The same probe reports torch once something on the path imports it (the test can fail)."""
    script = SCRIPT.replace("from workbench.entrypoints.cli import main",
                            "from workbench.entrypoints.cli import main\nimport workbench.worker.model_runner")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")][-1]
    assert "torch" in json.loads(line.removeprefix("RESULT "))["heavy"]
