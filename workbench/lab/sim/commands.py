"""The command line of the simulator: ``workbench calibrate``, ``workbench simulate``,
``workbench simulate accuracy``, ``workbench simulate probe`` and ``workbench simulate capacity``.
Engine options are EngineArgs' flags."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time


def add_calibrate_arguments(parser: argparse.ArgumentParser) -> None:
    from workbench.config import EngineArgs

    parser.add_argument("--output", "-o", default=None, help="save the cost model's JSON here")
    parser.add_argument("--grid", choices=["default", "tiny"], default="default",
                        help="default: about 1-2 min on a 2-core CPU with the embedded model; tiny: seconds")
    parser.add_argument("--repeats", type=int, default=None, help="runs of each phase (default 3)")
    parser.add_argument("--aggregate", choices=["median", "min"], default="median",
                        help="a step's duration over its repeats: median (default), or min on a busy machine")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.add_argument("--lora", action="store_true",
                        help="add LoRA phases (the shipped adapters, max_loras=2) to fit the lora_* coefficients")
    add_threads_argument(parser)
    EngineArgs.add_cli_args(parser)


def add_threads_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads of this process (default: torch's); a cost model describes "
                             "the engine at one thread count, and one thread is the steadiest on a small VM")


def set_threads(threads: int | None) -> None:
    """``torch.set_num_threads(threads)`` unless None; ValueError names the flag below 1."""
    if threads is None:
        return
    if threads < 1:
        raise ValueError(f"--threads must be >= 1, got {threads}.")
    import torch

    torch.set_num_threads(threads)


def calibrate_main(args: argparse.Namespace) -> int:
    """Run the grid on the real engine, print the coefficient table, save the JSON."""
    from workbench.config import EngineArgs
    from workbench.lab.sim.calibrate import CalibrationGrid, calibrate, coefficient_table

    grid = CalibrationGrid.tiny() if args.grid == "tiny" else CalibrationGrid()
    try:
        set_threads(args.threads)
        if args.repeats is not None:
            if args.repeats < 1:
                raise ValueError(f"--repeats must be >= 1, got {args.repeats}.")
            grid = dataclasses.replace(grid, repeats=args.repeats)
        model = calibrate(EngineArgs.from_cli_args(args).create_engine_config(), grid, progress=not args.quiet,
                          aggregate=args.aggregate, lora=args.lora)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    hw = model.hardware
    print(f"{model.model.get('name')} on {hw.get('gpu') or hw.get('cpu')} "
          f"({hw.get('threads')} threads, torch {hw.get('torch')})")
    print(coefficient_table(model))
    if args.output:
        print(f"saved to {model.save(args.output)}")
    return 0


def add_simulate_arguments(parser: argparse.ArgumentParser) -> None:
    from workbench.config import EngineArgs

    parser.add_argument("mode", nargs="?", choices=["run", "accuracy", "probe", "capacity"], default="run",
                        help="run: simulate a workload and print its summary (default); "
                             "accuracy: simulated vs real latencies on fresh workloads; "
                             "probe: this machine's step time against the cost model's; "
                             "capacity: the highest rate meeting --slo (with --trace or --workload)")
    parser.add_argument("--cost-model", default=None,
                        help="a cost model's JSON (default: the shipped CPU calibration of the embedded model)")
    parser.add_argument("--output", "-o", default=None,
                        help="probe: save the cost model with every time scaled by the measured ratio (a quick "
                             "recalibration; `workbench calibrate` is the full one)")
    parser.add_argument("--workload", default=None, help="a Workload JSON (Workload.save); else a Poisson one:")
    parser.add_argument("--num-requests", type=int, default=None,
                        help="requests of the Poisson workload (default 100; accuracy: 40 per rate)")
    parser.add_argument("--rate", type=float, default=4.0,
                        help="arrivals of the Poisson workload per second (per step with --clock steps)")
    parser.add_argument("--rates", type=float, nargs="+", default=[4.0, 12.0], help="accuracy: the Poisson rates")
    parser.add_argument("--real-runs", type=int, default=3,
                        help="accuracy: timed real runs per workload (a request's real latency is their median)")
    parser.add_argument("--calibrate", action="store_true",
                        help="accuracy: calibrate on this machine first (default grid) instead of loading a cost model")
    parser.add_argument("--input-len", type=int, nargs=2, default=[16, 256], metavar=("LOW", "HIGH"))
    parser.add_argument("--output-len", type=int, nargs=2, default=[4, 128], metavar=("LOW", "HIGH"))
    parser.add_argument("--token-ids", action="store_true", help="prompts as token ids (no text to tokenize)")
    parser.add_argument("--workload-seed", type=int, default=1, help="seed of the Poisson workload")
    parser.add_argument("--clock", choices=["wall", "steps"], default=None,
                        help="the clock of the Poisson workload (default wall); a --workload file runs on its own "
                             "clock, which --clock, when given, must name")
    parser.add_argument("--progress", action="store_true", help="a progress bar over requests")
    trace = parser.add_argument_group("capacity: the workload (a trace) and the SLO")
    trace.add_argument("--trace", default=None,
                       help="a trace file or a shipped excerpt's name (azure_conv, mooncake_conversation, ...)")
    trace.add_argument("--trace-format", default=None, choices=["azure", "burstgpt", "mooncake", "sharegpt"])
    trace.add_argument("--max-requests", type=int, default=None, help="the trace's first so many requests")
    trace.add_argument("--window", type=float, nargs=2, default=None, metavar=("START", "END"),
                       help="the trace's requests arriving in [START, END) seconds")
    trace.add_argument("--fit", choices=["scale", "clip", "drop", "none"], default="scale",
                       help="lengths over the model's context: scaled alike (default), clipped, dropped, or an error")
    trace.add_argument("--slo", nargs="+", default=None, metavar="METRIC=BOUND",
                       help="e.g. ttft_s_p99=0.5 tpot_s_p99=0.05 (RunResult.summary() metrics, seconds)")
    trace.add_argument("--grid", action="append", default=None, metavar="FIELD=V1,V2",
                       help="a config axis (repeatable): one capacity per configuration, e.g. max_num_seqs=4,16")
    trace.add_argument("--search", choices=["sim", "real"], default="sim", help="the runs the search makes")
    trace.add_argument("--rel-tol", type=float, default=0.05, help="the search stops when high / low - 1 <= this")
    trace.add_argument("--headroom", type=float, default=0.1,
                       help="the search keeps each metric at most (1 - this) x its bound, so that a real run's "
                            "noise stays inside the SLO (default 0.1; 0: the edge itself)")
    trace.add_argument("--recalibrate", type=int, default=0, metavar="N",
                       help="sim search: up to N real runs at the capacity found, each rescaling the cost model to "
                            "its measured steps (prefill and the rest apart) and searching again (default 0)")
    trace.add_argument("--confirm", action="store_true",
                       help="real runs at the capacity found and at 1.25x it, beside the search's runs")
    add_threads_argument(parser)
    EngineArgs.add_cli_args(parser)


def parse_assignments(items, name: str, convert) -> dict:
    """``["k=v", ...]`` -> ``{k: convert(v)}``; ValueError naming the flag and the item."""
    out = {}
    for item in items or ():
        key, eq, value = item.partition("=")
        if not eq or not key or not value:
            raise ValueError(f"{name}: expected KEY=VALUE, got {item!r}.")
        try:
            out[key] = convert(value)
        except ValueError:
            raise ValueError(f"{name}: cannot read the value of {item!r}.") from None
    return out


def _grid_value(text: str):
    values = []
    for v in text.split(","):
        for kind in (int, float):
            try:
                values.append(kind(v))
                break
            except ValueError:
                continue
        else:
            values.append({"true": True, "false": False}.get(v.lower(), v))
    return values


def capacity_main(args: argparse.Namespace, config, model) -> int:
    """``workbench simulate capacity``: one capacity per configuration of --grid (or the
    flags' one), a table of them, with --confirm the real runs beside."""
    import pandas as pd

    from workbench.lab.capacity import capacity, run_name
    from workbench.lab.sweep import expand_grid
    from workbench.lab.workload import Workload

    slo = parse_assignments(args.slo, "--slo", float)
    if not slo:
        raise ValueError("capacity needs --slo METRIC=BOUND (e.g. --slo ttft_s_p99=0.5 tpot_s_p99=0.05).")
    if args.trace:
        workload = Workload.from_trace(args.trace, args.trace_format, window=tuple(args.window) if args.window else None,
                                       max_requests=args.max_requests, fit=None if args.fit == "none" else args.fit,
                                       max_model_len=config.max_model_len)
    elif args.workload:
        workload = Workload.load(args.workload)
    else:
        raise ValueError("capacity needs --trace NAME_OR_PATH or --workload FILE.")
    print(repr(workload))
    search = {"run": "real"} if args.search == "real" else {"run": "sim", "cost_model": model,
                                                            "recalibrate": args.recalibrate}
    grid = parse_assignments(args.grid, "--grid", _grid_value)
    rows = []
    for overrides in expand_grid(grid) if grid else [{}]:
        cfg = dataclasses.replace(config, **overrides)
        found = capacity(workload, cfg, slo, rel_tol=args.rel_tol, headroom=args.headroom, progress=args.progress,
                         **search)
        row = {**overrides, f"capacity ({args.search})": found.rate, "bounded": found.bounded,
               "rates_tried": len(found.table)}
        if found.recalibrations is not None:
            checks = found.recalibrations
            row["real_checks"] = len(checks)
            for part in ("prefill_x", "other_x"):
                row[f"model_{part}"] = float(checks[part][checks["rescaled"]].prod())
        if args.confirm:
            table = found.confirm()
            name = run_name(found.run)
            for point, r in table.iterrows():
                for m in slo:
                    row[f"{m} {name} @ {point}"] = r[f"{m} ({name})"]
                    row[f"{m} real @ {point}"] = r[f"{m} (real)"]
                row[f"holds real @ {point}"] = r["holds (real)"]
            row["real_steps_over_model"] = float(table["real_steps_over_model"].median())
        rows.append(row)
    with pd.option_context("display.width", 200, "display.max_columns", None):
        print(pd.DataFrame(rows).T.to_string(header=False) if len(rows) == 1 else pd.DataFrame(rows).to_string(index=False))
    return 0


def simulate_main(args: argparse.Namespace) -> int:
    from workbench.config import EngineArgs
    from workbench.lab.sim.accuracy import accuracy, default_workloads
    from workbench.lab.sim.cost_model import as_cost_model
    from workbench.lab.sim.simulate import simulate
    from workbench.lab.workload import Workload

    try:
        set_threads(args.threads)
        config = EngineArgs.from_cli_args(args).create_engine_config()
        if args.mode == "capacity":
            return capacity_main(args, config, as_cost_model(args.cost_model))
        if args.mode == "probe":
            from workbench.lab.sim.probe import probe_machine

            model = as_cost_model(args.cost_model)
            probe = probe_machine(model, config, warn=False)
            print(probe)
            if args.output:
                scaled = model.scaled(probe.ratio, note=f"{model.note}; times x{probe.ratio:.4g}: "
                                                        "measured by `workbench simulate probe`")
                print(f"saved the cost model scaled by {probe.ratio:.3g} to {scaled.save(args.output)}")
            return 0
        if args.calibrate and (args.mode != "accuracy" or args.cost_model):
            raise ValueError("--calibrate goes with `simulate accuracy` and without --cost-model.")
        if args.real_runs < 1:
            raise ValueError(f"--real-runs must be >= 1, got {args.real_runs}.")
        if args.calibrate:
            from workbench.lab.sim.calibrate import calibrate, coefficient_table

            model = calibrate(config, progress=args.progress)
            print(coefficient_table(model))
        else:
            model = as_cost_model(args.cost_model)
        if args.mode == "accuracy":
            report = accuracy(model, config, workloads=default_workloads(args.num_requests or 40, tuple(args.rates)),
                              repeats=args.real_runs, progress=args.progress)
            print(report)
            print(f"within 5% and identical schedules: {report.ok}")
            print(f"within the real-vs-real floor and identical schedules (good): {report.good}")
            return 0
        if args.workload:
            workload = Workload.load(args.workload)
        else:
            workload = Workload.poisson(args.num_requests or 100, rate=args.rate, input_len=tuple(args.input_len),
                                        output_len=tuple(args.output_len), seed=args.workload_seed,
                                        text=not args.token_ids, clock=args.clock or "wall")
        start = time.perf_counter()
        result = simulate(workload, config, model, clock=args.clock, progress=args.progress)
        took = time.perf_counter() - start
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(result)
    for key, value in result.summary().items():
        print(f"  {key:<24} {value:.6g}" if isinstance(value, float) else f"  {key:<24} {value}")
    print(f"simulated {len(workload)} requests in {took:.2f} s of wall time: "
          f"{len(workload) / took:,.0f} requests/s, {result.num_steps / took:,.0f} steps/s; "
          f"{result.wall_s:.2f} simulated seconds")
    # The console script ends the process here, before freeing the result
    # (workbench.entrypoints.fast_exit.finish, given by the CLI); in-process it returns 0.
    return args.finish(0)
