"""The ``workbench`` command line (also ``python -m workbench``)."""

from __future__ import annotations

import argparse
import sys


def _generate(args: argparse.Namespace) -> int:
    from workbench import LLM, SamplingParams

    llm = LLM(model=args.model, device=args.device, dtype=args.dtype)
    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens, seed=args.seed
    )
    try:
        outputs = llm.generate(args.prompts, params, use_tqdm=False)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for out in outputs:
        print(f"{out.prompt}{out.outputs[0].text}")
        if len(outputs) > 1:
            print("-" * 40)
    return 0


def _bench(args: argparse.Namespace) -> int:
    if args.what == "scheduler":
        from workbench.core.bench_scheduler import main as run
    elif args.what == "kernels":
        from workbench.kernels.bench import main as run
    else:
        from workbench.bench_throughput import main as run
    return run(args.rest)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="workbench",
        description="A steppable re-implementation of vLLM's serving path, for notebooks.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    gen = sub.add_parser("generate", help="generate text for one or more prompts")
    gen.add_argument("prompts", nargs="+", help="prompt text(s)")
    gen.add_argument("--model", default=None, help="HF directory or hub id (default: embedded model)")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--device", default=None)
    gen.add_argument("--dtype", default="auto")
    gen.set_defaults(func=_generate)

    bench = sub.add_parser(
        "bench",
        help="benchmarks that print a table: scheduler | kernels | throughput",
        description="Run `workbench bench WHAT --help` for each benchmark's options.",
    )
    bench.add_argument("what", choices=["scheduler", "kernels", "throughput"])
    bench.add_argument("rest", nargs=argparse.REMAINDER, help="options for that benchmark")
    bench.set_defaults(func=_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    return args.func(args)
