"""The README is the entrance (at most 10 KB); docs/architecture.md's tree of rooms names every
module of the package; every path either names (in the tree, in backticks, in links) exists."""

from __future__ import annotations

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
ARCHITECTURE = (ROOT / "docs" / "architecture.md").read_text()


def tree_paths() -> set[str]:
    """Paths of the tree block under '## The rooms' (two spaces of indent per level)."""
    section = ARCHITECTURE.split("## The rooms", 1)[1]
    block = section.split("```", 2)[1]
    paths, stack = set(), []
    for line in block.splitlines()[1:]:
        if not line.strip():
            continue
        depth = (len(line) - len(line.lstrip(" "))) // 2
        names = line.split(maxsplit=1)[0]
        del stack[depth:]
        for name in names.split(","):  # "a.py,b.py" lists siblings on one line
            paths.add("".join(stack) + name)
        if names.endswith("/"):
            stack.append(names)
    return paths


def package_modules() -> set[str]:
    modules = {str(p.relative_to(ROOT)) for p in (ROOT / "workbench").rglob("*.py")}
    modules |= {str(p.relative_to(ROOT)) for p in (ROOT / "kernels").glob("*.py")}
    return {m for m in modules if not (m.endswith("/__init__.py") and m != "workbench/__init__.py")}


def test_the_readme_is_short():
    assert len(README.encode()) <= 10 * 1024


def test_the_tree_names_every_module_of_the_package():
    missing = package_modules() - tree_paths()
    assert not missing, f"modules missing from docs/architecture.md's tree: {sorted(missing)}"


def named_paths(text: str, folder: pathlib.Path) -> set[pathlib.Path]:
    """Paths a document names: its links (relative to its folder) and the repository paths in
    its backticks (relative to the root)."""
    links = {folder / p for p in re.findall(r"\]\(([^)#\s]+)\)", text) if "://" not in p}
    quoted = {ROOT / m for m in re.findall(r"`([\w./-]+/[\w./-]*)`", text)
              if re.search(r"\.(py|md|png|json|ipynb)$|/$", m)}
    return links | quoted


@pytest.mark.parametrize("doc", ["README.md", "docs/architecture.md"])
def test_every_path_a_document_names_exists(doc):
    path = ROOT / doc
    named = named_paths(path.read_text(), path.parent)
    if doc == "docs/architecture.md":
        named |= {ROOT / p for p in tree_paths()}
    absent = sorted(str(p.relative_to(ROOT)) for p in named if not p.exists())
    assert not absent, f"{doc} names paths that do not exist: {absent}"
