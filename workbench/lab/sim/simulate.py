"""simulate(): a workload on the real scheduler and KV cache with a SimulatedRunner.

Returns the same :class:`~workbench.lab.replay.RunResult` as :func:`workbench.lab.run.run_real`
(StepRecords, request metrics in simulated seconds), so plots, widgets and ``compare_runs``
read it alike. It runs on the workload's clock, as a real run does (see
:mod:`workbench.lab.replay`): ``"wall"`` -- arrivals at their ``arrival_time`` on the
simulated clock, which each step advances by the cost model's duration and an idle engine
jumps to the next arrival; ``"steps"`` -- arrivals by step, and the schedule is the one a real
``run_workload`` of the same workload makes.

Every request is run with ``detokenize=False`` and ``output_kind=FINAL_ONLY`` (its tokens
are fillers, so its text means nothing), unless it has stop strings (which need text).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from collections.abc import Iterable

import numpy as np

from workbench.config import EngineConfig
from workbench.engine.llm_engine import LLMEngine
from workbench.lab.replay import RunResult, RunSource, drive, run_clock
from workbench.lab.run import resolve_config
from workbench.lab.sim.clock import SimClock
from workbench.lab.sim.cost_model import CostModel, as_cost_model
from workbench.lab.sim.simulated_runner import SimulatedRunner
from workbench.lab.sim.spec_decode import SimulatedProposer, SpecDecodeProfile
from workbench.lab.workload import LengthSpec, Workload, WorkloadRequest, draw_lengths
from workbench.sampling_params import RequestOutputKind, SamplingParams
from workbench.utils.heap import rare_collections


def simulate(
    workload: Workload,
    config: EngineConfig | dict | None = None,
    cost_model: CostModel | str | None = None,
    *,
    clock: str | None = None,
    progress: bool = False,
    output_len: LengthSpec | None = None,
    seed: int = 0,
    spec_profile: SpecDecodeProfile | RunResult | None = None,
) -> RunResult:
    """Simulate ``workload`` on an engine built from ``config`` (as ``run_workload``), on the
    workload's clock (``clock``, when given, must be it; a plain list of requests is on ``clock``).

    ``cost_model``: a CostModel, a path to its JSON, or None for the shipped calibration of
    the embedded model on CPU. Output lengths: a request with ``ignore_eos`` runs to its
    ``max_tokens``; the others need ``output_len`` (an int, a ``(low, high)`` range, one
    length per request or ``fn(rng, n)``), drawn per request in workload order from
    ``seed``, and end with eos at that length (or at ``max_tokens`` if shorter).
    With ``config.speculative_config``, ``spec_profile`` (a SpecDecodeProfile, or a real
    RunResult with speculation to measure one from) says how often drafts come and how
    many are accepted; each step's draws come from ``seed``. Without speculation it is
    not read. A top-level function of picklable arguments: process pools can run it.
    """
    if not isinstance(workload, Workload):
        workload = Workload(workload, clock=clock)
    config = resolve_config(config)
    model = as_cost_model(cost_model)
    lengths = output_lengths(workload, output_len, seed)
    speculative = config.speculative_config
    if speculative is not None:
        if spec_profile is None:
            raise ValueError("simulate(): speculative_config needs spec_profile=, the acceptance measured on a "
                             "real run with speculation (a SpecDecodeProfile, or that RunResult).")
        if not isinstance(spec_profile, SpecDecodeProfile):
            spec_profile = SpecDecodeProfile.from_run(spec_profile)
    # The lean copies too: made with the usual thresholds, the copies of a 100,000-request
    # workload set off three full collections of the whole heap (2.2 s).
    with rare_collections():
        lean = Workload(lean_requests(workload), workload.info, clock=workload.clock)
        make = functools.partial(simulated_engine, config, model, lengths, spec_profile if speculative else None, seed)
        source = RunSource(make, lean, run_clock(lean, clock), exact=True)
        result = drive(source.make_engine(), lean, clock=clock, progress=progress, exclusive=True, source=source)
    return dataclasses.replace(result, workload=workload, simulated=True)


def simulated_engine(config: EngineConfig, model: CostModel, lengths: dict[str, int],
            spec_profile: SpecDecodeProfile | None = None, seed: int = 0) -> LLMEngine:
    """A fresh engine on its own simulated clock: the same every time (a RunSource's make_engine);
    with ``spec_profile``, drafts and their acceptance drawn from ``seed``."""
    sim_clock = SimClock()
    engine = LLMEngine(config, make_runner=SimulatedRunner.factory(model, sim_clock, lengths), clock=sim_clock)
    engine.runner.tokenizer = engine.tokenizer
    if spec_profile is not None:
        rng = np.random.default_rng([seed, 1])
        engine.runner.spec_profile, engine.runner.spec_rng = spec_profile, rng
        engine.proposer = SimulatedProposer(engine.runner, spec_profile,
                                            config.speculative_config.num_speculative_tokens, rng)
    return engine


def output_lengths(workload: Workload, output_len: LengthSpec | None, seed: int) -> dict[str, int]:
    """Drawn lengths of the requests that do not ignore eos; ValueError naming what is missing."""
    for r in workload:
        p = r.params
        if p.logprobs is not None or p.prompt_logprobs is not None:
            raise ValueError(f"request {r.request_id!r}: logprobs are not simulated (logprobs={p.logprobs}, "
                             f"prompt_logprobs={p.prompt_logprobs}); leave them None for simulate().")
    open_ended = [r for r in workload if not r.params.ignore_eos]
    if not open_ended:
        return {}
    if output_len is None:
        raise ValueError(
            f"{len(open_ended)} request(s), the first {open_ended[0].request_id!r}, have no exact output "
            "length: give them max_tokens with ignore_eos=True, or pass simulate(output_len=...) to draw one.")
    drawn = draw_lengths("output_len", output_len, len(workload), np.random.default_rng(seed), low=1)
    return {r.request_id: n for r, n in zip(workload, drawn) if not r.params.ignore_eos}


def lean_requests(requests: Iterable[WorkloadRequest]) -> list[WorkloadRequest]:
    """Each request with no text made and one output (at the end), unless stop strings need
    text. Requests that share a SamplingParams share its lean copy (made once)."""
    made: dict[int, tuple[SamplingParams, SamplingParams]] = {}  # id(params) -> (params, lean copy)
    lean = []
    for request in requests:
        p = request.params
        if p.stop_strings or (not p.detokenize and p.output_kind is RequestOutputKind.FINAL_ONLY):
            lean.append(request)
            continue
        if id(p) not in made:
            # Its fields are checked already (a replace() would validate them all again); the
            # two changed are valid with any others, as no stop string needs text.
            params = copy.copy(p)
            params.detokenize, params.output_kind = False, RequestOutputKind.FINAL_ONLY
            made[id(p)] = (p, params)  # p kept alive: its id stays its own
        copied = copy.copy(request)  # no second pass over the prompt either
        object.__setattr__(copied, "params", made[id(p)][1])
        lean.append(copied)
    return lean
