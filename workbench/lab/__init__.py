"""The research layer: workloads, runs, comparisons, sweeps and the simulator."""
