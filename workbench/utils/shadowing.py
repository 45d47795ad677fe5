"""Folders of the checkout that must not shadow installed libraries from the repository root.

The checkout keeps two package folders at its top level, ``kernels/`` and ``data/``, installed
as ``workbench.kernels`` and ``workbench.data`` (setuptools ``package-dir``). From the root,
``python -m ...`` puts the checkout first on ``sys.path``, so ``import kernels`` would load the
folder instead of the ``kernels`` library that transformers (>= 5.25) imports. Each folder's
``__init__.py`` therefore calls :func:`hand_over` when it runs under its bare top-level name.

Invariant: under its top-level name, such a folder is never the module a caller gets. The
caller gets what the same import gives with the checkout's root off ``sys.path``: the installed
library, or ``ModuleNotFoundError`` when none is installed. Under ``workbench.*`` nothing changes.

This module imports only the standard library: it runs before anything else of the workbench.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys


def hand_over(name: str, init_file: str) -> None:
    """Replace the module being imported as ``name`` (the checkout folder whose ``__init__.py``
    is ``init_file``) by the one found on ``sys.path`` without the checkout's root, or raise
    ModuleNotFoundError. Call it from that ``__init__.py`` only: the import statement returns
    ``sys.modules[name]``, which this sets."""
    root = os.path.dirname(os.path.dirname(os.path.realpath(init_file)))
    path = [entry for entry in sys.path if os.path.realpath(entry or os.curdir) != root]
    spec = importlib.machinery.PathFinder.find_spec(name, path)
    if spec is None:
        raise ModuleNotFoundError(
            f"No module named {name!r} (the checkout's {name}/ folder is workbench.{name}, not "
            f"{name!r}; install the library that provides {name!r} if you need it)", name=name)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    if spec.loader is not None:  # None: a namespace package, complete once created
        spec.loader.exec_module(module)
