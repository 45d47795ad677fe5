"""Build the tutorials: each ``notebooks/src/NN_name.py`` becomes ``notebooks/NN_name.ipynb``, executed.

    python notebooks/build_notebooks.py            # every tutorial
    python notebooks/build_notebooks.py 06 07      # only these (by number or file stem)

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
KERNELSPEC = {"name": "python3", "display_name": "Python 3", "language": "python"}


def sources(selected: list[str] | None = None) -> list[pathlib.Path]:
    """The tutorial sources, in order; ``selected`` filters by number ("06") or stem."""
    paths = sorted(SOURCES.glob("[0-9][0-9]_*.py"))
    if not selected:
        return paths
    chosen = [p for p in paths if p.stem in selected or p.stem[:2] in selected]
    unknown = set(selected) - {p.stem for p in chosen} - {p.stem[:2] for p in chosen}
    if unknown:
        raise SystemExit(f"no tutorial source for {sorted(unknown)} in {SOURCES}")
    return chosen


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
    """Execute one source in a fresh kernel (working directory notebooks/) and write the .ipynb."""
    nb = read_source(path)
    NotebookClient(nb, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": str(NOTEBOOKS)}}).execute()
    for cell in nb.cells:  # per-run timestamps would make every rebuild a diff
        cell.metadata.pop("execution", None)
    target = NOTEBOOKS / f"{path.stem}.ipynb"
    nbformat.write(nb, target)
    return target


def main(argv: list[str]) -> int:
    for path in sources(argv):
        target = build(path)
        print("wrote", target.relative_to(NOTEBOOKS.parent))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
