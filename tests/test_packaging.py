"""pyproject.toml ships every subpackage (a wheel built from a missing entry lacks that code)."""

import pathlib

import pytest

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_every_subpackage_is_listed_in_pyproject():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    on_disk = {
        "workbench." + ".".join(p.parent.relative_to(ROOT / "workbench").parts)
        for p in (ROOT / "workbench").rglob("__init__.py")
        if p.parent != ROOT / "workbench"
    } | {"workbench"}
    assert on_disk <= listed, f"missing from [tool.setuptools] packages: {sorted(on_disk - listed)}"
    assert config["package-dir"]["workbench.kernels"] == "kernels"
    assert {"workbench.kernels", "workbench.data"} <= listed
