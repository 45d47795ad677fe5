"""The ``workbench`` command line (also ``python -m workbench``)."""

from __future__ import annotations

import argparse
import logging
import dataclasses
import sys

from workbench.config import EngineArgs
from workbench.entrypoints import fast_exit


def _generate(args: argparse.Namespace) -> int:
    """One prompt streams its text as it is generated; several are batched and printed in order."""
    from workbench import LLM, SamplingParams
    from workbench.config import EngineArgs

    try:
        params = SamplingParams(
            temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens
        )
        llm = LLM(**EngineArgs.from_cli_args(args).to_kwargs())
        if len(args.prompts) == 1:
            return _stream_one(llm.engine, args.prompts[0], params)
        outputs = llm.generate(args.prompts, params, use_tqdm=False)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for out in outputs:
        print(f"{out.prompt}{out.outputs[0].text}")
        print("-" * 40)
    return 0


def _stream_one(engine, prompt: str, params) -> int:
    from workbench.sampling_params import RequestOutputKind

    engine.add_request("cli", prompt, dataclasses.replace(params, output_kind=RequestOutputKind.DELTA))
    print(prompt, end="", flush=True)
    while engine.has_unfinished_requests():
        for out in engine.step():
            print(out.outputs[0].text if out.outputs else "", end="", flush=True)
    print()
    return 0


def _bench(args: argparse.Namespace) -> int:
    if args.what == "scheduler":
        from workbench.benchmarks.scheduler import main as run
    elif args.what == "kernels":
        from workbench.kernels.bench import main as run
    elif args.what == "serve":
        from workbench.benchmarks.serve import main as run
    elif args.what == "cluster":
        from workbench.benchmarks.cluster import main as run
    else:
        from workbench.benchmarks.throughput import main as run
    return run(args.rest)


def _selftest(args: argparse.Namespace) -> int:
    from workbench.benchmarks.selftest import run

    return run(args)


def parse_lora_modules(items: list[str] | None) -> dict[str, str]:
    """vLLM's ``--lora-modules name=path ...`` as {name: path} (argparse error text if bad)."""
    modules: dict[str, str] = {}
    for item in items or ():
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise SystemExit(f"--lora-modules: expected NAME=PATH, got {item!r}.")
        modules[name] = path
    return modules


def _serve(args: argparse.Namespace) -> int:
    """Run the OpenAI-compatible server (uvicorn) over one engine (or a cluster) until interrupted."""
    import asyncio

    if args.cluster:
        from workbench.entrypoints.openai.cluster_server import serve_cluster
        return serve_cluster(args)

    from workbench.config import EngineArgs
    from workbench.engine.async_llm import AsyncLLM
    from workbench.engine.core_client import multiprocessing_enabled
    from workbench.engine.llm_engine import LLMEngine
    from workbench.entrypoints.openai.api_server import build_app, make_server
    from workbench.metrics.kv_events_publisher import KVEventsConfig, attach
    from workbench.utils.heap import freeze_startup_heap

    engine_args = EngineArgs.from_cli_args(args)
    try:
        kv_events = KVEventsConfig.from_json(args.kv_events_config) if args.kv_events_config else None
        if kv_events is not None and multiprocessing_enabled(engine_args.multiprocess_mode):
            raise ValueError("--kv-events-config publishes from an engine in this process: drop "
                             "--multiprocess-mode (and VLLM_ENABLE_V1_MULTIPROCESSING) to use it.")
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if kv_events is None:
        async_llm, publisher = AsyncLLM.from_engine_args(engine_args), None
    else:
        engine = LLMEngine.from_engine_args(engine_args)
        publisher = attach(engine, kv_events)
        async_llm = AsyncLLM(engine)
    name = args.served_model_name or args.model or "tiny-shakespeare"
    if args.enable_log_requests:  # the request logger's INFO lines reach stderr, as vLLM's
        request_log = logging.getLogger("workbench.entrypoints.openai.request_logger")
        request_log.setLevel(logging.INFO)
        request_log.addHandler(logging.StreamHandler())
    try:
        app = build_app(async_llm, model_name=name, api_key=args.api_key,
                        enable_auto_tool_choice=args.enable_auto_tool_choice,
                        tool_call_parser=args.tool_call_parser,
                        lora_modules=parse_lora_modules(args.lora_modules),
                        enable_log_requests=args.enable_log_requests, max_log_len=args.max_log_len,
                        enable_server_load_tracking=args.enable_server_load_tracking,
                        log_error_stack=args.log_error_stack)
    except ValueError as exc:  # a tool-call parser flag, a bad --lora-modules entry or adapter
        asyncio.run(async_llm.shutdown())
        if publisher is not None:
            publisher.shutdown()
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"Serving {name!r} on http://{args.host}:{args.port}/v1", file=sys.stderr)
    freeze_startup_heap()
    try:
        # Exits by itself when the engine dies after an error (vLLM's behaviour).
        make_server(app, async_llm, host=args.host, port=args.port, log_level=args.log_level).run()
    finally:
        asyncio.run(async_llm.shutdown())
        if publisher is not None:
            publisher.shutdown()
    return 0


def _trace_export(args: argparse.Namespace) -> int:
    """Run a saved workload (real, simulated or both) and write its Perfetto trace."""
    from workbench.lab.compare import run_workload
    from workbench.lab.sim import simulate
    from workbench.lab.workload import Workload

    try:
        workload = Workload.load(args.workload)
        config = EngineArgs.from_cli_args(args).create_engine_config()
        runs = []
        if args.run in ("real", "both"):
            runs.append(run_workload(workload, config))
        if args.run in ("simulated", "both"):
            runs.append(simulate(workload, config, args.cost_model))
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    path = runs[0].to_perfetto(args.output, *runs[1:])
    print(f"wrote {path}: open it in https://ui.perfetto.dev (Open trace file) or chrome://tracing")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="workbench",
        description="A steppable re-implementation of vLLM's serving path, for notebooks.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    gen = sub.add_parser("generate", help="generate text for one or more prompts")
    gen.add_argument("prompts", nargs="+", help="prompt text(s)")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.8,
                     help="0 for greedy (default 0.8; --seed makes sampling reproducible)")
    gen.add_argument("--top-p", type=float, default=1.0)
    EngineArgs.add_cli_args(gen)
    gen.set_defaults(func=_generate)

    serve = sub.add_parser(
        "serve", help="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, ...)"
    )
    serve.add_argument("--served-model-name", default=None,
                       help="the name clients send as 'model' (default: --model, or tiny-shakespeare)")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", default=None,
                       help="require 'Authorization: Bearer KEY' on /v1/*, /tokenize, /detokenize")
    serve.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                       help="LoRA adapters (PEFT directories) served under their names, as vLLM's "
                       "--lora-modules (needs --enable-lora)")
    serve.add_argument("--log-level", default="info")
    serve.add_argument("--enable-auto-tool-choice", action="store_true",
                       help='serve tool_choice "auto" (needs --tool-call-parser), as vLLM')
    serve.add_argument("--tool-call-parser", default=None,
                       help="how replies spell tool calls: 'hermes' (<tool_call>{json}</tool_call>)")
    serve.add_argument("--kv-events-config", default=None, metavar="JSON",
                       help='publish KV cache events over ZMQ as vLLM, e.g. \'{"enable_kv_cache_events": true, '
                       '"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558", "topic": "kv-events"}\'')
    serve.add_argument("--enable-log-requests", action="store_true",
                       help="log each request's prompt and parameters, as vLLM")
    serve.add_argument("--max-log-len", type=int, default=None,
                       help="with --enable-log-requests: prompt characters and token ids logged")
    serve.add_argument("--enable-server-load-tracking", action="store_true",
                       help="count requests in flight (GET /load), as vLLM")
    serve.add_argument("--log-error-stack", action="store_true",
                       help="log the traceback of every error answer, as vLLM")
    serve.add_argument("--cluster", default=None, metavar="JSON",
                       help='serve a cluster of engines behind a router (JSON or its file), e.g. \'{"router": '
                       '"cache_aware", "replicas": [{"simulated": true}, {"simulated": true}]}\'')
    EngineArgs.add_cli_args(serve)
    serve.set_defaults(func=_serve)

    bench = sub.add_parser(
        "bench",
        help="benchmarks that print a table: scheduler | kernels | throughput | serve | cluster",
        description="Run `workbench bench WHAT --help` for each benchmark's options.",
    )
    bench.add_argument("what", choices=["scheduler", "kernels", "throughput", "serve", "cluster"])
    bench.add_argument("rest", nargs=argparse.REMAINDER, help="options for that benchmark")
    bench.set_defaults(func=_bench)

    from workbench.benchmarks.selftest import __doc__ as selftest_doc
    from workbench.benchmarks.selftest import add_arguments as selftest_arguments

    selftest = sub.add_parser(
        "selftest", help="bounded first-run check of a (GPU) machine: kernels, parity, benchmarks",
        description=selftest_doc, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    selftest_arguments(selftest)
    selftest.set_defaults(func=_selftest)

    from workbench.lab.sim import commands as sim_commands

    calibrate = sub.add_parser(
        "calibrate", help="fit a simulator cost model to timed batches on the real engine (JSON)",
        description="Runs a designed set of batches (decode x context, prefill x context, mixed) "
                    "on the engine the flags describe, fits the cost model, prints it.",
    )
    sim_commands.add_calibrate_arguments(calibrate)
    calibrate.set_defaults(func=sim_commands.calibrate_main)

    simulate = sub.add_parser(
        "simulate", help="simulate a workload on the real scheduler with a cost model; 'accuracy' checks it",
        description="`workbench simulate` runs a workload with the simulated runner and prints its "
                    "summary; `workbench simulate accuracy` compares simulated and real latencies.",
    )
    sim_commands.add_simulate_arguments(simulate)
    simulate.set_defaults(func=sim_commands.simulate_main, finish=fast_exit.finish)

    trace = sub.add_parser("trace", help="timelines for Perfetto: 'trace export WORKLOAD.json'")
    trace_sub = trace.add_subparsers(dest="trace_command", metavar="ACTION", required=True)
    export = trace_sub.add_parser(
        "export", help="run a saved workload and write its Chrome trace-event JSON",
        description="Runs a Workload JSON (Workload.save) on the engine the flags describe -- for real, "
                    "simulated, or both as two processes of one trace -- and writes the trace that "
                    "ui.perfetto.dev and chrome://tracing open.",
    )
    export.add_argument("workload", metavar="WORKLOAD.json", help="a Workload JSON (Workload.save)")
    export.add_argument("--output", "-o", default="trace.json", help="the trace file (default trace.json)")
    export.add_argument("--run", choices=["real", "simulated", "both"], default="real",
                        help="which runs to trace (default real)")
    export.add_argument("--cost-model", default=None,
                        help="the simulated run's cost model JSON (default: the shipped CPU calibration)")
    EngineArgs.add_cli_args(export)
    export.set_defaults(func=_trace_export)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    return args.func(args)


def console_main() -> int:
    """The ``workbench`` console script: :func:`main`, where a command that finished its work
    may end the process without tearing its heap down (:mod:`workbench.entrypoints.fast_exit`)."""
    with fast_exit.console_command():
        return main()
