"""The exercises' catalog and notebooks: names in order, each notebook holds its stub (not a
solution: its stored check output is a failure), and the interface's errors are clear."""

from __future__ import annotations

import pathlib
import re

import nbformat
import pytest

import workbench.exercises as ex

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_names_in_notebook_order():
    assert ex.names() == ["admission", "policy", "eviction", "chunked_prefill", "rejection", "router"]
    assert [ex.exercise(n).number for n in ex.names()] == [1, 2, 3, 4, 5, 6]


@pytest.mark.parametrize("name", ex.names())
def test_the_notebook_holds_the_stub_and_shows_a_failing_check(name):
    exercise = ex.exercise(name)
    nb = nbformat.read(ROOT / exercise.notebook, as_version=4)
    assert nb.cells[0].source.startswith(f"# Exercise {exercise.number}: ")
    code = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
    body = exercise.stub[min(exercise.stub.find(k) for k in ("def ", "class ") if k in exercise.stub):]
    assert body.strip() in code, "the notebook's stub differs from ex.stub(name)"
    assert f'ex.check("{name}", ' in code
    outputs = [o.get("text") or o.get("data", {}).get("text/plain", "") for c in nb.cells if c.cell_type == "code"
               for o in c.outputs]
    assert any(text.startswith(f"FAILED {name} at ") for text in outputs), "the stub must fail its check"
    assert not any("PASSED" in text for text in outputs), "a notebook must not hold a passing solution"


def test_unknown_names_are_named():
    with pytest.raises(KeyError, match="no exercise 'routing'; the exercises are"):
        ex.check("routing", None)


@pytest.mark.slow  # six notebooks executed
@pytest.mark.parametrize("name", ex.names())
def test_each_notebook_passes_its_check_with_the_reference_in_place_of_the_stub(name):
    """The learner's path through the notebook, with the engine's own piece as the solution:
    the notebook runs from the top to its ``check()`` cell, which reports a pass (the cells
    after it read a failing check's feedback)."""
    nbclient = pytest.importorskip("nbclient")
    exercise = ex.exercise(name)
    nb = nbformat.read(ROOT / exercise.notebook, as_version=4)
    solution = re.search(r"^(?:def|class) (\w+)", exercise.stub, re.MULTILINE).group(1)
    check = next(i for i, c in enumerate(nb.cells) if f'ex.check("{name}", ' in c.source)
    nb.cells = nb.cells[:check] + [nbformat.v4.new_code_cell(f'{solution} = ex.reference("{name}")'), nb.cells[check]]
    nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                            resources={"metadata": {"path": str(ROOT / "notebooks" / "exercises")}}).execute()
    text = "".join(o.get("text") or o.get("data", {}).get("text/plain", "") for o in nb.cells[-1].outputs)
    assert text.startswith(f"PASSED {name}"), text
