"""Online serving benchmark against any OpenAI-compatible server (ours, or vLLM's).

``workbench bench serve --base-url http://127.0.0.1:8000 [--request-rate 8 --max-concurrency
16 --num-prompts 96 --input-len-range 32:192 --output-len-range 32:128 --output-json PATH]``

Each request is a streamed ``/v1/completions`` call whose prompt is a list of token ids and
which must generate exactly its output length (``ignore_eos``, ``min_tokens``, greedy). Requests
are sent at ``--request-rate`` per second (Poisson arrivals, or evenly spaced with
``--arrival fixed``; ``inf`` sends them all at once), at most ``--max-concurrency`` in flight.

Per request: TTFT (time to the first token), TPOT ((e2e - TTFT) / (output tokens - 1)), ITL
(the gaps between streamed chunks) and e2e latency; reported at p50/p90/p99 with the mean.
Throughput is tokens over the benchmark's wall time; goodput counts the requests that meet
every ``--goodput`` SLO (e.g. ``--goodput ttft:500 tpot:50``, milliseconds).

``--compare-multiprocessing`` serves the workbench itself instead (``--base-url`` unused):
a server on 127.0.0.1 with the engine in process, then one with the engine core in a child
process (``multiprocess_mode``, vLLM V1's layout), each warmed by one request and given the
same workload; the two summaries print side by side, so the ZMQ boundary's cost shows in
TTFT and ITL. The engine options (``--num-kv-blocks``, ``--max-num-seqs``...) apply to both.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import random
import sys
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from workbench.benchmarks.datasets import BenchRequest, add_workload_args, sample_requests

PERCENTILES = (50, 90, 99)
SLO_METRICS = ("ttft", "tpot", "e2el")


@dataclass
class RequestResult:
    """What one request measured (seconds); ``error`` is set when it failed."""

    prompt_len: int
    output_len: int = 0
    ttft: float = 0.0
    e2el: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str | None = None

    @property
    def tpot(self) -> float | None:
        return (self.e2el - self.ttft) / (self.output_len - 1) if self.output_len > 1 else None


def parse_goodput(items: list[str]) -> dict[str, float]:
    """``["ttft:500", "tpot:50"]`` -> {"ttft": 0.5, "tpot": 0.05} (seconds)."""
    slos = {}
    for item in items:
        name, _, value = item.partition(":")
        if name not in SLO_METRICS:
            raise ValueError(f"--goodput metric must be one of {', '.join(SLO_METRICS)}, got {name!r}.")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"--goodput {name} needs a number of milliseconds, got {value!r}.") from None
        if ms <= 0:
            raise ValueError(f"--goodput {name} must be > 0 ms, got {ms}.")
        slos[name] = ms / 1000
    return slos


def arrival_gaps(n: int, rate: float, arrival: str, seed: int) -> list[float]:
    """Seconds to wait before each request: exponential gaps (Poisson) or 1/rate; 0 at inf."""
    if rate == float("inf"):
        return [0.0] * n
    rng = random.Random(seed)
    return [rng.expovariate(rate) if arrival == "poisson" else 1.0 / rate for _ in range(n)]


async def _one_request(client, url: str, model: str, request: BenchRequest, headers: dict,
                       semaphore: asyncio.Semaphore | None) -> RequestResult:
    payload = {"model": model, "prompt": list(request.prompt_token_ids), "max_tokens": request.output_len,
               "min_tokens": request.output_len, "ignore_eos": True, "temperature": 0.0,
               "stream": True, "stream_options": {"include_usage": True}}
    result = RequestResult(prompt_len=len(request.prompt_token_ids))
    if semaphore is not None:
        await semaphore.acquire()
    try:
        start = last = time.perf_counter()
        chunks = 0
        async with client.stream("POST", url, json=payload, headers=headers) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode(errors="replace")
                result.error = f"HTTP {response.status_code}: {body[:200]}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                message = json.loads(data)
                if message.get("usage"):
                    result.output_len = message["usage"].get("completion_tokens", chunks)
                if not any(c.get("text") for c in message.get("choices") or []):
                    continue
                now = time.perf_counter()
                if chunks == 0:
                    result.ttft = now - start
                else:
                    result.itl.append(now - last)
                last = now
                chunks += 1
        result.e2el = time.perf_counter() - start
        result.output_len = result.output_len or chunks
    except Exception as exc:  # a failed request is a result, not the end of the benchmark
        result.error = f"{type(exc).__name__}: {exc}"
    finally:
        if semaphore is not None:
            semaphore.release()
    return result


async def run_benchmark(base_url: str, model: str, requests: list[BenchRequest], *,
                        request_rate: float = float("inf"), arrival: str = "poisson",
                        max_concurrency: int | None = None, seed: int = 0, api_key: str | None = None,
                        progress: bool = True, timeout_s: float = 600.0) -> tuple[list[RequestResult], float]:
    """Send every request on its schedule; returns the results (in request order) and wall time."""
    import httpx
    from tqdm.auto import tqdm

    url = base_url.rstrip("/") + "/v1/completions"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    limits = httpx.Limits(max_connections=max_concurrency or len(requests), max_keepalive_connections=None)
    bar = tqdm(total=len(requests), disable=not progress, desc="requests", unit="req")
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits, trust_env=False) as client:
        async def tracked(req: BenchRequest) -> RequestResult:
            res = await _one_request(client, url, model, req, headers, semaphore)
            bar.update(1)
            return res

        tasks = []
        start = time.perf_counter()
        for req, gap in zip(requests, arrival_gaps(len(requests), request_rate, arrival, seed)):
            if gap:
                await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(tracked(req)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    bar.close()
    return list(results), duration


def summarize(results: list[RequestResult], duration: float, slos: dict[str, float]) -> dict:
    """Throughput, goodput and latency percentiles (milliseconds) over the successful requests."""
    ok = [r for r in results if r.error is None]
    summary = {
        "duration_s": round(duration, 3), "completed": len(ok), "failed": len(results) - len(ok),
        "total_input_tokens": sum(r.prompt_len for r in ok),
        "total_output_tokens": sum(r.output_len for r in ok),
        "request_throughput": round(len(ok) / duration, 3),
        "output_throughput": round(sum(r.output_len for r in ok) / duration, 1),
        "total_token_throughput": round(sum(r.prompt_len + r.output_len for r in ok) / duration, 1),
    }
    values = {"ttft": [r.ttft for r in ok], "tpot": [r.tpot for r in ok if r.tpot is not None],
              "itl": [x for r in ok for x in r.itl], "e2el": [r.e2el for r in ok]}
    for name, xs in values.items():
        arr = np.asarray(xs, dtype=float) * 1000
        summary[f"mean_{name}_ms"] = round(float(arr.mean()), 2) if arr.size else None
        for p in PERCENTILES:
            summary[f"p{p}_{name}_ms"] = round(float(np.percentile(arr, p)), 2) if arr.size else None
    if slos:
        good = [r for r in ok if all(
            (getattr(r, m) if m != "tpot" else (r.tpot or 0.0)) <= limit for m, limit in slos.items())]
        summary["goodput_slos_ms"] = {m: v * 1000 for m, v in slos.items()}
        summary["good_requests"] = len(good)
        summary["request_goodput"] = round(len(good) / duration, 3)
    errors = sorted({r.error for r in results if r.error})
    if errors:
        summary["errors"] = errors[:5]
    return summary


def format_summary(summary: dict) -> str:
    lines = [f"{'completed / failed requests':<34}{summary['completed']} / {summary['failed']}",
             f"{'duration (s)':<34}{summary['duration_s']}",
             f"{'request throughput (req/s)':<34}{summary['request_throughput']}",
             f"{'output throughput (tok/s)':<34}{summary['output_throughput']}",
             f"{'total token throughput (tok/s)':<34}{summary['total_token_throughput']}"]
    if "request_goodput" in summary:
        lines.append(f"{'request goodput (req/s)':<34}{summary['request_goodput']}  "
                     f"({summary['good_requests']} met {summary['goodput_slos_ms']})")
    lines.append(f"{'latency (ms)':<12}{'mean':>10}" + "".join(f"{'p' + str(p):>10}" for p in PERCENTILES))
    for name, label in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2E")):
        cells = [summary[f"mean_{name}_ms"]] + [summary[f"p{p}_{name}_ms"] for p in PERCENTILES]
        lines.append(f"{label:<12}" + "".join(f"{'-' if c is None else c:>10}" for c in cells))
    if summary.get("errors"):
        lines.append("errors: " + "; ".join(summary["errors"]))
    return "\n".join(lines)


MODES = ("in process", "core process")


def format_comparison(summaries: dict[str, dict]) -> str:
    """The summaries of :data:`MODES` side by side, with the core process's difference."""
    a, b = (summaries[m] for m in MODES)
    rows = [("completed / failed", f"{a['completed']} / {a['failed']}",
             f"{b['completed']} / {b['failed']}", "")]
    rows += [(label, a[key], b[key], f"{b[key] - a[key]:+.1f}") for key, label in (
        ("output_throughput", "output tok/s"), ("request_throughput", "requests/s"))]
    for name, label in (("ttft", "TTFT"), ("itl", "ITL"), ("tpot", "TPOT"), ("e2el", "E2E")):
        for stat in ("mean", "p50", "p99"):
            key = f"{stat}_{name}_ms"
            x, y = a[key], b[key]
            rows.append((f"{label} {stat} (ms)", x, y,
                         "-" if x is None or y is None else f"{y - x:+.2f}"))
    width = max(len(r[0]) for r in rows) + 2
    lines = [f"{'':<{width}}{MODES[0]:>14}{MODES[1]:>14}{'difference':>14}"]
    lines += [f"{r[0]:<{width}}" + "".join(f"{'-' if c is None else c:>14}" for c in r[1:])
              for r in rows]
    return "\n".join(lines)


@contextlib.contextmanager
def _local_server(async_llm, model_name: str):
    """The workbench's server over ``async_llm`` on 127.0.0.1 (a free port), in a thread."""
    import uvicorn

    from workbench.entrypoints.openai.api_server import build_app

    server = uvicorn.Server(uvicorn.Config(build_app(async_llm, model_name=model_name),
                                           host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, name="bench-serve-server", daemon=True)
    thread.start()
    try:
        while not server.started:
            if not thread.is_alive():
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def compare_multiprocessing(engine_args, requests: list[BenchRequest], args,
                            slos: dict[str, float]) -> dict[str, dict]:
    """Run ``requests`` against a local server in each of :data:`MODES`; their summaries."""
    from workbench.engine.async_llm import AsyncLLM
    from workbench.engine.core_client import AsyncMPClient
    from workbench.engine.llm_engine import LLMEngine

    summaries = {}
    for mode in MODES:
        config = dataclasses.replace(engine_args.create_engine_config(),
                                     multiprocess_mode=mode == MODES[1])
        llm = AsyncLLM(client=AsyncMPClient(config)) if config.multiprocess_mode \
            else AsyncLLM(LLMEngine(config))
        try:
            with _local_server(llm, "workbench") as base_url:
                asyncio.run(run_benchmark(base_url, "workbench", requests[:1], progress=False))
                results, duration = asyncio.run(run_benchmark(
                    base_url, "workbench", requests, request_rate=args.request_rate,
                    arrival=args.arrival, max_concurrency=args.max_concurrency, seed=args.seed,
                    progress=not args.disable_tqdm))
        finally:
            asyncio.run(llm.shutdown())
        summaries[mode] = summarize(results, duration, slos)
    return summaries


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="workbench bench serve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server, without /v1")
    add_workload_args(parser)
    parser.add_argument("--served-model-name", default=None,
                        help="the 'model' field of each request (default: the server's first /v1/models)")
    parser.add_argument("--tokenizer", default=None,
                        help="tokenizer whose vocabulary the prompts are drawn from (default: --model)")
    parser.add_argument("--request-rate", type=float, default=float("inf"),
                        help="requests per second (default inf: all at once)")
    parser.add_argument("--arrival", choices=["poisson", "fixed"], default="poisson")
    parser.add_argument("--max-concurrency", type=int, default=None)
    parser.add_argument("--goodput", nargs="*", default=[], metavar="METRIC:MS",
                        help="SLOs for goodput: ttft:MS tpot:MS e2el:MS")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--output-json", default=None)
    parser.add_argument("--disable-tqdm", action="store_true")
    parser.add_argument("--compare-multiprocessing", action="store_true",
                        help="serve the workbench twice on 127.0.0.1, engine in process and engine "
                             "core in a child process, and print both side by side")
    from workbench.config import EngineArgs

    taken = {a.dest for a in parser._actions}
    EngineArgs.add_cli_args(parser, exclude=taken | {"multiprocess_mode"})
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        slos = parse_goodput(args.goodput)
        if args.request_rate <= 0:
            raise ValueError(f"--request-rate must be > 0, got {args.request_rate}.")
        if args.max_concurrency is not None and args.max_concurrency < 1:
            raise ValueError(f"--max-concurrency must be >= 1, got {args.max_concurrency}.")
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    import httpx
    from transformers import AutoTokenizer

    from workbench.model.loader import resolve_model_path

    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model_path(args.tokenizer or args.model)))
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    model = args.served_model_name
    if args.compare_multiprocessing:
        from workbench.config import EngineArgs

        requests = sample_requests(args.num_prompts, args.input_len_range, args.output_len_range,
                                   len(tokenizer), set(tokenizer.all_special_ids), args.seed)
        engine_args = EngineArgs.from_cli_args(args)
        summaries = compare_multiprocessing(engine_args, requests, args, slos)
        print(f"{len(requests)} requests, input U[{args.input_len_range[0]},"
              f"{args.input_len_range[1]}], output U[{args.output_len_range[0]},"
              f"{args.output_len_range[1]}], rate {args.request_rate}/s ({args.arrival}), "
              f"max concurrency {args.max_concurrency or 'unbounded'}")
        print(format_comparison(summaries))
        if args.output_json:
            with open(args.output_json, "w") as f:
                json.dump(summaries, f, indent=1, default=str)
        return 0 if all(s["completed"] and not s["failed"] for s in summaries.values()) else 1
    if model is None:
        try:
            listing = httpx.get(args.base_url.rstrip("/") + "/v1/models", headers=headers, timeout=30,
                                trust_env=False)
            listing.raise_for_status()
            model = listing.json()["data"][0]["id"]
        except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
            print(f"error: cannot list the models of {args.base_url} ({exc}); "
                  "is the server up? (--served-model-name skips this)", file=sys.stderr)
            return 1
    try:
        requests = sample_requests(args.num_prompts, args.input_len_range, args.output_len_range,
                                   len(tokenizer), set(tokenizer.all_special_ids), args.seed)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    results, duration = asyncio.run(run_benchmark(
        args.base_url, model, requests, request_rate=args.request_rate, arrival=args.arrival,
        max_concurrency=args.max_concurrency, seed=args.seed, api_key=args.api_key,
        progress=not args.disable_tqdm))
    summary = summarize(results, duration, slos)
    print(f"{args.base_url} model {model!r}: {len(requests)} requests, input "
          f"U[{args.input_len_range[0]},{args.input_len_range[1]}], output "
          f"U[{args.output_len_range[0]},{args.output_len_range[1]}], rate {args.request_rate}/s "
          f"({args.arrival}), max concurrency {args.max_concurrency or 'unbounded'}")
    print(format_summary(summary))
    if args.output_json:
        with open(args.output_json, "w") as f:
            config = {k: (str(v) if v == float("inf") else v) for k, v in vars(args).items()
                      if k != "api_key"}
            json.dump({"config": config,
                       "summary": summary,
                       "requests": [{"prompt_len": r.prompt_len, "output_len": r.output_len,
                                     "ttft": r.ttft, "e2el": r.e2el, "tpot": r.tpot,
                                     "error": r.error} for r in results]}, f, indent=1, default=str)
    return 0 if summary["completed"] else 1
