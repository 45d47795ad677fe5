"""The house rules on imports, checked on the source (``ast``) and in a fresh interpreter.

* The core (``workbench.core``, scheduling and KV bookkeeping) imports neither torch, nor
  transformers, nor any higher room of the package.
* Imports run one way, bottom-up through :data:`LAYERS`: a module may import its own layer
  and the layers below, never one above -- lazy imports inside functions included.
* No two modules import each other, directly or round a longer circle.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = {"workbench": ROOT / "workbench", "workbench.kernels": ROOT / "kernels"}

#: Bottom-up; each entry names the rooms of one layer (a module belongs to the longest match).
LAYERS = (
    ("utils",),
    ("sampling_params", "outputs", "request", "config", "kernels", "lora",
     "pooling_params", "pooling"),  # the public types (pooling: its config and outputs)
    # (lora: LoRARequest; the adapters' torch rooms sit above the model)
    ("core",),  # core.sched included
    ("metrics",),
    ("model",),
    ("lora.layers", "lora.models", "lora.worker_manager"),  # multi-LoRA over the model
    ("worker",),
    ("reasoning",),  # reasoning parsers: the server splits replies, the grammars wait
    ("spec_decode",),  # proposers: n-gram, and a draft model run by the worker's runner
    ("structured_output",),  # the grammars: the engine owns the manager, the sampler masks
    ("distributed",),  # the KV connector: its worker side wraps the runner, the engine builds it
    ("engine",),
    ("lab",),
    ("cluster",),  # many engines behind a router: replicas, routers, decisions (over engine and lab)
    ("viz",),
    ("exercises",),  # self-grading exercises: the engine, the simulator and the player
    ("entrypoints",),  # llm, magics, openai
    ("benchmarks",),
    ("entrypoints.cli",),  # the dispatcher
)
HOOKS = {"workbench", "workbench.__main__"}  # the package's hooks may import any layer



def package_modules() -> dict[str, Path]:
    """Every module of the package, by dotted name (a package by its ``__init__``)."""
    modules = {}
    for package, root in SOURCES.items():
        for path in sorted(root.rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join([package, *parts])] = path
    return modules


MODULES = package_modules()


def export_table() -> dict[str, str]:
    """``workbench/__init__.py``'s ``_EXPORTS``: public name -> the module defining it."""
    tree = ast.parse((SOURCES["workbench"] / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "_EXPORTS" for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError("workbench/__init__.py has no _EXPORTS table")


EXPORTS = export_table()


def imports_of(module: str) -> set[str]:
    """The package modules ``module`` imports anywhere in its source (in functions too):
    ``from P import name`` goes to ``P.name`` when that is a module, to the defining module
    for ``from workbench import <public name>``, else to ``P``; and to the packages whose
    ``__init__`` such an import runs."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    targets: set[str] = set()

    def add(name: str) -> None:
        while name and name not in MODULES:  # ``import a.b.c`` where c is not a module
            name = name.rpartition(".")[0]
        if name:
            targets.add(name)

    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("workbench"):
                    add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if not source.startswith("workbench"):
                continue
            for alias in node.names:
                full = f"{source}.{alias.name}"
                if full in MODULES:
                    targets.add(full)
                elif source == "workbench" and alias.name in EXPORTS:
                    targets.add(EXPORTS[alias.name])
                else:
                    add(source)
        elif (  # importlib.import_module("workbench....")
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and str(node.args[0].value).startswith("workbench")
        ):
            add(node.args[0].value)
    # Importing ``a.b.c`` first runs the ``__init__`` of ``a.b`` (an implied edge), except
    # where that package encloses the importer (its ``__init__`` is already running).
    for target in list(targets):
        parent = target.rpartition(".")[0]
        while parent:
            if parent in MODULES and not module.startswith(parent + "."):
                targets.add(parent)
            parent = parent.rpartition(".")[0]
    targets.discard(module)
    return targets


GRAPH = {m: imports_of(m) for m in MODULES}


def layer(module: str) -> int | None:
    """Index in :data:`LAYERS` of the module's room (None for the hooks)."""
    if module in HOOKS:
        return None
    rel = module.removeprefix("workbench.")
    best = None
    for i, rooms in enumerate(LAYERS):
        for room in rooms:
            if (rel == room or rel.startswith(room + ".")) and (best is None or len(room) > len(best[1])):
                best = (i, room)
    assert best is not None, f"{module} is in no layer of LAYERS: add its room"
    return best[0]


def test_every_module_has_a_layer():
    assert len(MODULES) > 50 and "workbench.kernels.reference" in MODULES
    for module in MODULES:
        layer(module)


def test_imports_run_one_way():
    climbs = set()
    for module, targets in GRAPH.items():
        if module in HOOKS:
            continue
        for target in targets:
            if target in HOOKS:
                climbs.add((module, target))  # only `from workbench import <public name>` may
            elif layer(target) > layer(module):
                climbs.add((module, target))
    assert climbs == set(), "imports that climb a layer:\n" + "\n".join(
        f"  {m} (layer {layer(m)}: {LAYERS[layer(m)]}) imports {t}"
        + ("" if t in HOOKS else f" (layer {layer(t)}: {LAYERS[layer(t)]})")
        for m, t in sorted(climbs)
    )


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected sets of two or more modules (Tarjan), ignoring each module's
    imports of its own enclosing packages' ``__init__``."""
    edges = {m: {t for t in ts if not m.startswith(t + ".")} for m, ts in graph.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return cycles


def test_import_cycles_are_found():
    graph = {"p": set(), "p.a": {"p.b", "p"}, "p.b": {"p.c"}, "p.c": {"p.a"}, "p.d": {"p.a"}}
    assert import_cycles(graph) == [["p.a", "p.b", "p.c"]]  # p.a -> p (its package) is no cycle
    assert import_cycles({"p": {"p.a"}, "p.a": {"p"}}) == []


def test_no_import_cycles():
    cycles = import_cycles(GRAPH)
    assert cycles == [], "modules that import each other:\n" + "\n".join(f"  {' <-> '.join(c)}" for c in cycles)


def test_the_core_loads_neither_torch_nor_the_model():
    core = sorted(m for m in MODULES if m == "workbench.core" or m.startswith("workbench.core."))
    code = (
        "import importlib, sys\n"
        f"for name in {core!r}:\n"
        "    importlib.import_module(name)\n"
        "print('\\n'.join(sorted(sys.modules)))\n"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT,
    ).stdout.split()
    assert sorted({m.split(".")[0] for m in loaded} & {"torch", "transformers"}) == []
    core_layer = layer("workbench.core")
    assert [m for m in loaded if m in MODULES and m not in HOOKS and layer(m) > core_layer] == []
    assert "workbench.core.sched.scheduler" in loaded and "workbench.request" in loaded
