"""The qualitative headline on a shared-prefix workload (simulated): cache-aware and precise-prefix
routing find the shared prefixes more often than round robin and cut the time to first token."""

import math

from workbench.benchmarks.cluster import build_parser, routers, scale, simreal


def test_prefix_aware_routers_raise_the_hit_rate_and_lower_ttft(capsys):
    args = build_parser().parse_args(["routers", "--requests", "200", "--routers", "round_robin", "cache_aware",
                                      "precise_prefix"])
    rows = {r["router"]: r for r in routers(args)}
    for name in ("cache_aware", "precise_prefix"):
        assert rows[name]["hit_rate"] > 1.5 * rows["round_robin"]["hit_rate"]
        assert rows[name]["ttft_p50_ms"] < 0.8 * rows["round_robin"]["ttft_p50_ms"]
    table = capsys.readouterr().out
    assert "hit rate" in table and table.count("\n") == 5  # the heading, the columns, three routers


def test_the_scale_command_prints_its_row(capsys):
    got = scale(build_parser().parse_args(["scale", "--replicas", "4", "--requests", "200"]))
    assert got["requests"] == 200 and got["steps"] > 0
    assert "req/s" in capsys.readouterr().out


def test_the_simreal_command_compares_a_real_and_a_simulated_cluster(capsys):
    """cache_aware's choices here depend on the prefixes only (loads stay balanced): the real
    runs and the simulation send every request to the same replica."""
    got = simreal(build_parser().parse_args(["simreal", "--replicas", "2", "--requests", "6", "--groups", "2",
                                             "--rate", "4"]))
    assert got["counts_equal"]
    for metric in ("ttft_s", "e2e_s"):
        assert all(math.isfinite(got[metric][k]) for k in ("floor", "sim_err", "rescaled_err"))
        assert got[metric]["within"] == (got[metric]["sim_err"] <= got[metric]["floor"])
    assert "real-vs-real floor" in capsys.readouterr().out
