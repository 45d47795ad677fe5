"""The tutorials in notebooks/ are built from notebooks/src/ (the exercises in
notebooks/exercises/ from notebooks/exercises/src/) and keep the issue's shape.

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
TUTORIALS = [p for p in SOURCES if p.parent == NOTEBOOKS / "src"]


@pytest.mark.parametrize("folder", [NOTEBOOKS, NOTEBOOKS / "exercises"], ids=["tutorials", "exercises"])
def test_every_notebook_has_a_source(folder):
    built = {p.stem for p in folder.glob("*.ipynb")}
    assert built, f"no notebooks in {folder}"
    assert built == {p.stem for p in SOURCES if build_notebooks.target(p).parent == folder}


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: build_notebooks.names(p)[-2])
def test_notebook_holds_its_source(source):
    expected = build_notebooks.read_source(source)
    stored = nbformat.read(build_notebooks.target(source), as_version=4)
    assert [(c.cell_type, c.source) for c in stored.cells] == [
        (c.cell_type, c.source) for c in expected.cells
    ], f"{source.stem}.ipynb is stale: run `python notebooks/build_notebooks.py {build_notebooks.names(source)[-1]}`"
    unrun = [i for i, c in enumerate(stored.cells) if c.cell_type == "code" and c.execution_count is None]
    assert not unrun, f"cells {unrun} of {source.stem}.ipynb were never executed"


@pytest.mark.parametrize("source", TUTORIALS, ids=lambda p: p.stem)
def test_tutorial_shape(source):
    cells = build_notebooks.read_source(source).cells
    kinds = [c.cell_type for c in cells]
    assert kinds[0] == "markdown" and cells[0].source.startswith("# "), "open with a title and aims"
    assert kinds.count("markdown") * 2 >= kinds.count("code"), "at least one prose cell per two code cells"
    assert "Exercises" in cells[-1].source or "Exercises" in cells[-2].source, "close with exercises"
