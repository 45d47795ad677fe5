"""The exercises as nbgrader assignments: generate_assignment releases the stub without the
instructor's solution region, and autograde scores a passing and a failing submission."""

from __future__ import annotations

import copy
import subprocess
import sys

import nbformat
import pytest

pytest.importorskip("nbgrader")

from workbench.exercises.assignments import write_course  # noqa: E402


def _nbgrader(course, *args):
    done = subprocess.run([sys.executable, "-m", "nbgrader", *args], cwd=course, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.slow  # two nbgrader apps and two kernels: about 20 s of CPU
def test_release_and_autograde_one_exercise(tmp_path):
    [source] = write_course(tmp_path, ["admission"], max_examples=3)
    assert "ex.reference('admission')" in source.read_text()  # the instructor's region: the engine's own piece
    _nbgrader(tmp_path, "generate_assignment", "01_admission")
    released = nbformat.read(tmp_path / "release" / "01_admission" / "01_admission.ipynb", as_version=4)
    text = "\n".join(c.source for c in released.cells)
    assert "def schedule(running, waiting, max_num_batched_tokens, max_num_seqs):" in text
    assert "ex.reference" not in text and "BEGIN SOLUTION" not in text
    graded = [c for c in released.cells if c.metadata.get("nbgrader", {}).get("grade")]
    assert len(graded) == 1 and "ex.check('admission', schedule" in graded[0].source

    for student, solved in (("alice", True), ("bob", False)):
        notebook = copy.deepcopy(released)
        if solved:  # alice's solution: the engine's own loop (the test has no other)
            cell = next(c for c in notebook.cells if c.metadata.get("nbgrader", {}).get("solution"))
            cell.source += "\nschedule = ex.reference('admission')"
        folder = tmp_path / "submitted" / student / "01_admission"
        folder.mkdir(parents=True)
        nbformat.write(notebook, folder / "01_admission.ipynb")
    _nbgrader(tmp_path, "autograde", "01_admission")

    from nbgrader.api import Gradebook

    with Gradebook(f"sqlite:///{tmp_path / 'gradebook.db'}") as gradebook:
        scores = {s: (gradebook.find_submission("01_admission", s).score,
                      gradebook.find_submission("01_admission", s).max_score) for s in ("alice", "bob")}
    assert scores == {"alice": (1.0, 1.0), "bob": (0.0, 1.0)}
    bob = nbformat.read(tmp_path / "autograded" / "bob" / "01_admission" / "01_admission.ipynb", as_version=4)
    errors = [o for c in bob.cells for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert errors and "your batch differs from the engine's" in "".join(errors[0]["traceback"])
