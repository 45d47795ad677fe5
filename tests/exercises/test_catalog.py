"""The exercises' catalog and notebooks: names in order, each notebook holds its stub (not a
solution: its stored check output is a failure), and the interface's errors are clear."""

from __future__ import annotations

import pathlib

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
