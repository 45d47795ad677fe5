"""Statistics: per-step SchedulerStats, per-request metrics, vLLM's stat loggers and Prometheus series."""
