"""calibrate(): a designed set of batches on a real engine, timed and fitted into a CostModel.

The design (a :class:`CalibrationGrid`) runs, on one engine, short phases that each fill the
batch one way, so that every feature of :mod:`workbench.lab.sim.features` varies on its own:

* decode: ``b`` requests with ``c``-token prompts of their own (prefilled in a few chunked
  steps), then ``decode_steps`` decode steps (decode sequences x attended context);
* prefill: a ``p``-token prompt after a request that left ``h`` of its tokens in the prefix
  cache, so the chunk is ``p`` tokens at context ``h`` (prefill tokens x context);
* mixed: ``b`` decoding requests while prompts of ``p`` tokens arrive;
* speculation (only with ``speculative_config``): ``b`` requests with corpus prompts and
  ``SPEC_OUTPUT`` output tokens each, long enough for the model's text to recur, so that
  prompt lookup finds drafts in a good share of the steps (a draft model drafts in every
  one): decode steps that verify drafts beside steps that do not, for the spec features;
* traffic: Poisson arrivals on the wall clock (``rate`` per second), prompts of 48..600
  tokens in three shared-prefix groups, 1..64 output tokens: the batches of real serving
  (decode sequences of different lengths, lone prefills after idle gaps, warm and cold steps)
  that the designed cells do not make.

With ``lora=True`` the engine serves the shipped adapters (errors and timon, each also under a
second name: four adapters, ``max_loras=2`` device slots) and LoRA phases follow the designed
ones: decodes of ``b`` requests under one adapter, under two, and mixed with the base model,
and single prefills under an adapter, each phase's adapters rotating so that some steps load
an adapter into a slot (counted by :class:`~workbench.lab.sim.lora_slots.LoRASlots`).

Prompts are random token ids (no accidental prefix hits outside the groups). Cells that do not
fit the engine (``max_num_seqs``, the KV pool, the model length) are left out. Every designed
phase runs ``repeats`` times, the repeats interleaved so that a burst of noise hits one copy
only; each step's duration is the median over the repeats (``aggregate="min"``: the fastest,
for a machine that other work keeps busy). Traffic phases run once, after them: their steps
are samples of their own. A warm-up phase runs first and is not fitted.
"""

from __future__ import annotations

import dataclasses
import datetime
from dataclasses import dataclass

import numpy as np

from workbench.config import EngineConfig
from workbench.engine.llm_engine import LLMEngine
from workbench.lab.corpus_prompts import PromptCutter
from workbench.lab.replay import replay_workload
from workbench.lab.run import resolve_config
from workbench.lab.sim.cost_model import UNITS, CostModel, describe_hardware, describe_model, nonnegative_lstsq
from workbench.lab.sim.features import FEATURES
from workbench.lab.sim.lora_slots import LoRASlots
from workbench.lab.sim.measurements import driver_arrivals, measured_steps
from workbench.lab.workload import Workload, WorkloadRequest
from workbench.lora.request import LoRARequest
from workbench.model.loader import EMBEDDED_LORAS, embedded_lora_path
from workbench.sampling_params import SamplingParams


@dataclass(frozen=True)
class CalibrationGrid:
    """The batches a calibration runs (see the module docstring)."""

    decode_batches: tuple[int, ...] = (1, 4, 16, 32, 64, 128)
    decode_contexts: tuple[int, ...] = (16, 256, 768)
    decode_steps: int = 24
    prefill_lengths: tuple[int, ...] = (8, 24, 64, 160, 400, 768)
    prefill_contexts: tuple[int, ...] = (0, 256)
    mixed: tuple[tuple[int, int], ...] = ((4, 32), (16, 128), (32, 384))
    spec_batches: tuple[int, ...] = (1, 4, 16)  # speculating decode batches (with speculative_config)
    traffic: tuple[tuple[float, int], ...] = ((3.0, 20), (10.0, 40))  # (requests/s, requests)
    repeats: int = 3
    idle_arrivals: int = 6  # single requests at an idle engine per idle gap, for the wake-up cost
    idle_gaps: tuple[float, ...] = (0.01, 0.03, 0.1, 0.3)  # seconds
    lora_batches: tuple[int, ...] = (1, 4, 16, 32)  # with lora=True: decode batches under adapters
    lora_prefill_lengths: tuple[int, ...] = (16, 64, 256)

    @classmethod
    def tiny(cls) -> CalibrationGrid:
        """A few seconds' grid (tests, a first look)."""
        return cls(decode_batches=(1, 4), decode_contexts=(16, 48), decode_steps=2,
                   prefill_lengths=(16,), prefill_contexts=(0, 32), mixed=((2, 16),), spec_batches=(1, 2),
                   traffic=((40.0, 4),), repeats=1, idle_arrivals=3, idle_gaps=(0.01, 0.05),
                   lora_batches=(1, 4), lora_prefill_lengths=(16,))

    def lora_phases(self, adapters, *, vocab_size: int, seed: int = 0) -> list[tuple[str, Workload]]:
        """``(name, workload)`` per LoRA phase over ``adapters`` (LoRARequests, at least 3 so
        that two slots must reload): per batch size one adapter, two, and two with the base
        model, then single prefills; phase ``j`` starts its adapters at ``adapters[j % n]``."""
        rng = np.random.default_rng(seed + 7)
        params = SamplingParams(temperature=0.0, max_tokens=self.decode_steps + 1, ignore_eos=True)
        out: list[tuple[str, Workload]] = []

        def phase(name: str, b: int, loras: list, prompt_len: int, max_tokens: int | None = None) -> None:
            p = params if max_tokens is None else dataclasses.replace(params, max_tokens=max_tokens)
            requests = [WorkloadRequest(f"l{i}", tuple(int(t) for t in rng.integers(3, vocab_size, size=prompt_len)),
                                        p, arrival_step=0, lora_request=loras[i % len(loras)]) for i in range(b)]
            out.append((name, Workload(requests)))

        n = len(adapters)
        for b in self.lora_batches:
            for kind, count, base in (("1 adapter", 1, False), ("2 adapters", 2, False), ("2 adapters + base", 2, True)):
                first = len(out)
                loras = [adapters[(first + i) % n] for i in range(count)] + ([None] if base else [])
                phase(f"lora decode b={b} {kind}", b, loras, 32)
        for p in self.lora_prefill_lengths:
            phase(f"lora prefill p={p}", 1, [adapters[len(out) % n]], p, max_tokens=1)
        return out

    def traffic_phases(self, *, max_model_len: int, seed: int = 0) -> list[tuple[str, Workload]]:
        """``(name, workload)`` per traffic phase: wall-clock arrivals, text prompts of the
        corpus (tokenized on arrival, as served requests are), exact output lengths."""
        longest = max(49, min(600, max_model_len - 65))
        return [(f"traffic {rate:g}/s", Workload.poisson(
            n, rate=rate, input_len=(48, longest), output_len=(1, 64), num_prefix_groups=3, prefix_len=32,
            seed=seed + 10 + i, clock="wall", id_prefix=f"t{i}_")) for i, (rate, n) in enumerate(self.traffic)]

    def phases(self, *, max_num_seqs: int, num_tokens: int, max_model_len: int, block_size: int,
               vocab_size: int, seed: int = 0, speculative: bool = False,
               tokenizer=None) -> list[tuple[str, Workload]]:
        """``(name, workload)`` per designed phase (step clock), one repeat; cells that do not
        fit are left out; the speculation phases only when ``speculative`` (their prompts cut
        from the corpus with ``tokenizer``, None: the embedded model's)."""
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
                    # A prompt of its own for each: decode attention reads b distinct contexts,
                    # as in serving (a shared one would stay in the CPU's cache).
                    out.append((f"decode b={b} c={c}", Workload(
                        [req(f"d{i}", prompt(c), k + 1) for i in range(b)])))
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
        if speculative:
            cutter = PromptCutter(tokenizer, rng, text=False)
            for b in self.spec_batches:
                if fits(b, b * (64 + SPEC_OUTPUT + 1), 64 + SPEC_OUTPUT + 1):
                    out.append((f"spec b={b}", Workload(
                        [req(f"s{i}", cutter.prompt(64), SPEC_OUTPUT) for i in range(b)])))
        return out


AGGREGATES = {"median": np.median, "min": np.min}
#: Output tokens of each request of a speculation phase.
SPEC_OUTPUT = 48
#: Device slots of a LoRA calibration (``max_loras``): fewer than its four adapters, so some load.
LORA_SLOTS = 2


def calibrate(config: EngineConfig | dict | None = None, grid: CalibrationGrid | None = None, *,
              progress: bool = True, seed: int = 0, aggregate: str = "median", lora: bool = False) -> CostModel:
    """Run ``grid`` (default :class:`CalibrationGrid`) on a real engine built from ``config``
    (as ``run_workload`` takes it) and fit a :class:`CostModel` to the measured steps, each
    step's repeats reduced by ``aggregate`` ("median" or "min"). ``lora``: add the LoRA
    phases (the engine gets ``enable_lora``, ``max_loras=2``; see the module docstring), so
    that the ``lora_*`` coefficients are fitted; without, they stay 0."""
    if aggregate not in AGGREGATES:
        raise ValueError(f"aggregate must be one of {sorted(AGGREGATES)}, got {aggregate!r}.")
    from tqdm.auto import tqdm

    grid = grid or CalibrationGrid()
    config = resolve_config(config)
    if lora:
        config = dataclasses.replace(config, enable_lora=True, max_loras=LORA_SLOTS,
                                     max_cpu_loras=max(config.max_cpu_loras or 0, 2 * len(EMBEDDED_LORAS)))
    engine = LLMEngine(config)
    mc = engine.model_config
    phases = grid.phases(
        max_num_seqs=engine.scheduler.max_num_seqs, num_tokens=engine.kv_cache.num_blocks * engine.kv_cache.block_size,
        max_model_len=mc.max_model_len, block_size=engine.kv_cache.block_size, vocab_size=mc.vocab_size, seed=seed,
        speculative=engine.config.speculative_config is not None, tokenizer=engine.tokenizer)
    if not phases:
        raise ValueError("calibration grid: no phase fits this engine (max_num_seqs, KV pool, model length).")
    slots = None
    if lora:
        names = [(name, suffix) for suffix in ("", "-b") for name in EMBEDDED_LORAS]
        adapters = [LoRARequest(f"{name}{suffix}", i + 1, str(embedded_lora_path(name)))
                    for i, (name, suffix) in enumerate(names)]
        for adapter in adapters:
            engine.add_lora(adapter)  # read from disk now: a step's load is a copy into a slot
        phases += grid.lora_phases(adapters, vocab_size=mc.vocab_size, seed=seed)
        slots = LoRASlots(LORA_SLOTS)  # the engine's device slots, followed step by step
    traffic = grid.traffic_phases(max_model_len=mc.max_model_len, seed=seed)
    replay_workload(engine, phases[0][1])  # warm-up: first-touch allocations, caches; not fitted
    runs: dict[str, list] = {name: [] for name, _ in phases}
    with tqdm(total=len(phases) * grid.repeats + len(traffic), desc="calibrating", unit="phase",
              disable=not progress) as bar:
        for _ in range(grid.repeats):
            for name, workload in phases:
                bar.set_postfix_str(name)
                runs[name].append(measured_steps(replay_workload(engine, workload).history, slots))
                engine.reset_prefix_cache()  # the next repeat's prefill finds nothing cached
                bar.update(1)
        traffic_runs = []
        for name, workload in traffic:
            bar.set_postfix_str(name)
            traffic_runs.append(replay_workload(engine, workload))
            engine.reset_prefix_cache()
            bar.update(1)
    input_s = (0.0, 0.0)
    if traffic_runs:
        steps, input_s = _traffic_steps(traffic_runs)
        runs["traffic"] = [steps]
    x, y, empty = (np.concatenate(parts) for parts in zip(*(_reduce_repeats(r, AGGREGATES[aggregate])
                                                             for r in runs.values())))
    day = datetime.date.today().isoformat()
    model = CostModel.fit_measured(
        x[~empty], y[~empty], y[empty],
        hardware=describe_hardware(engine.device),
        model=describe_model(mc, block_size=engine.kv_cache.block_size, attention_backend=engine.attention_backend),
        note=f"calibrated by `workbench calibrate{' --lora' if lora else ''}"
             f"{' --async-scheduling' if config.async_scheduling else ''}` ({len(phases)} designed phases, {aggregate} of {grid.repeats} "
             f"repeats per step, {len(traffic)} traffic phases) on {day}",
    )
    model = dataclasses.replace(model, input_s=input_s, async_scheduling=config.async_scheduling)
    return dataclasses.replace(model, wake_s=measure_wake(engine, model, grid.idle_arrivals, gaps=grid.idle_gaps,
                                                          seed=seed, runs=traffic_runs))


def _traffic_steps(runs) -> tuple[tuple[np.ndarray, np.ndarray, np.ndarray], tuple[float, float]]:
    """The traffic runs' measured steps, with the input processing of the text prompts that
    arrived before a step taken out of its duration (the simulator charges it on its own), and
    that cost (:func:`fit_input_cost`)."""
    records = [list(run.history) for run in runs]
    x, y, empty = (np.concatenate(parts) for parts in zip(*(measured_steps(r) for r in records)))
    arrivals = np.concatenate([driver_arrivals(r) for r in records])
    input_s = fit_input_cost(arrivals)
    recorded = ~np.isnan(arrivals[:, 0])
    y = y - np.where(recorded, input_s[0] * arrivals[:, 1] + input_s[1] * arrivals[:, 2], 0.0)
    return (x, np.maximum(y, 1e-6), empty), input_s


def fit_input_cost(arrivals: np.ndarray) -> tuple[float, float]:
    """``CostModel.input_s`` from :func:`driver_arrivals` rows: non-negative least squares of the
    driver's time on (1, arrivals, their prompt tokens) over the steps it was recorded for."""
    rows = arrivals[~np.isnan(arrivals[:, 0])]
    if not (rows[:, 1] > 0).any():
        return (0.0, 0.0)
    design = np.column_stack([np.ones(len(rows)), rows[:, 1], rows[:, 2]])
    coef = nonnegative_lstsq(design, rows[:, 0])
    return (float(coef[1]), float(coef[2]))


def measure_wake(engine, model: CostModel, num_arrivals: int, *, gaps: tuple[float, ...] = (0.025,),
                 seed: int = 0, runs=()) -> float:
    """``CostModel.wake_s``: the median, over requests that found the engine idle, of (measured
    time to first token - its input processing - the model's prediction of its first step),
    at least 0. The requests: those of ``runs`` (e.g. the traffic phases) and text requests
    (32..256 corpus tokens, tokenized on arrival as a served request is) reaching the idle
    engine one by one, ``num_arrivals`` after each idle gap of ``gaps``. (With the engine's
    worker threads kept awake, ``EngineConfig.keep_warm_s``, the gap's length hardly matters.)"""
    drawn = Workload.poisson(num_arrivals * len(gaps), rate=40.0, input_len=(32, 256), output_len=2, seed=seed + 1)
    arrivals, t = [], 0.0
    for i, r in enumerate(drawn):
        t += gaps[i // num_arrivals] + 0.03  # a request is served in a few steps (< 30 ms here)
        arrivals.append(dataclasses.replace(r, request_id=f"idle{i}", arrival_time=t, arrival_step=None))
    runs = [*runs, replay_workload(engine, Workload(arrivals, clock="wall"))]
    engine.reset_prefix_cache()
    extra = []
    for run in runs:
        steps = {r.step: r for r in run.history}
        for row in run.requests.itertuples():
            first = steps.get(row.first_token_step)
            if first is not None and "driver" not in first.timings and row.first_scheduled_step == row.first_token_step:
                extra.append(row.ttft_s - model.input_cost([row.num_prompt_tokens]) - model.predict(first))
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
    lines.append(f"{'text prompt input':<18} {model.input_s[0]:>12.4g}  s per request")
    lines.append(f"{'':<18} {model.input_s[1]:>12.4g}  s per prompt token")
    if model.fit_stats:
        lines.append("fit: " + ", ".join(f"{k}={v:.4g}" for k, v in model.fit_stats.items()))
    return "\n".join(lines)
