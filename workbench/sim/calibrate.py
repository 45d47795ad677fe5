"""calibrate(): a designed set of batches on a real engine, timed and fitted into a CostModel.

The design (a :class:`CalibrationGrid`) runs, on one engine, short phases that each fill the
batch one way, so that every feature of :mod:`workbench.sim.features` varies on its own:

* decode: ``b`` requests with one ``c``-token prompt (computed once when prefix caching is
  on), then ``decode_steps`` decode steps (decode sequences x attended context);
* prefill: a ``p``-token prompt after a request that left ``h`` of its tokens in the prefix
  cache, so the chunk is ``p`` tokens at context ``h`` (prefill tokens x context);
* mixed: ``b`` decoding requests while prompts of ``p`` tokens arrive.

Prompts are random token ids (no accidental prefix hits). Cells that do not fit the engine
(``max_num_seqs``, the KV pool, the model length) are left out. Every phase runs ``repeats``
times, the repeats interleaved so that a burst of noise hits one copy only; each step's
duration is the median over the repeats (``aggregate="min"``: the fastest, for a machine that
other work keeps busy), and the fit leaves out steps far from the rest (see
:meth:`CostModel.fit`). A warm-up phase runs first and is
not fitted.
"""

from __future__ import annotations

import dataclasses
import datetime
from dataclasses import dataclass

import numpy as np

from workbench.config import EngineConfig
from workbench.sampling_params import SamplingParams
from workbench.sim.cost_model import UNITS, CostModel, describe_hardware, describe_model
from workbench.sim.features import FEATURES
from workbench.sim.measurements import measured_steps
from workbench.workload import Workload, WorkloadRequest


@dataclass(frozen=True)
class CalibrationGrid:
    """The batches a calibration runs (see the module docstring)."""

    decode_batches: tuple[int, ...] = (1, 4, 16, 32, 64, 128)
    decode_contexts: tuple[int, ...] = (16, 256, 768)
    decode_steps: int = 24
    prefill_lengths: tuple[int, ...] = (16, 128, 512)
    prefill_contexts: tuple[int, ...] = (0, 384)
    mixed: tuple[tuple[int, int], ...] = ((4, 32), (16, 128), (32, 384))
    repeats: int = 3
    idle_arrivals: int = 12  # single requests at an idle engine, for the wake-up cost

    @classmethod
    def tiny(cls) -> CalibrationGrid:
        """A few seconds' grid (tests, a first look)."""
        return cls(decode_batches=(1, 4), decode_contexts=(16, 48), decode_steps=2,
                   prefill_lengths=(16,), prefill_contexts=(0, 32), mixed=((2, 16),), repeats=1,
                   idle_arrivals=3)

    def phases(self, *, max_num_seqs: int, num_tokens: int, max_model_len: int, block_size: int,
               vocab_size: int, seed: int = 0) -> list[tuple[str, Workload]]:
        """``(name, workload)`` per phase, one repeat; cells that do not fit are left out."""
        rng = np.random.default_rng(seed)

        def prompt(n: int) -> tuple[int, ...]:
            return tuple(int(t) for t in rng.integers(3, vocab_size, size=n))

        def req(rid: str, tokens: tuple[int, ...], max_tokens: int, step: int = 0) -> WorkloadRequest:
            # Default output kind and text, as in run_workload: their per-step cost is measured.
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
            return WorkloadRequest(rid, tokens, params, arrival_step=step)

        def fits(seqs: int, tokens: int, longest: int) -> bool:
            return seqs <= max_num_seqs and tokens + seqs * block_size <= num_tokens and longest < max_model_len

        out: list[tuple[str, Workload]] = []
        k = self.decode_steps
        for b in self.decode_batches:
            for c in self.decode_contexts:
                if fits(b, b * (c + k + 1), c + k + 1):
                    # One prompt for all: the first computes it, the others (a step later)
                    # find all but its last block cached, so the phase is mostly decode.
                    shared = prompt(c)
                    out.append((f"decode b={b} c={c}", Workload(
                        [req(f"d{i}", shared, k + 1, step=min(i, 1)) for i in range(b)])))
        for p in self.prefill_lengths:
            for h in self.prefill_contexts:
                if fits(2, 2 * (h + p) + 2, h + p + 1):
                    shared = prompt(h)
                    out.append((f"prefill p={p} h={h}", Workload([
                        req("p0", shared + prompt(p), 1), req("p1", shared + prompt(p), 1, step=2)])))
        for b, p in self.mixed:
            n = k + 8
            if fits(b + 2, b * (32 + n) + 2 * (p + 1), max(32 + n, p + 1)):
                decoders = [req(f"m{i}", prompt(32), n) for i in range(b)]
                arrivals = [req(f"x{j}", prompt(p), 1, step=3 + 3 * j) for j in range(2)]
                out.append((f"mixed b={b} p={p}", Workload(decoders + arrivals)))
        return out


AGGREGATES = {"median": np.median, "min": np.min}


def calibrate(config: EngineConfig | dict | None = None, grid: CalibrationGrid | None = None, *,
              progress: bool = True, seed: int = 0, aggregate: str = "median") -> CostModel:
    """Run ``grid`` (default :class:`CalibrationGrid`) on a real engine built from ``config``
    (as ``run_workload`` takes it) and fit a :class:`CostModel` to the measured steps, each
    step's repeats reduced by ``aggregate`` ("median" or "min")."""
    if aggregate not in AGGREGATES:
        raise ValueError(f"aggregate must be one of {sorted(AGGREGATES)}, got {aggregate!r}.")
    from tqdm.auto import tqdm

    from workbench.run import resolve_config
    from workbench.engine import LLMEngine

    grid = grid or CalibrationGrid()
    engine = LLMEngine(resolve_config(config))
    mc = engine.model_config
    phases = grid.phases(
        max_num_seqs=engine.scheduler.max_num_seqs, num_tokens=engine.kv_cache.num_blocks * engine.kv_cache.block_size,
        max_model_len=mc.max_model_len, block_size=engine.kv_cache.block_size, vocab_size=mc.vocab_size, seed=seed)
    if not phases:
        raise ValueError("calibration grid: no phase fits this engine (max_num_seqs, KV pool, model length).")
    engine.replay(phases[0][1])  # warm-up: first-touch allocations, caches; not fitted
    runs: dict[str, list] = {name: [] for name, _ in phases}
    with tqdm(total=len(phases) * grid.repeats, desc="calibrating", unit="phase", disable=not progress) as bar:
        for _ in range(grid.repeats):
            for name, workload in phases:
                bar.set_postfix_str(name)
                runs[name].append(measured_steps(engine.replay(workload).history))
                engine.reset_prefix_cache()  # the next repeat's prefill finds nothing cached
                bar.update(1)
    x, y, empty = (np.concatenate(parts) for parts in zip(*(_reduce_repeats(r, AGGREGATES[aggregate])
                                                             for r in runs.values())))
    day = datetime.date.today().isoformat()
    model = CostModel.fit_measured(
        x[~empty], y[~empty], y[empty],
        hardware=describe_hardware(engine.device),
        model=describe_model(mc, block_size=engine.kv_cache.block_size, attention_backend=engine.attention_backend),
        note=f"calibrated by `workbench calibrate` ({len(phases)} phases, {aggregate} of {grid.repeats} repeats "
             f"per step) on {day}",
    )
    wake = measure_wake(engine, model, grid.idle_arrivals, seed=seed)
    return dataclasses.replace(model, wake_s=wake)


def measure_wake(engine, model: CostModel, num_arrivals: int, *, seed: int = 0) -> float:
    """``CostModel.wake_s``: text requests (32..256 tokens of the corpus, tokenized on arrival
    as a served request is) arriving one by one at an idle engine (wall clock, 25 ms apart),
    each alone in its first step; the median of (measured time to first token - the model's
    prediction of that step), at least 0."""
    drawn = Workload.poisson(num_arrivals, rate=40.0, input_len=(32, 256), output_len=2, seed=seed + 1)
    workload = Workload([dataclasses.replace(r, request_id=f"idle{i}", arrival_time=0.025 * i, arrival_step=None)
                         for i, r in enumerate(drawn)])
    run = engine.replay(workload, clock="wall")
    engine.reset_prefix_cache()
    steps = {r.step: r for r in run.history}
    extra = [row.ttft_s - model.predict(steps[row.first_token_step])
             for row in run.requests.itertuples() if row.first_token_step in steps]
    return max(0.0, float(np.median(extra))) if extra else 0.0


def _reduce_repeats(repeats: list[tuple[np.ndarray, np.ndarray, np.ndarray]], reduce):
    """One phase's repeats -> per step ``reduce`` of its durations (the schedule is the same
    every repeat: same workload, step clock, empty prefix cache); all steps if it was not."""
    xs, ys, empties = zip(*repeats)
    if all(x.shape == xs[0].shape and (x == xs[0]).all() for x in xs):
        return xs[0], reduce(np.stack(ys), axis=0), empties[0]
    return np.concatenate(xs), np.concatenate(ys), np.concatenate(empties)


def coefficient_table(model: CostModel) -> str:
    """The coefficients and the fit's residuals as plain text."""
    lines = [f"{'feature':<18} {'coefficient':>12}  unit"]
    lines += [f"{f:<18} {model.coefficients[f]:>12.4g}  {UNITS[f]}" for f in FEATURES]
    lines.append(f"{'empty step':<18} {model.empty_step_s:>12.4g}  s")
    lines.append(f"{'wake-up after idle':<18} {model.wake_s:>12.4g}  s")
    if model.fit_stats:
        lines.append("fit: " + ", ".join(f"{k}={v:.4g}" for k, v in model.fit_stats.items()))
    return "\n".join(lines)
