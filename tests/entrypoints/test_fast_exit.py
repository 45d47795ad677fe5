"""The console script ends a finished `workbench simulate` without tearing the heap down
(workbench.entrypoints.fast_exit): its output complete, its exit code kept, the atexit
functions run, objects' finalizers skipped; main() called in-process returns normally."""

import subprocess
import sys

from workbench.entrypoints.cli import main

ARGS = ["simulate", "--num-requests", "30", "--rate", "200", "--token-ids", "--input-len", "8", "32",
        "--output-len", "4", "8", "--num-kv-blocks", "100", "--max-num-seqs", "8"]

SCRIPT = """
import atexit, sys
from workbench.entrypoints.cli import {entry}

class Finalized:
    def __del__(self):
        print("heap torn down", flush=True)

kept = Finalized()  # freed only when the interpreter tears its modules down
atexit.register(lambda: print("atexit ran"))  # buffered: the exit must flush it
sys.argv = ["workbench"] + {args!r}
sys.exit({entry}())
"""


def run(entry: str, args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", SCRIPT.format(entry=entry, args=args)],
                          capture_output=True, text=True, timeout=120)


def test_console_script_exits_without_teardown_output_complete():
    proc = run("console_main", ARGS)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("RunResult(30 requests, 30 finished")
    assert lines[-2].startswith("simulated 30 requests in ")
    assert lines[-1] == "atexit ran"
    assert "heap torn down" not in proc.stdout


def test_plain_main_tears_down_as_usual():
    proc = run("main", ARGS)  # the same command through main(): the interpreter's own exit
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines()[-2:] == ["atexit ran", "heap torn down"]


def test_console_script_keeps_an_error_exit_code():
    proc = run("console_main", ARGS[:3] + ["--rate", "-1"])
    assert proc.returncode == 2
    assert "error:" in proc.stderr and "rate" in proc.stderr


def test_main_in_process_returns(capsys):
    assert main(ARGS) == 0
    assert "simulated 30 requests" in capsys.readouterr().out
