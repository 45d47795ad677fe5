"""EngineProfiler: ``torch.profiler`` over engine steps, with the engine's stages as ranges.

While it runs, the engine's stages are ``record_function`` ranges in the profile: ``step N``
(the whole ``LLMEngine.step``), ``schedule``, ``execute`` (the runner: inputs, forward,
sampling), ``forward`` (the model's forward pass), ``sample``, ``output`` and ``record``. They
are put in by wrapping the engine's own objects (instance attributes over their methods, a
forward hook on the model) when profiling starts, and taken out when it stops: an engine that
is not being profiled runs exactly its own code.

``stop()`` writes one Chrome trace-event file that Perfetto opens: the torch profile, and
beside it (its own process, ``engine timeline``) the profiled steps' engine timeline from
:mod:`workbench.metrics.perfetto`, shifted so each step starts where its ``step N`` range does.
It prints the top operators by self CPU time (and CUDA time on a GPU), as vLLM's worker does.
"""

from __future__ import annotations

import contextlib
import json
import pathlib
import time

import torch

from workbench.engine.history import TIMING_STAGES
from workbench.metrics.perfetto import trace_events
from workbench.utils.ranges import Ranged

#: The trace process of the engine timeline (far from torch's pids: the OS pid, devices).
TIMELINE_PID = 2**31 - 1


class EngineProfiler:
    """Profiles ``engine`` from :meth:`start` to :meth:`stop`, writing into ``directory``."""

    def __init__(self, engine, directory) -> None:
        self.engine = engine
        self.directory = pathlib.Path(directory)
        self._profile: torch.profiler.profile | None = None
        self._undo: contextlib.ExitStack | None = None
        self._first_step = 0

    @property
    def is_running(self) -> bool:
        return self._profile is not None

    def start(self) -> None:
        if self.is_running:
            raise RuntimeError("The profiler is already running: stop_profile() first.")
        self.directory.mkdir(parents=True, exist_ok=True)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.engine.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._undo = self._install_ranges()
        self._profile = torch.profiler.profile(activities=activities, record_shapes=True, with_stack=False)
        self._profile.start()
        self._first_step = self.engine.scheduler.step_count

    def _install_ranges(self) -> contextlib.ExitStack:
        engine = self.engine
        runner = engine.runner
        undo = contextlib.ExitStack()
        step = engine.step

        def ranged_step():
            with torch.profiler.record_function(f"step {engine.scheduler.step_count}"):
                return step()

        for owner, attr, wrapper in (
            (engine, "step", ranged_step),
            (engine.scheduler, "schedule", Ranged(engine.scheduler.schedule, "schedule")),
            (runner, "execute", Ranged(runner.execute, "execute")),
            (engine.output_processor, "process", Ranged(engine.output_processor.process, "output")),
            (engine, "_record", Ranged(engine._record, "record")),
        ):
            setattr(owner, attr, wrapper)
            undo.callback(delattr, owner, attr)  # the class's method shows through again
        undo.enter_context(runner.profile_ranges())  # the runner's own: forward, sample
        return undo

    def stop(self) -> pathlib.Path:
        """Stop, write the trace (returns its path) and print the top operators."""
        if not self.is_running:
            raise RuntimeError("The profiler is not running: start_profile() first.")
        profile, self._profile = self._profile, None
        try:
            profile.stop()
        finally:
            self._undo.close()
        stamp = time.strftime("%Y%m%d-%H%M%S")
        path = self.directory / f"profile-{stamp}-step{self._first_step}.json"
        raw = path.with_suffix(".torch.json")
        profile.export_chrome_trace(str(raw))
        trace = json.loads(raw.read_text())
        raw.unlink()
        records = [r for r in self.engine.history if r.step >= self._first_step]
        trace["traceEvents"] = trace.get("traceEvents", []) + self._aligned_timeline(trace, records)
        path.write_text(json.dumps(trace))
        sort_by = "self_cuda_time_total" if self.engine.device.type == "cuda" else "self_cpu_time_total"
        print(profile.key_averages().table(sort_by=sort_by, row_limit=15))
        print(f"profile of {len(records)} steps written to {path} (open it in https://ui.perfetto.dev)")
        return path

    @staticmethod
    def _aligned_timeline(trace: dict, records: list) -> list[dict]:
        """The records' engine timeline, shifted onto the torch profile's clock by the first
        step's ``step N`` range (none when no step ran)."""
        if not records:
            return []
        first = f"step {records[0].step}"
        anchor = next((e for e in trace.get("traceEvents", [])
                       if e.get("name") == first and e.get("ph") == "X"), None)
        events = trace_events(records, pid=TIMELINE_PID, name="engine timeline", stages=TIMING_STAGES)
        if anchor is None:
            return events
        mine = next(e for e in events if e.get("name") == first and e.get("ph") == "X")
        offset = float(anchor["ts"]) - mine["ts"]
        for e in events:
            if "ts" in e:
                e["ts"] = round(e["ts"] + offset, 3)
        return events

    def __repr__(self) -> str:
        return f"EngineProfiler({str(self.directory)!r}, running={self.is_running})"
