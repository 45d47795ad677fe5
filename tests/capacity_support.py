"""A runner with a known capacity, importable by name (process pools and Dask workers)."""


class KneeResult:
    """A RunResult's summary in which p99 TTFT grows linearly with the arrival rate."""

    def __init__(self, workload, config):
        self.ttft = workload.rate / (25.0 * config.max_num_seqs)
        self.n = len(workload)

    def summary(self):
        return {"num_requests": self.n, "num_finished": self.n, "ttft_s_p99": self.ttft, "tpot_s_p99": 0.01,
                "throughput_tok_s": 1.0}


def knee_runner(workload, config):
    """ttft_s_p99 = rate / (25 max_num_seqs): under ``ttft_s_p99 <= 1`` the capacity is
    exactly 25 x max_num_seqs requests/s."""
    return KneeResult(workload, config)
