"""The effect of a passing ``schedule()`` (exercises 1 and 4) in the simulator: TTFT and TPOT.

The learner's function drives a batch-level loop on a larger workload (Poisson arrivals from a
fixed seed), and the reference drives the same loop beside it: each step the function picks the
batch from the queues, the step lasts what the shipped cost model predicts for that batch (its
prefill and decode features, as :func:`~workbench.lab.sim.features.step_features` counts them),
and a request samples a token whenever all its known tokens are computed. The KV pool is taken
as large enough for every request (as in the grader), so no preemption.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from workbench.exercises.batching import (RequestView, _as_batch, admission_reference, check_batches,
                                          chunked_prefill_reference)
from workbench.exercises.grader import CheckResult
from workbench.lab.sim.cost_model import as_cost_model


@dataclass
class _Req:
    request_id: str
    arrival: float
    num_prompt_tokens: int
    max_tokens: int
    num_tokens: int = 0
    num_computed_tokens: int = 0
    token_times: list | None = None

    def view(self) -> RequestView:
        return RequestView(self.request_id, self.num_prompt_tokens, self.num_tokens, self.num_computed_tokens)


@dataclass(frozen=True)
class EffectWorkload:
    """``num_requests`` Poisson arrivals at ``rate`` per second, prompt and output lengths
    uniform in the given ranges, all drawn from ``seed``; the scheduler's two limits."""

    num_requests: int = 80
    rate: float = 150.0
    prompt_len: tuple[int, int] = (8, 64)
    output_len: tuple[int, int] = (4, 16)
    max_num_batched_tokens: int = 64
    max_num_seqs: int = 8
    seed: int = 35

    def requests(self) -> list[_Req]:
        rng = np.random.default_rng(self.seed)
        arrivals = np.cumsum(rng.exponential(1.0 / self.rate, self.num_requests))
        prompts = rng.integers(self.prompt_len[0], self.prompt_len[1] + 1, self.num_requests)
        outputs = rng.integers(self.output_len[0], self.output_len[1] + 1, self.num_requests)
        return [_Req(f"r{i}", float(a), int(p), int(o), int(p), 0, [])
                for i, (a, p, o) in enumerate(zip(arrivals, prompts, outputs))]

    def __str__(self) -> str:
        return (f"{self.num_requests} requests at {self.rate:g}/s, prompts {self.prompt_len[0]}-{self.prompt_len[1]} "
                f"tokens, outputs {self.output_len[0]}-{self.output_len[1]}, max_num_batched_tokens="
                f"{self.max_num_batched_tokens}, max_num_seqs={self.max_num_seqs}")


#: The larger workload of each exercise, by ``enable_chunked_prefill``: with it on, prompts
#: reach two and a half budgets.
EFFECT_WORKLOADS = {False: EffectWorkload(), True: EffectWorkload(prompt_len=(16, 160))}


def drive(schedule: Callable, workload: EffectWorkload, cost_model=None) -> dict[str, float]:
    """Run ``workload`` with ``schedule`` picking every batch; TTFT and TPOT p50 / p99 in ms.
    ValueError when a batch is malformed or the run stops making progress."""
    model = as_cost_model(cost_model)
    pending = workload.requests()
    done, running, waiting = [], [], []
    budget, max_num_seqs = workload.max_num_batched_tokens, workload.max_num_seqs
    now, after_prefill, step = 0.0, False, 0
    while pending or running or waiting:
        if not running and not waiting:
            now = max(now, pending[0].arrival)
        while pending and pending[0].arrival <= now:
            waiting.append(pending.pop(0))
        batch = _as_batch(step, schedule([r.view() for r in running], [r.view() for r in waiting], budget,
                                         max_num_seqs))
        known = {r.request_id: r for r in running + waiting}
        if not batch or any(rid not in known or n > known[rid].num_tokens - known[rid].num_computed_tokens
                            for rid, n in batch.items()):
            raise ValueError(f"step {step}: the batch {batch} schedules nothing or more than is left to compute.")
        features = dict.fromkeys(("prefill_tokens", "prefill_chunks", "decode_seqs", "decode_context",
                                  "prefill_attention"), 0.0)
        for rid, q in batch.items():
            r = known[rid]
            if r.num_computed_tokens < r.num_prompt_tokens:
                features["prefill_tokens"] += q
                features["prefill_chunks"] += 1
                features["prefill_attention"] += q * (r.num_computed_tokens + (q + 1) / 2)
            else:
                features["decode_seqs"] += 1
                features["decode_context"] += r.num_computed_tokens + q
        features.update(step=1.0, prefill_step=1.0 if features["prefill_chunks"] else 0.0,
                        decode_seqs_sqrt=features["decode_seqs"] ** 0.5, after_prefill=1.0 if after_prefill else 0.0)
        now += model.predict(features)
        after_prefill = bool(features["prefill_chunks"])
        running += [r for r in waiting if r.request_id in batch]
        waiting = [r for r in waiting if r.request_id not in batch]
        for rid, q in batch.items():
            r = known[rid]
            r.num_computed_tokens += q
            if r.num_computed_tokens == r.num_tokens:
                r.num_tokens += 1
                r.token_times.append(now)
        for r in [r for r in running if len(r.token_times) >= r.max_tokens]:
            running.remove(r)
            done.append(r)
        step += 1
    ttft = [r.token_times[0] - r.arrival for r in done]
    tpot = [(r.token_times[-1] - r.token_times[0]) / (len(r.token_times) - 1) for r in done if len(r.token_times) > 1]
    return {"ttft_p50": 1e3 * float(np.percentile(ttft, 50)), "ttft_p99": 1e3 * float(np.percentile(ttft, 99)),
            "tpot_p50": 1e3 * float(np.percentile(tpot, 50)), "tpot_p99": 1e3 * float(np.percentile(tpot, 99))}


def effect_table(solution: Callable, reference: Callable, workload: EffectWorkload) -> str:
    """Yours beside the reference: TTFT and TPOT p50 / p99 (ms), or why yours could not run."""
    head = f"  {'':<11}{'TTFT p50':>10}{'TTFT p99':>10}{'TPOT p50':>10}{'TPOT p99':>10}   (ms)"
    rows = []
    for label, fn in (("yours", solution), ("reference", reference)):
        try:
            m = drive(fn, workload)
        except Exception as exc:  # the learner's code on a workload the grader did not draw
            rows.append(f"  {label:<11}could not run: {type(exc).__name__}: {exc}")
            continue
        rows.append(f"  {label:<11}{m['ttft_p50']:>10.2f}{m['ttft_p99']:>10.2f}{m['tpot_p50']:>10.2f}"
                    f"{m['tpot_p99']:>10.2f}")
    return f"On a larger workload ({workload}, simulated):\n" + "\n".join([head] + rows)


def check_with_effect(name: str, solution: Callable, enable_chunked_prefill: bool, *, with_effect: bool = True,
                      **options) -> CheckResult:
    """:func:`~workbench.exercises.batching.check_batches`; on success (``with_effect``) its
    message ends with the solution's TTFT and TPOT beside the reference's on a larger workload."""
    result = check_batches(name, solution, enable_chunked_prefill, **options)
    if result.passed and with_effect:
        reference = chunked_prefill_reference if enable_chunked_prefill else admission_reference
        result.message += "\n" + effect_table(solution, reference, EFFECT_WORKLOADS[enable_chunked_prefill])
    return result
