"""The tutorials in notebooks/ are built from notebooks/src/ and keep the issue's shape.

nbval (``pytest --nbval``) runs each notebook and compares its outputs; this file checks what
nbval cannot: that a notebook holds exactly its source's cells (nobody edited one side only),
and that each tutorial opens with what the reader learns, keeps at least one prose cell per two
code cells, and closes with exercises.
"""

from __future__ import annotations

import importlib.util
import pathlib

import nbformat
import pytest

pytest.importorskip("jupytext")

NOTEBOOKS = pathlib.Path(__file__).resolve().parents[2] / "notebooks"
_spec = importlib.util.spec_from_file_location("build_notebooks", NOTEBOOKS / "build_notebooks.py")
build_notebooks = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(build_notebooks)
SOURCES = build_notebooks.sources()


def test_every_notebook_has_a_source():
    assert SOURCES, "no tutorial sources found"
    assert {p.stem for p in NOTEBOOKS.glob("*.ipynb")} == {p.stem for p in SOURCES}


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.stem)
def test_notebook_holds_its_source(source):
    expected = build_notebooks.read_source(source)
    stored = nbformat.read(NOTEBOOKS / f"{source.stem}.ipynb", as_version=4)
    assert [(c.cell_type, c.source) for c in stored.cells] == [
        (c.cell_type, c.source) for c in expected.cells
    ], f"{source.stem}.ipynb is stale: run `python notebooks/build_notebooks.py {source.stem[:2]}`"
    unrun = [i for i, c in enumerate(stored.cells) if c.cell_type == "code" and c.execution_count is None]
    assert not unrun, f"cells {unrun} of {source.stem}.ipynb were never executed"


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.stem)
def test_tutorial_shape(source):
    cells = build_notebooks.read_source(source).cells
    kinds = [c.cell_type for c in cells]
    assert kinds[0] == "markdown" and cells[0].source.startswith("# "), "open with a title and aims"
    assert kinds.count("markdown") * 2 >= kinds.count("code"), "at least one prose cell per two code cells"
    assert "Exercises" in cells[-1].source or "Exercises" in cells[-2].source, "close with exercises"
