"""%llm cluster: builds a simulated (or real) cluster, binds it, runs a Workload variable on it."""

import pytest

IPython = pytest.importorskip("IPython")

from IPython.core.error import UsageError  # noqa: E402

from workbench.cluster import Cluster  # noqa: E402
from workbench.cluster.shared_prefix import shared_prefix_workload  # noqa: E402
from workbench.viz.cluster_timeline import ClusterTimeline  # noqa: E402


def test_cluster_magic_builds_runs_and_shows(ipython):
    ip = ipython
    built = ip.run_line_magic("llm", "cluster 3 --router cache_aware --num-kv-blocks 64 --block-size 16 --as c")
    assert ip.user_ns["c"] is built and len(built) == 3 and built.simulated_replicas
    assert built.router.name == "cache_aware" and built.configs[0].num_kv_blocks == 64
    wl = ip.user_ns["wl"] = shared_prefix_workload(60, 100.0, num_groups=3, prefix_len=64, input_len=(80, 100))
    shown = ip.run_line_magic("llm", "cluster 3 --router cache_aware --num-kv-blocks 64 --block-size 16 --as c "
                                     "--workload wl")
    by_hand = Cluster.simulated(3, {"num_kv_blocks": 64, "block_size": 16}, router="cache_aware").run(wl)
    assert shown is ip.user_ns["c_result"]
    assert shown.decisions.equals(by_hand.decisions) and shown.summary() == by_hand.summary()
    decisions = ip.run_line_magic("llm", "cluster 2 --workload wl --show decisions")
    assert decisions["replica"].tolist() == [i % 2 for i in range(60)]  # round robin, the default
    assert isinstance(ip.run_line_magic("llm", "cluster 2 --workload wl --show timeline"), ClusterTimeline)


@pytest.mark.parametrize("line, message", [
    ("cluster 0", "n must be an integer >= 1"),
    ("cluster 2 --router fastest", "router must be a Router or one of"),
    ("cluster 2 --workload nothing_here", "no variable 'nothing_here'"),
    ("cluster two", "invalid int value: 'two'"),
])
def test_cluster_magic_bad_arguments_are_a_usage_line(ipython, line, message):
    with pytest.raises(UsageError, match=message):
        ipython.run_line_magic("llm", line)
