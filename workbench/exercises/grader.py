"""The grader's common parts: the result a check returns, the search for a failing workload,
and the simulated engine the scheduling exercises step.

A check draws workloads with hypothesis from a fixed seed (the same feedback on every run),
runs each one step by step with the learner's piece and the engine's own beside it, and stops
at the first step where their decisions differ. hypothesis then shrinks that workload to a
smallest one that still fails, so the message talks about a handful of requests.
"""

from __future__ import annotations

import html
import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from hypothesis import HealthCheck, Phase, find, settings
from hypothesis import strategies as st
from hypothesis.errors import NoSuchExample

from workbench.config import EngineConfig
from workbench.engine.fork import apply_scheduling
from workbench.engine.llm_engine import LLMEngine
from workbench.lab.sim.clock import SimClock
from workbench.lab.sim.cost_model import as_cost_model
from workbench.lab.sim.simulated_runner import SimulatedRunner

#: Every check draws from this seed: the same solution gets the same feedback every time.
SEED = 35


@dataclass
class CheckResult:
    """What ``check(name, solution)`` found.

    ``passed``; ``first_wrong_step`` (None when passed): the engine step (or, for a
    statistical exercise, the drawn case: ``unit`` says which) where the solution first differs; ``message``: what
    differed, in words; ``expected`` / ``got``: the reference's and the solution's decision
    there; ``workload``: the smallest workload found that shows it; ``score``: how much was
    checked. ``show()`` opens the view at that step, ``hint()`` gives one more hint per call.
    """

    exercise: str
    passed: bool
    message: str
    first_wrong_step: int | None = None
    expected: Any = None
    got: Any = None
    workload: Any = None
    score: str = ""
    hints: Sequence[str] = ()
    view: Callable[[], Any] | None = field(default=None, repr=False)
    unit: str = "step"  # what first_wrong_step counts: engine steps, or drawn cases (statistical)
    _hints_given: int = field(default=0, repr=False)

    def show(self):
        """The widget at the first wrong step: both decisions side by side and the StepPlayer
        (or the exercise's own figure) there; on success, a summary."""
        if self.view is None:
            import ipywidgets as widgets
            return widgets.HTML(self._repr_html_())
        return self.view()

    def hint(self) -> str:
        """The next hint (each call gives one more; the last one repeats)."""
        if not self.hints:
            return "No hints for this exercise."
        text = self.hints[min(self._hints_given, len(self.hints) - 1)]
        self._hints_given += 1
        return f"Hint {min(self._hints_given, len(self.hints))}/{len(self.hints)}: {text}"

    def __repr__(self) -> str:
        if self.passed:
            return f"PASSED {self.exercise}: {self.message}"
        return f"FAILED {self.exercise} at {self.unit} {self.first_wrong_step}: {self.message}"

    def _repr_html_(self) -> str:
        colour = "#2e7d32" if self.passed else "#c62828"
        word = "PASSED" if self.passed else f"FAILED at {self.unit} {self.first_wrong_step}"
        return (f'<div><b style="color:{colour}">{word}</b> <code>{html.escape(self.exercise)}</code>'
                f'<pre style="white-space:pre-wrap">{html.escape(self.message)}</pre></div>')


class Mismatch(Exception):
    """Raised inside a run at the first step where the solution differs from the reference."""

    def __init__(self, step: int, message: str, expected: Any = None, got: Any = None, view: Any = None):
        super().__init__(message)
        self.step, self.message, self.expected, self.got, self.view = step, message, expected, got, view


def search_settings(max_examples: int, shrink: bool = True) -> settings:
    phases = (Phase.explicit, Phase.generate) + ((Phase.shrink,) if shrink else ())
    return settings(max_examples=max_examples, database=None, deadline=None, phases=phases,
                    suppress_health_check=list(HealthCheck))


def first_failure(strategy: st.SearchStrategy, run: Callable[[Any], None], *, max_examples: int,
                  workloads: Iterable[Any] | None = None, shrink: bool = True) -> tuple[Any, Mismatch] | None:
    """The first workload on which ``run`` raises :class:`Mismatch` (hypothesis-drawn from
    :data:`SEED` and shrunk, or the first of ``workloads`` when given), with that mismatch;
    None when every workload runs clean."""
    if workloads is not None:
        for workload in workloads:
            try:
                run(workload)
            except Mismatch as mismatch:
                return workload, mismatch
        return None

    def fails(workload) -> bool:
        try:
            run(workload)
        except Mismatch:
            return True
        return False

    try:
        workload = find(strategy, fails, settings=search_settings(max_examples, shrink),
                        random=random.Random(SEED))
    except NoSuchExample:
        return None
    try:
        run(workload)
    except Mismatch as mismatch:
        return workload, mismatch
    raise RuntimeError("the grader found a failing workload that then ran clean: is the solution "
                       "deterministic (no randomness, no state kept between calls)?")


def call_solution(step: int, fn: Callable, *args) -> Any:
    """Call the learner's code; an exception is this step's mismatch, named."""
    try:
        return fn(*args)
    except Exception as exc:  # the learner's bug, reported as feedback
        raise Mismatch(step, f"step {step}: your code raised {type(exc).__name__}: {exc}") from exc


#: Every grading engine's context length (fixed, so that few engines are ever built).
MAX_MODEL_LEN = 64
_PRISTINE: dict[tuple, LLMEngine] = {}  # pool config -> an engine never stepped, forked for each run


def sim_engine(*, block_size: int, num_kv_blocks: int, enable_prefix_caching: bool, **scheduling) -> LLMEngine:
    """A fresh steppable engine on the simulated runner (real scheduler and KV cache, no
    model), the same every time; its history records every step. ``scheduling``: the engine's
    what-if changes (policy, max_num_batched_tokens, max_num_seqs, enable_chunked_prefill).
    Building one loads a tokenizer, so each pool's engine is built once, kept unstepped and
    forked (a third of the time)."""
    key = (block_size, num_kv_blocks, enable_prefix_caching)
    pristine = _PRISTINE.get(key)
    if pristine is None:
        if len(_PRISTINE) >= 32:
            _PRISTINE.clear()
        clock = SimClock()
        config = EngineConfig(block_size=block_size, num_kv_blocks=num_kv_blocks, max_model_len=MAX_MODEL_LEN,
                              enable_prefix_caching=enable_prefix_caching, keep_warm_s=0.0)
        pristine = _PRISTINE[key] = LLMEngine(
            config, make_runner=SimulatedRunner.factory(as_cost_model(None), clock, {}), clock=clock)
    engine = pristine.fork()
    apply_scheduling(engine, **scheduling)
    return engine


def side_by_side(title: str, rows: Sequence[tuple[str, str, str]], player=None):
    """A table request | engine | yours (differing rows marked) above ``player``."""
    import ipywidgets as widgets

    body = "".join(
        f'<tr style="{"background:#ffebee" if ref != mine else ""}"><td>{html.escape(key)}</td>'
        f"<td>{html.escape(ref)}</td><td>{html.escape(mine)}</td></tr>" for key, ref, mine in rows)
    table = widgets.HTML(f"<b>{html.escape(title)}</b><table><thead><tr><th></th><th>engine (reference)</th>"
                         f"<th>yours</th></tr></thead><tbody>{body}</tbody></table>")
    return widgets.VBox([table] + ([player] if player is not None else []))
