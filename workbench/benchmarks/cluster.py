"""Benchmark: routers on a shared-prefix workload, and a simulated cluster at scale.

``routers``: one shared-prefix workload (:func:`~workbench.cluster.shared_prefix.shared_prefix_workload`)
on a simulated cluster behind each router; a table of prefix hit rate and TTFT, and their
ratios against round robin. ``--real`` runs the same on real engines (the embedded model;
minutes on a CPU)::

    workbench bench cluster routers                          # 4 simulated replicas, 600 requests
    workbench bench cluster routers --real --requests 120 --rate 20

``scale``: a Poisson workload on ``--replicas`` simulated replicas; prints the wall seconds the
run took and requests per second::

    workbench bench cluster scale --replicas 16 --requests 20000

``simreal``: the same shared-prefix trace on a real cluster -- an untimed warm-up, a calibration
run, then the two runs compared -- and on a simulated one whose cost model is fitted
(:meth:`~workbench.lab.sim.cost_model.CostModel.fit`) on the calibration run's measured steps
alone, so the comparison is out of sample; per-replica request counts, and per metric the median
error of the simulation against the two runs' mean beside the real-vs-real floor, with the
error of the default model rescaled to the calibration run (two factors) for comparison::

    workbench bench cluster simreal --replicas 4 --requests 24
"""

from __future__ import annotations

import argparse
import time

from workbench.cluster import Cluster
from workbench.cluster.shared_prefix import shared_prefix_workload
from workbench.lab.workload import Workload

ROUTERS = ("round_robin", "cache_aware", "precise_prefix", "llm_d")


def routers(args: argparse.Namespace) -> list[dict]:
    wl = shared_prefix_workload(args.requests, args.rate, num_groups=args.groups, prefix_len=args.prefix_len,
                                seed=args.seed)
    config = {"block_size": 16, "num_kv_blocks": args.num_kv_blocks}
    rows = []
    for router in args.routers:
        cluster = (Cluster([config] * args.replicas, router=router) if args.real
                   else Cluster.simulated(args.replicas, config, router=router))
        start = time.perf_counter()
        s = cluster.run(wl).summary()
        rows.append({"router": router, "hit_rate": s["prefix_hit_rate"], "ttft_p50_ms": 1e3 * s["ttft_s_p50"],
                     "ttft_p99_ms": 1e3 * s["ttft_s_p99"], "imbalance": s["imbalance"],
                     "run_s": time.perf_counter() - start})
    base = next((r for r in rows if r["router"] == "round_robin"), rows[0])
    for r in rows:
        r["hit_rate_x"] = r["hit_rate"] / base["hit_rate"] if base["hit_rate"] else float("nan")
        r["ttft_p50_x"] = r["ttft_p50_ms"] / base["ttft_p50_ms"]
    kind = "real" if args.real else "simulated"
    print(f"{args.replicas} {kind} replicas, {args.requests} requests at {args.rate}/s, {args.groups} prefix groups "
          f"of {args.prefix_len} tokens, {args.num_kv_blocks} KV blocks of 16 per replica")
    print(f"{'router':15s} {'hit rate':>8s} {'x rr':>6s} {'TTFT p50 ms':>11s} {'x rr':>6s} {'TTFT p99 ms':>11s} "
          f"{'imbalance':>9s} {'run s':>6s}")
    for r in rows:
        print(f"{r['router']:15s} {r['hit_rate']:8.3f} {r['hit_rate_x']:6.2f} {r['ttft_p50_ms']:11.2f} "
              f"{r['ttft_p50_x']:6.2f} {r['ttft_p99_ms']:11.2f} {r['imbalance']:9.2f} {r['run_s']:6.1f}")
    return rows


def scale(args: argparse.Namespace) -> dict:
    wl = Workload.poisson(args.requests, rate=args.rate, input_len=(20, 200), output_len=(10, 60), clock="wall",
                          text=False, seed=args.seed)
    cluster = Cluster.simulated(args.replicas, {"num_kv_blocks": 1024, "max_num_seqs": 64}, router=args.router)
    start = time.perf_counter()
    result = cluster.run(wl)
    took = time.perf_counter() - start
    s = result.summary()
    steps = sum(r.num_steps for r in result.replicas)
    print(f"{'replicas':>8s} {'requests':>9s} {'router':>12s} {'steps':>9s} {'run s':>8s} {'req/s':>8s} "
          f"{'simulated s':>11s} {'TTFT p50 ms':>11s}")
    print(f"{args.replicas:8d} {s['num_requests']:9d} {args.router:>12s} {steps:9d} {took:8.1f} "
          f"{s['num_requests'] / took:8.0f} {s['makespan']:11.1f} {1e3 * s['ttft_s_p50']:11.2f}")
    return {"seconds": took, "requests": s["num_requests"], "steps": steps}


def simreal(args: argparse.Namespace) -> dict:
    import numpy as np

    from workbench.lab.sim.cost_model import CostModel

    wl = shared_prefix_workload(args.requests, args.rate, num_groups=args.groups, prefix_len=args.prefix_len,
                                input_len=(args.prefix_len + 8, args.prefix_len + 24), output_len=(4, 8),
                                seed=args.seed)
    config = {"block_size": 16, "num_kv_blocks": args.num_kv_blocks}
    real = Cluster([config] * args.replicas, router=args.router)
    real.run(wl)  # untimed: first passes over new shapes
    calibration = [r.history for r in real.run(wl).replicas]
    runs = [real.run(wl) for _ in range(2)]
    fitted = CostModel.fit(calibration)
    rescaled = CostModel.default().rescaled_to(calibration)
    sims = {name: Cluster.simulated(args.replicas, config, cost_model=model, router=args.router).run(wl)
            for name, model in (("fitted", fitted), ("rescaled", rescaled))}
    counts = {name: [len(r.requests) for r in run.replicas] for name, run in
              (("real 1", runs[0]), ("real 2", runs[1]), ("simulated", sims["fitted"]))}
    out = {"counts_equal": len({tuple(c) for c in counts.values()}) == 1}
    print(f"{args.replicas} replicas, {args.requests} shared-prefix requests at {args.rate}/s, router {args.router}")
    for name, c in counts.items():
        print(f"  requests per replica, {name:9s}: {c}")
    print(f"{'metric':8s} {'real-vs-real floor':>18s} {'sim vs real mean':>16s} {'within':>6s} "
          f"{'default rescaled':>16s}")
    for metric in ("ttft_s", "e2e_s"):
        a, b = (run.requests.set_index("request_id")[metric].astype("float64") for run in runs)
        floor = float(np.median(np.abs(a - b) / a))
        mean = (a + b) / 2
        err = {name: float(np.median(np.abs(sim.requests.set_index("request_id")[metric].astype("float64")
                                            .reindex(a.index) - mean) / mean)) for name, sim in sims.items()}
        out[metric] = {"floor": floor, "sim_err": err["fitted"], "within": err["fitted"] <= floor,
                       "rescaled_err": err["rescaled"]}
        print(f"{metric:8s} {floor:18.3f} {err['fitted']:16.3f} {str(err['fitted'] <= floor):>6s} "
              f"{err['rescaled']:16.3f}")
    print(f"cost model fitted on the calibration run's {fitted.fit_stats['num_steps']} steps; "
          f"the default rescaled: prefill x{rescaled.fit_stats['rescale_prefill']:.2f}, "
          f"other x{rescaled.fit_stats['rescale_other']:.2f}")
    return out


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="workbench bench cluster", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    r = sub.add_parser("routers", help="hit rate and TTFT per router on a shared-prefix workload")
    r.add_argument("--replicas", type=int, default=4)
    r.add_argument("--requests", type=int, default=600)
    r.add_argument("--rate", type=float, default=200.0, help="arrivals per second")
    r.add_argument("--groups", type=int, default=12, help="shared prefixes")
    r.add_argument("--prefix-len", type=int, default=192)
    r.add_argument("--num-kv-blocks", type=int, default=64, help="per replica (16 tokens each)")
    r.add_argument("--routers", nargs="+", default=list(ROUTERS))
    r.add_argument("--real", action="store_true", help="real engines (the embedded model) instead of simulated")
    r.add_argument("--seed", type=int, default=1)
    s = sub.add_parser("scale", help="a simulated cluster's run time on many requests")
    s.add_argument("--replicas", type=int, default=16)
    s.add_argument("--requests", type=int, default=20_000)
    s.add_argument("--rate", type=float, default=2000.0, help="arrivals per second (simulated)")
    s.add_argument("--router", default="least_requests")
    s.add_argument("--seed", type=int, default=1)
    m = sub.add_parser("simreal", help="a real and a simulated cluster on one trace: counts, latency errors")
    m.add_argument("--replicas", type=int, default=4)
    m.add_argument("--requests", type=int, default=24)
    m.add_argument("--rate", type=float, default=2.0, help="arrivals per second")
    m.add_argument("--groups", type=int, default=4, help="shared prefixes")
    m.add_argument("--prefix-len", type=int, default=32)
    m.add_argument("--num-kv-blocks", type=int, default=64, help="per replica (16 tokens each)")
    m.add_argument("--router", default="cache_aware")
    m.add_argument("--seed", type=int, default=1)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    {"routers": routers, "scale": scale, "simreal": simreal}[args.what](args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
