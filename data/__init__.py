"""The embedded models, adapters, traces and calibrations, installed as ``workbench.data``
(read with ``importlib.resources``). Imported from the repository root as a top-level ``data``,
it hands over to whatever else owns that name (:mod:`workbench.utils.shadowing`).
"""

if __name__ != "workbench.data":
    from workbench.utils.shadowing import hand_over

    hand_over(__name__, __file__)
