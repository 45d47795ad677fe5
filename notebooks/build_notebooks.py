"""Build the tutorials: each ``notebooks/src/NN_name.py`` becomes ``notebooks/NN_name.ipynb``, executed.

    python notebooks/build_notebooks.py            # every tutorial
    python notebooks/build_notebooks.py 06 07      # only these (by number or file stem)
    python notebooks/build_notebooks.py exercises/01   # a self-grading exercise (exercises: all of them)

The self-grading exercises live the same way one folder down: ``notebooks/exercises/src/NN_name.py``
becomes ``notebooks/exercises/NN_name.ipynb`` (executed in notebooks/exercises/).

A source is a Jupytext "percent" script: ``# %% [markdown]`` starts a prose cell (its lines
commented), ``# %%`` a code cell. Edit the source, never the notebook, then rebuild; editors
(JupyterLab with Jupytext, VS Code, PyCharm) run percent scripts cell by cell as they are.

The stored outputs are what nbval compares in CI (``pytest --nbval``), so every checked cell
must print the same thing on every run: seeds, greedy decoding, counts in steps rather than
seconds, your own request ids. A cell whose output cannot be stable starts with
``# NBVAL_IGNORE_OUTPUT``. ``tests/notebooks/test_notebook_sources.py`` fails when a notebook's cells
differ from its source (a rebuild was forgotten).
"""

from __future__ import annotations

import pathlib
import sys

import jupytext
import nbformat
from nbclient import NotebookClient

NOTEBOOKS = pathlib.Path(__file__).resolve().parent
SOURCES = NOTEBOOKS / "src"
EXERCISES = NOTEBOOKS / "exercises"
KERNELSPEC = {"name": "python3", "display_name": "Python 3", "language": "python"}


def sources(selected: list[str] | None = None) -> list[pathlib.Path]:
    """The tutorial sources, then the exercises', in order; ``selected`` filters by number
    ("06") or stem, an exercise by ``exercises/`` and its number or stem, or all exercises by
    ``exercises``."""
    paths = sorted(SOURCES.glob("[0-9][0-9]_*.py")) + sorted((EXERCISES / "src").glob("[0-9][0-9]_*.py"))
    if not selected:
        return paths
    chosen = [p for p in paths if set(names(p)) & set(selected)]
    unknown = set(selected) - {n for p in chosen for n in names(p)}
    if unknown:
        raise SystemExit(f"no notebook source for {sorted(unknown)} in {SOURCES} or {EXERCISES / 'src'}")
    return chosen


def names(path: pathlib.Path) -> tuple[str, ...]:
    """What selects a source on the command line."""
    if path.parent.parent == EXERCISES:
        return "exercises", f"exercises/{path.stem}", f"exercises/{path.stem[:2]}"
    return path.stem, path.stem[:2]


def target(path: pathlib.Path) -> pathlib.Path:
    """The notebook a source builds: next to its ``src/`` folder."""
    return path.parent.parent / f"{path.stem}.ipynb"


def read_source(path: pathlib.Path) -> nbformat.NotebookNode:
    """The notebook a source describes, unexecuted, with stable cell ids (a rebuild only
    changes what really changed)."""
    nb = jupytext.read(path, fmt="py:percent")
    nb.metadata = nbformat.NotebookNode(kernelspec=KERNELSPEC)
    for i, cell in enumerate(nb.cells):
        cell.id = f"cell-{i:02d}"
        cell.metadata = nbformat.NotebookNode()
    return nb


def build(path: pathlib.Path) -> pathlib.Path:
    """Execute one source in a fresh kernel (working directory: the notebook's folder) and
    write the .ipynb."""
    nb = read_source(path)
    out = target(path)
    NotebookClient(nb, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": str(out.parent)}}).execute()
    for cell in nb.cells:  # per-run timestamps would make every rebuild a diff
        cell.metadata.pop("execution", None)
    nbformat.write(nb, out)
    return out


def main(argv: list[str]) -> int:
    for path in sources(argv):
        target = build(path)
        print("wrote", target.relative_to(NOTEBOOKS.parent))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
