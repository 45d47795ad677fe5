"""Benchmark: per-step cost of ``schedule()`` + ``update_from_output()`` at N running decode requests.

No model: a fake runner samples a fixed token for every sampling chunk. The N requests
first prefill (not timed); then ``--steps`` pure decode steps are timed, each scheduling
all N requests one token (blocks are allocated as they fill, and, with prefix caching on,
newly full blocks are hashed and cached). Prints one table row per N and event recording
setting: with ``events on`` the KV cache and scheduler log their block and request events and
each step drains them, as the engine does; ``--events both`` (default) measures the two side
by side. ``--why`` (default both) times the step with and without the scheduler's explainer
(:mod:`workbench.core.sched.explain`), and ``--waiting W`` keeps W more requests waiting
behind ``max_num_seqs`` (each one gets a reason every step), so the table shows what recording
the why costs::

    workbench bench scheduler --num-running 64 256 --waiting 256 --events on --why both

``why share`` is the median, over the timed steps, of the fraction of each step spent in the
explainer and its prefix memory (timed inside the step, so a busy machine shifts both alike).

A second table times the runner's preparation of the same decode steps' model inputs (the
:class:`~workbench.worker.batch_inputs.BatchInputs` a forward pass consumes): packed from scratch
(``build_batch_inputs``, one pass over every request) and by the runner's persistent batch
(:class:`~workbench.worker.input_batch.InputBatch`, which applies each step as a diff); both
give the same tensors (checked on every timed step)::

A third table times a whole ``LLMEngine.step()`` at N running decodes, less the runner's
``execute`` (a simulated runner, so no model): the engine's host time per step -- schedule,
update, output processing, the record and its observers -- once with final-only outputs of
token ids (``LLM.generate``'s lean case, the simulator's) and once with streamed text (DELTA,
detokenized: a server's)::

    workbench bench scheduler                      # N = 256 and 1024
    workbench bench scheduler --num-running 64 256 --steps 300 --events on
    workbench bench scheduler --num-running 1 16 64 256 --events off
"""

from __future__ import annotations

import argparse
import statistics
import time

from workbench.core.kv_cache_manager import KVCacheManager, cdiv
from workbench.core.sched.scheduler import Scheduler
from workbench.request import Request
from workbench.sampling_params import RequestOutputKind, SamplingParams
from workbench.utils.heap import frozen_heap, rare_collections
from workbench.worker.batch_inputs import BatchInputs, build_batch_inputs
from workbench.worker.input_batch import InputBatch

FAKE_TOKEN = 7


def _build(n: int, args: argparse.Namespace, record_events: bool, why: bool = True) -> Scheduler:
    budget = max(n, args.max_num_batched_tokens)
    # Room for the prefill steps (early finishers decode meanwhile) and the timed steps,
    # so that no request finishes while timed.
    total_len = args.prompt_len + cdiv(n * args.prompt_len, budget) + args.steps + 8
    num_blocks = (n + getattr(args, "waiting", 0)) * cdiv(total_len, args.block_size)
    kv = KVCacheManager(
        num_blocks, args.block_size, enable_prefix_caching=not args.no_prefix_caching, record_events=record_events
    )
    sched = Scheduler(
        kv,
        max_num_seqs=n,
        max_num_batched_tokens=budget,
        max_model_len=total_len + 1,
        policy=args.policy,
        record_events=record_events,
    )
    if not why:
        sched.explainer.detach()
        sched.explainer = None
    params = SamplingParams(max_tokens=None, ignore_eos=True)
    for i in range(n + getattr(args, "waiting", 0)):
        prompt = [i * 100_003 + j for j in range(args.prompt_len)]  # distinct: no prefix sharing
        sched.add_request(Request(f"r{i}", prompt, params, arrival_time=float(i)))
    return sched


def _fake_runner(out) -> dict[str, int]:
    return {c.request_id: FAKE_TOKEN for c in out.scheduled if c.samples}


def _timed(fn, spent: list[float]):
    """``fn``, adding the seconds each call takes to ``spent[0]``."""
    def call(*a, **kw):
        t0 = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            spent[0] += time.perf_counter() - t0
    return call


def _time_explainer(sched: Scheduler) -> list[float]:
    """Wrap the explainer's entry points (and its prefix memory's) so that the seconds spent
    in them accumulate in the returned one-element list."""
    spent = [0.0]
    explainer = sched.explainer
    explainer.explain_step, explainer.preempting = (_timed(explainer.explain_step, spent),
                                                    _timed(explainer.preempting, spent))
    memory = explainer.memory
    memory.stored, memory.evicted = _timed(memory.stored, spent), _timed(memory.evicted, spent)
    return spent


def _measure(n: int, args: argparse.Namespace, record_events: bool, why: bool = True) -> dict:
    sched = _build(n, args, record_events, why)
    spent = _time_explainer(sched) if why else [0.0]
    shares = []
    # Prefill (untimed) until every request is decoding.
    while True:
        out = sched.schedule()
        sched.update_from_output(out, _fake_runner(out))
        if all(r.num_computed_tokens >= r.num_prompt_tokens for r in sched.running) and len(sched.running) == n:
            break
    t_sched, t_update, totals = [], [], []
    for _ in range(args.steps):
        spent[0] = 0.0
        t0 = time.perf_counter()
        out = sched.schedule()
        t1 = time.perf_counter()
        sampled = _fake_runner(out)
        t2 = time.perf_counter()
        sched.update_from_output(out, sampled)
        if record_events:
            sched.kv_cache.take_events()
            sched.take_events()
        t3 = time.perf_counter()
        shares.append(spent[0] / ((t1 - t0) + (t3 - t2)))
        assert len(out.scheduled) == n and not any(c.is_prefill for c in out.scheduled)
        t_sched.append(t1 - t0)
        t_update.append(t3 - t2)
        totals.append((t1 - t0) + (t3 - t2))
    us = 1e6
    return {
        "running": n,
        "events": "on" if record_events else "off",
        "why": "on" if why else "off",
        "schedule_us": statistics.fmean(t_sched) * us,
        "update_us": statistics.fmean(t_update) * us,
        "total_us": statistics.fmean(totals) * us,
        "p50_us": statistics.median(totals) * us,
        "per_req_us": statistics.fmean(totals) * us / n,
        "why_share": statistics.median(shares),  # of each step's time, in the explainer
    }


def _same(a: BatchInputs, b: BatchInputs) -> bool:
    return a.request_ids == b.request_ids and a.sample_request_ids == b.sample_request_ids and all(
        getattr(a, name).dtype == getattr(b, name).dtype and getattr(a, name).equal(getattr(b, name))
        for name in ("input_ids", "positions", "slot_mapping", "block_tables", "query_start_loc",
                     "seq_lens", "logits_indices"))


def _measure_prepare(n: int, args: argparse.Namespace) -> dict:
    """Per decode step (medians: robust to a busy machine's pauses): ``build_batch_inputs``
    against ``InputBatch.prepare`` (which also sees the untimed prefill steps, as the runner
    does)."""
    sched = _build(n, args, record_events=False)
    batch = InputBatch(args.block_size)
    while True:
        out = sched.schedule()
        batch.prepare(out, sched.requests)
        sched.update_from_output(out, _fake_runner(out))
        if all(r.num_computed_tokens >= r.num_prompt_tokens for r in sched.running) and len(sched.running) == n:
            break
    t_scratch, t_persistent = [], []
    for _ in range(args.steps):
        out = sched.schedule()
        t0 = time.perf_counter()
        scratch = build_batch_inputs(out, args.block_size)
        t1 = time.perf_counter()
        persistent = batch.prepare(out, sched.requests)
        t2 = time.perf_counter()
        if not _same(scratch, persistent):
            raise AssertionError(f"step {out.step}: the persistent batch differs from the rebuild")
        sched.update_from_output(out, _fake_runner(out))
        t_scratch.append(t1 - t0)
        t_persistent.append(t2 - t1)
    return {"running": n, "scratch_us": statistics.median(t_scratch) * 1e6,
            "persistent_us": statistics.median(t_persistent) * 1e6}


#: The engine-step table's output modes: (name, SamplingParams fields).
ENGINE_MODES = (("final, ids", {"output_kind": RequestOutputKind.FINAL_ONLY, "detokenize": False}),
                ("delta, text", {"output_kind": RequestOutputKind.DELTA, "detokenize": True}))


def _measure_engine(n: int, args: argparse.Namespace, mode: dict) -> dict:
    """Host time of a whole ``LLMEngine.step()`` (schedule, update, output processing, the
    record and its observers) at ``n`` running decodes: the step's wall time less the runner's
    ``execute`` (a simulated runner: no model), median over the timed steps, the heap handled
    as ``LLM.generate`` handles it (frozen, refrozen between steps, rare young collections)."""
    from workbench import EngineArgs
    from workbench.lab.sim.cost_model import as_cost_model
    from workbench.lab.sim.simulate import simulated_engine

    budget = max(n, args.max_num_batched_tokens)
    total_len = args.prompt_len + cdiv(n * args.prompt_len, budget) + args.steps + 8
    config = EngineArgs(num_kv_blocks=n * cdiv(total_len, args.block_size), block_size=args.block_size,
                        max_num_seqs=n, max_num_batched_tokens=budget, max_model_len=total_len + 1,
                        enable_prefix_caching=not args.no_prefix_caching,
                        policy=args.policy).create_engine_config()
    engine = simulated_engine(config, as_cost_model(None), {})
    vocab = engine.tokenizer.vocab_size
    params = SamplingParams(max_tokens=total_len - args.prompt_len, ignore_eos=True, **mode)
    for i in range(n):
        prompt = [(i * 7919 + j * 31) % (vocab - 16) + 16 for j in range(args.prompt_len)]
        engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, params)
    runner_s = [0.0]
    engine.runner.execute = _timed(engine.runner.execute, runner_s)
    while not (len(engine.scheduler.running) == n
               and all(r.num_computed_tokens >= r.num_prompt_tokens for r in engine.scheduler.running)):
        engine.step()
    host = []
    with rare_collections(), frozen_heap() as refreeze:  # as LLM.generate and the drivers run the engine
        for _ in range(args.steps):
            refreeze()
            runner_s[0] = 0.0
            t0 = time.perf_counter()
            engine.step()
            host.append(time.perf_counter() - t0 - runner_s[0])
            scheduled = engine.history[-1].scheduler_output.scheduled
            if len(scheduled) != n or any(c.is_prefill for c in scheduled):
                raise AssertionError(f"step {engine.history[-1].step} is not {n} decodes")
    return {"running": n, "host_us": statistics.median(host) * 1e6, "mean_us": statistics.fmean(host) * 1e6}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="workbench bench scheduler",
        description="Per-step cost of Scheduler.schedule() + update_from_output() with N running "
        "decode requests and a fake runner (no model), the runner's input preparation, and the "
        "engine's whole host time per step.",
    )
    parser.add_argument("--num-running", type=int, nargs="+", default=[256, 1024], metavar="N",
                        help="running decode requests per step (default: 256 1024)")
    parser.add_argument("--steps", type=int, default=200, help="timed decode steps (default: 200)")
    parser.add_argument("--prompt-len", type=int, default=128, help="prompt tokens per request")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--policy", default="fcfs", help="fcfs | priority | spf")
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--events", choices=("off", "on", "both"), default="both",
                        help="record block and request events (default: both, side by side)")
    parser.add_argument("--why", choices=("off", "on", "both"), default="both",
                        help="explain each step (reasons, preemptions, prefix lookups; default: both)")
    parser.add_argument("--waiting", type=int, default=0, metavar="W",
                        help="requests kept waiting behind max_num_seqs (default: 0)")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.prompt_len < 1 or args.block_size < 1 or min(args.num_running) < 1:
        parser.error("--steps, --prompt-len, --block-size and --num-running must be >= 1")
    if args.waiting < 0:
        parser.error(f"--waiting must be >= 0, got {args.waiting}")

    print(
        f"scheduler step cost: {args.steps} decode steps, prompt {args.prompt_len} tokens, "
        f"block_size {args.block_size}, policy {args.policy}, "
        f"prefix caching {'off' if args.no_prefix_caching else 'on'}"
    )
    header = (f"{'running':>8} {'events':>7} {'why':>4} {'schedule us':>12} {'update us':>10} {'total us':>9} "
              f"{'p50 us':>8} {'us/request':>11} {'why share':>10}")
    print(header)
    print("-" * len(header))
    settings = {"off": (False,), "on": (True,), "both": (False, True)}[args.events]
    whys = {"off": (False,), "on": (True,), "both": (False, True)}[args.why]
    for n in args.num_running:
        for record_events in settings:
            for why in whys:
                r = _measure(n, args, record_events, why)
                print(
                    f"{r['running']:>8} {r['events']:>7} {r['why']:>4} {r['schedule_us']:>12.1f} {r['update_us']:>10.1f} "
                    f"{r['total_us']:>9.1f} {r['p50_us']:>8.1f} {r['per_req_us']:>11.2f} "
                    f"{100 * r['why_share']:>9.1f}%"
                )
    print("\nrunner preparation: the model inputs of one decode step (BatchInputs), median")
    header = f"{'running':>8} {'from scratch us':>16} {'persistent batch us':>20} {'speed-up':>9}"
    print(header)
    print("-" * len(header))
    for n in args.num_running:
        r = _measure_prepare(n, args)
        print(f"{r['running']:>8} {r['scratch_us']:>16.1f} {r['persistent_us']:>20.1f} "
              f"{r['scratch_us'] / r['persistent_us']:>8.2f}x")
    print("\nengine step host time: LLMEngine.step() less the runner (simulated), per decode step")
    header = f"{'running':>8} {'outputs':>12} {'median us':>10} {'mean us':>9} {'us/request':>11}"
    print(header)
    print("-" * len(header))
    for n in args.num_running:
        for name, mode in ENGINE_MODES:
            r = _measure_engine(n, args, mode)
            print(f"{n:>8} {name:>12} {r['host_us']:>10.1f} {r['mean_us']:>9.1f} {r['host_us'] / n:>11.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
