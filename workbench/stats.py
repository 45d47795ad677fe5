"""Engine statistics: the periodic one-line summary vLLM logs, computed from counters."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

logger = logging.getLogger("workbench")


@dataclass
class StatLogger:
    """Accumulates prompt/generation token counts between two log lines.

    ``maybe_log`` emits at most one line per ``interval`` seconds; ``summary`` formats one
    from the counters since the last line without resetting anything. The prefix-cache hit
    rate comes from the KV cache's cumulative (queries, hits), differenced between lines.
    """

    interval: float = 5.0
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    prefix_mark: tuple[int, int] = (0, 0)  # cumulative (queries, hits) at the last line
    last_log_time: float = field(default_factory=time.monotonic)

    def record(self, *, prompt_tokens: int, generation_tokens: int) -> None:
        self.num_prompt_tokens += prompt_tokens
        self.num_generation_tokens += generation_tokens

    def summary(
        self, *, running: int, waiting: int, kv_usage: float, prefix: tuple[int, int],
        now: float | None = None,
    ) -> str:
        elapsed = max((now or time.monotonic()) - self.last_log_time, 1e-9)
        queries, hits = prefix[0] - self.prefix_mark[0], prefix[1] - self.prefix_mark[1]
        hit_rate = hits / queries if queries else 0.0
        return (
            f"Avg prompt throughput: {self.num_prompt_tokens / elapsed:.1f} tokens/s, "
            f"Avg generation throughput: {self.num_generation_tokens / elapsed:.1f} tokens/s, "
            f"Running: {running} reqs, Waiting: {waiting} reqs, "
            f"KV cache usage: {kv_usage:.1%}, Prefix cache hit rate: {hit_rate:.1%}"
        )

    def maybe_log(
        self, *, running: int, waiting: int, kv_usage: float, prefix: tuple[int, int],
        force: bool = False,
    ) -> str | None:
        now = time.monotonic()
        if not force and now - self.last_log_time < self.interval:
            return None
        line = self.summary(
            running=running, waiting=waiting, kv_usage=kv_usage, prefix=prefix, now=now
        )
        logger.info(line)
        self.num_prompt_tokens = self.num_generation_tokens = 0
        self.prefix_mark = prefix
        self.last_log_time = now
        return line
