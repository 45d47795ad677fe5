"""The workbench's attention and layer kernels, installed as ``workbench.kernels``: the entry
points are :mod:`workbench.kernels.ops`, the torch oracle :mod:`workbench.kernels.reference`.

From the repository root (``python -m ...`` puts the checkout first on ``sys.path``) this folder
is also reachable as a top-level ``kernels``, a name that belongs to the library transformers
imports: there it hands over to that library (:mod:`workbench.utils.shadowing`).
"""

if __name__ != "workbench.kernels":
    from workbench.utils.shadowing import hand_over

    hand_over(__name__, __file__)
