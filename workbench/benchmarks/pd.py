"""``python -m workbench.benchmarks.pd``: when disaggregation pays, in simulation (the table).

Goodput under TTFT/TPOT SLOs of colocated vs every xPyD layout of ``--replicas`` simulated
replicas, over the workload mixes of :mod:`workbench.cluster.pd_study` and ``--link-gbps``
speeds; prints the table, then each layout's crossover (the slowest link at which it beats
colocated). Timed by the shipped cost model (this machine's CPU and the embedded model).
"""

from __future__ import annotations

import argparse

import pandas as pd

from workbench.cluster.pd_study import MIXES, crossover, sweep


def main(argv: list[str] | None = None) -> pd.DataFrame:
    parser = argparse.ArgumentParser(prog="python -m workbench.benchmarks.pd", description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--mixes", nargs="+", default=list(MIXES), choices=list(MIXES))
    parser.add_argument("--link-gbps", type=float, nargs="+", default=[0.1, 1.0, 10.0, 100.0])
    parser.add_argument("--num-requests", type=int, default=60)
    parser.add_argument("--ttft-slo", type=float, default=0.2, help="seconds")
    parser.add_argument("--tpot-slo", type=float, default=0.003, help="seconds")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    table = sweep(args.mixes, args.replicas, args.link_gbps, num_requests=args.num_requests,
                  ttft_slo=args.ttft_slo, tpot_slo=args.tpot_slo, seed=args.seed)
    with pd.option_context("display.width", 200, "display.max_columns", 20):
        print(table.round(4).to_string(index=False))
        print()
        print(crossover(table).round(4).to_string(index=False))
    return table


if __name__ == "__main__":
    main()
