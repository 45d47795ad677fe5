"""What a measured step's duration is: the number a CostModel is fitted to and predicts.

A real step produces its tokens at the end of its ``sample`` stage: that is when the scheduler
stamps first tokens and finishes. So a step's duration is the wall time from the previous
step's tokens to this step's tokens, as a driver (``run_workload``, ``replay_workload``, a
serving loop) sees it: the previous step's ``output`` and ``record`` stages (detokenization,
outputs; the history record, stats and hooks), the driver's own time between the two steps
(``timings["driver"]``: adding arrivals, reading outputs), then this step's ``schedule``,
``prepare``, ``forward`` and ``sample``.
The engine records the driver's share only when the previous step left unfinished work, so an
idle wait never counts; a step without it (the first of a run or after idle) is its own four
stages only: what comes before it -- the wake-up, the arrival's input processing -- is the
cost model's ``wake_s`` and ``input_s``. The simulated clock advances by exactly this duration
per step (plus those) and stamps tokens at its end, as the real engine does.

With async scheduling (records with an ``overlap``) the host work of a step runs under the
forward of the one before, so a step's duration is what a driver sees of it: from the end of
the previous step's update (its outputs handed back) to the end of this one's; the first of a
run, from its schedule to its update's end. A cost model fitted to these prices the engine with
its host time hidden under compute (``CostModel.async_scheduling``).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from workbench.core.request_events import RequestArrived
from workbench.engine.history import TIMING_STAGES, StepRecord
from workbench.lab.sim.features import PREFILL_STEP, step_features
from workbench.lab.sim.lora_slots import LoRASlots

#: The stages of a step that come after its tokens: they count towards the next step.
AFTER_TOKENS = ("output", "propose", "record")


def records_of(source) -> list[StepRecord]:
    """The StepRecords of a StepHistory, a RunResult, or an iterable of either / of records."""
    if hasattr(source, "history") and not isinstance(source, StepRecord):
        source = source.history
    out: list[StepRecord] = []
    for item in source:
        if isinstance(item, StepRecord):
            out.append(item)
        else:
            out.extend(records_of(item))
    return out


def measured_steps(records: Iterable[StepRecord],
                   lora_slots: LoRASlots | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(features [n, F], durations [n], empty [n] bool)`` of every record with timings;
    adapter loads are counted on ``lora_slots`` (the engine's device slots, in step order;
    None: 0), ``after_prefill`` when the record before is the step just before and ran a prefill.

    Raises ValueError when no record carries timings (a history that was not measured)."""
    records = [r for r in records if r.timings]
    if not records:
        raise ValueError("no step with timings to fit: give the StepHistory of a real run "
                         "(a simulated or empty history has none).")
    features, durations = [], []
    for i, r in enumerate(records):
        previous = records[i - 1] if i and records[i - 1].step == r.step - 1 else None  # the step just before
        loads = lora_slots.activate(r.scheduler_output.lora_names) if lora_slots is not None else 0
        features.append(step_features(r.scheduler_output, loads,
                                      after_prefill=previous is not None and features[-1][PREFILL_STEP] > 0))
        t = r.timings
        if r.overlap is not None and "update" in r.overlap.spans:  # async scheduling
            start = (previous.overlap.spans["update"][1] if previous is not None and previous.overlap is not None
                     and "update" in previous.overlap.spans else r.overlap.spans["schedule"][0])
            durations.append(r.overlap.spans["update"][1] - start)
            continue
        own = sum(t.get(k, 0.0) for k in TIMING_STAGES if k not in AFTER_TOKENS)
        if "driver" in t and previous is not None:
            own += t["driver"] + sum(previous.timings.get(k, 0.0) for k in AFTER_TOKENS)
        durations.append(own)
    features = np.array(features, dtype=np.float64)
    durations = np.array(durations, dtype=np.float64)
    empty = np.array([not r.scheduler_output.scheduled for r in records])
    return features, durations, empty


def driver_arrivals(records: Iterable[StepRecord]) -> np.ndarray:
    """``[n, 3]``: per record with timings (the rows of :func:`measured_steps`), the driver's
    time before it (NaN when not recorded: after idle), the requests that arrived for it and
    their prompt tokens -- what the input processing of arrivals is fitted from."""
    rows = []
    for r in records:
        if not r.timings:
            continue
        arrived = [e.num_prompt_tokens for e in r.request_events if isinstance(e, RequestArrived)]
        rows.append((r.timings.get("driver", np.nan), len(arrived), sum(arrived)))
    return np.array(rows, dtype=np.float64).reshape(-1, 3)
