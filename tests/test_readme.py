"""The README is the entrance: its tree of rooms names every module of the package, and every
path it names (in the tree, in backticks, in links) exists."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def tree_paths() -> set[str]:
    """Paths of the tree block under '## The rooms' (two spaces of indent per level)."""
    section = README.split("## The rooms", 1)[1]
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
    assert len(README.encode()) < 20 * 1024


def test_the_tree_names_every_module_of_the_package():
    missing = package_modules() - tree_paths()
    assert not missing, f"modules missing from the README's tree: {sorted(missing)}"


def test_every_path_the_readme_names_exists():
    named = tree_paths()
    named |= set(re.findall(r"\]\(([^)#\s]+)\)", README)) - {p for p in named if "://" in p}
    named |= {m for m in re.findall(r"`([\w./-]+/[\w./-]*)`", README)
              if re.search(r"\.(py|md|png|json|ipynb)$|/$", m)}
    named = {p for p in named if "://" not in p}
    absent = sorted(p for p in named if not (ROOT / p).exists())
    assert not absent, f"the README names paths that do not exist: {absent}"
