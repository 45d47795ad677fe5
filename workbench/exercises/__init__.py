"""Exercises that grade themselves: a learner writes one piece of the serving path, and the
grader runs hypothesis-drawn workloads (from a fixed seed: the same feedback every time)
through the engine with the learner's piece beside the engine's own, step by step.

    import workbench.exercises as ex
    ex.names()                        # ['admission', 'policy', ...]
    ex.stub("admission")              # the code to fill in
    result = ex.check("admission", schedule)
    result.passed, result.first_wrong_step, result.message
    result.show()                     # the StepPlayer at that step, both decisions side by side
    result.hint()                     # one more hint per call
    ex.reference("admission")         # the engine's own piece, in the stub's shape

The notebooks are ``notebooks/exercises/NN_name.ipynb``; ``%llm exercise NAME`` prints one.
"""

from __future__ import annotations

from workbench.exercises.catalog import EXERCISES, Exercise
from workbench.exercises.grader import CheckResult

__all__ = ["CheckResult", "Exercise", "check", "exercise", "names", "reference", "stub"]


def names() -> list[str]:
    """The exercises' names, in their notebooks' order."""
    return [e.name for e in sorted(EXERCISES.values(), key=lambda e: e.number)]


def exercise(name: str) -> Exercise:
    """One exercise's record; KeyError naming the known ones."""
    try:
        return EXERCISES[name]
    except KeyError:
        raise KeyError(f"no exercise {name!r}; the exercises are {names()}.") from None


def stub(name: str) -> str:
    """The code a learner starts from."""
    return exercise(name).stub


def reference(name: str):
    """The engine's own piece, in the stub's shape (it passes ``check``)."""
    return exercise(name).reference()


def check(name: str, solution, **options) -> CheckResult:
    """Grade ``solution`` for exercise ``name``: ``.passed``, ``.first_wrong_step`` (None when
    passed), ``.message``, ``.show()``, ``.hint()``. ``options``: ``workloads`` (grade on these
    instead of drawn ones), ``max_examples`` (how many to draw)."""
    return exercise(name).grade(solution, **options)
