"""The exercises as nbgrader assignments: a course directory a course can use as it is.

    python -m workbench.exercises.assignments COURSE_DIR [NAME ...]   # every exercise by default
    cd COURSE_DIR
    nbgrader generate_assignment 01_admission      # release/: the stub, no solution
    # students fill in the stub; their notebooks go to submitted/STUDENT/01_admission/
    nbgrader autograde 01_admission                # autograded/ and the gradebook: 1 point or 0

Each assignment is its exercise notebook up to the stub (the prose, the imports, the worked
example), the stub cell as nbgrader's solution cell and one locked, autograded test cell
that calls the grader. The instructor's version holds no written solution either: its solution
region assigns the engine's own piece (``ex.reference(name)``) to the stub's name, and
``generate_assignment`` removes that region (``ClearSolutions.code_stub`` is a comment here,
so the released cell is the stub as the notebooks show it).
"""

from __future__ import annotations

import pathlib
import re
import sys
from collections.abc import Sequence

import nbformat

from workbench.exercises.catalog import EXERCISES, Exercise

NBGRADER_CONFIG = """\
c = get_config()  # noqa: F821 (nbgrader's config loader defines it)
c.CourseDirectory.root = "."
# The released cell is the stub itself: nothing replaces the instructor's solution region.
c.ClearSolutions.code_stub = {"python": "# (write your code in the stub above)"}
c.ExecutePreprocessor.timeout = 600  # a check runs many workloads
"""


def stub_name(exercise: Exercise) -> str:
    """The function or class the stub defines (the name the autograded cell checks)."""
    match = re.search(r"^(?:def|class) (\w+)", exercise.stub, re.M)
    return match.group(1)


def _meta(grade_id: str, *, solution: bool = False, grade: bool = False, points: int = 0) -> dict:
    meta = {"grade_id": grade_id, "solution": solution, "grade": grade, "locked": not solution,
            "schema_version": 3}
    if grade:
        meta["points"] = points
    return {"nbgrader": meta}


def assignment_notebook(exercise: Exercise, notebook: nbformat.NotebookNode, *, max_examples: int | None = None,
                        points: int = 1) -> nbformat.NotebookNode:
    """The nbgrader source notebook of ``exercise`` built from its exercise ``notebook``."""
    name = stub_name(exercise)
    start = next((i for i, c in enumerate(notebook.cells)
                  if c.cell_type == "code" and re.search(rf"^(?:def|class) {name}\b", c.source, re.M)), None)
    if start is None:
        raise ValueError(f"exercise {exercise.name!r}: no cell of its notebook defines {name!r}.")
    cells = [nbformat.v4.new_markdown_cell(c.source) if c.cell_type == "markdown" else nbformat.v4.new_code_cell(c.source)
             for c in notebook.cells[:start]]
    stub = notebook.cells[start].source
    solution = nbformat.v4.new_code_cell(
        f"{stub}\n### BEGIN SOLUTION\n{name} = ex.reference({exercise.name!r})\n### END SOLUTION")
    solution.metadata.update(_meta(f"{exercise.name}_solution", solution=True))
    cells.append(solution)
    cells.append(nbformat.v4.new_markdown_cell(
        "## Check it (autograded)\n\nThe cell below calls the grader; it passes when every step matches the "
        "engine's. Run it as often as you like: the feedback is the same every time."))
    options = "" if max_examples is None else f", max_examples={max_examples}"
    test = nbformat.v4.new_code_cell(
        f"result = ex.check({exercise.name!r}, {name}{options})\nprint(result)\nassert result.passed, result.message")
    test.metadata.update(_meta(f"{exercise.name}_check", grade=True, points=points))
    cells.append(test)
    out = nbformat.v4.new_notebook(cells=cells)
    out.metadata = nbformat.NotebookNode(notebook.metadata)
    return out


def write_course(course_dir, names: Sequence[str] | None = None, *, notebooks_dir=None,
                 max_examples: int | None = None) -> list[pathlib.Path]:
    """Write ``course_dir/source/NN_name/NN_name.ipynb`` for each exercise (all by default) and
    an ``nbgrader_config.py``; returns the notebooks written. ``notebooks_dir``: where the
    exercise notebooks are (default: the checkout's ``notebooks/exercises``)."""
    course = pathlib.Path(course_dir)
    root = pathlib.Path(notebooks_dir) if notebooks_dir else pathlib.Path(__file__).resolve().parents[2] / "notebooks" / "exercises"
    written = []
    for name in names or sorted(EXERCISES, key=lambda n: EXERCISES[n].number):
        exercise = EXERCISES[name]
        stem = pathlib.Path(exercise.notebook).stem
        source = nbformat.read(root / f"{stem}.ipynb", as_version=4)
        target = course / "source" / stem / f"{stem}.ipynb"
        target.parent.mkdir(parents=True, exist_ok=True)
        nbformat.write(assignment_notebook(exercise, source, max_examples=max_examples), target)
        written.append(target)
    config = course / "nbgrader_config.py"
    if not config.exists():
        config.write_text(NBGRADER_CONFIG)
    return written


def main(argv: Sequence[str]) -> int:
    if not argv:
        print(__doc__)
        return 2
    for path in write_course(argv[0], argv[1:] or None):
        print("wrote", path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
