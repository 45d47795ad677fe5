"""The effect of a passing free-block queue (exercise 3) in the simulator: hit rate and TTFT.

The learner's queue replaces the engine's own in the block pool (:class:`LearnerFreeQueue`,
an adapter from KVCacheBlocks to block ids) and the engine, on the simulated runner, serves a
shared-prefix workload whose prefixes do not all fit the pool; the engine with its own queue
serves it beside. A request's release reaches the learner as one ``free(block_ids)`` in its
block-table order (the pool hands the blocks over in vLLM's freed order, tail first; the
adapter turns it back), so the learner's rule for one request's blocks is the one that runs.
"""

from __future__ import annotations

from collections.abc import Callable

from workbench.cluster.shared_prefix import shared_prefix_workload
from workbench.config import EngineConfig
from workbench.lab.replay import drive
from workbench.lab.sim.cost_model import as_cost_model
from workbench.lab.sim.simulate import simulated_engine

#: Eight 96-token system prompts (24 blocks each) in a pool of 160 blocks: they do not all fit.
EFFECT_CONFIG = EngineConfig(block_size=4, num_kv_blocks=160, max_model_len=256, enable_prefix_caching=True,
                             keep_warm_s=0.0)
EFFECT_WORKLOAD = shared_prefix_workload(200, 200.0, num_groups=8, prefix_len=96, input_len=(104, 128),
                                         output_len=(2, 8), seed=35)
ABOUT = "shared_prefix_workload(200, rate=200, num_groups=8, prefix_len=96, seed=35), a pool of 160 blocks of 4 tokens"


class LearnerFreeQueue:
    """The block pool's free queue (``popleft``, ``popleft_n``, ``append``, ``extend``,
    ``remove``, ``len``, ``in``) kept by the learner's queue over block ids.
    ``wrap(free_blocks)`` brackets one request's release."""

    def __init__(self, queue, blocks) -> None:
        self.queue, self.blocks = queue, blocks
        self.free = {b.block_id for b in blocks}
        self._released: list | None = None

    def __len__(self) -> int:
        return len(self.free)

    def __contains__(self, block) -> bool:
        return block.block_id in self.free

    def __iter__(self):
        return (self.blocks[i] for i in sorted(self.free))

    def block_ids(self) -> list[int]:
        return sorted(self.free)

    def popleft(self):
        block_id = self.queue.popleft()
        if block_id not in self.free:
            raise ValueError(f"popleft() gave {block_id!r}, which is not a free block.")
        self.free.discard(block_id)
        return self.blocks[block_id]

    def popleft_n(self, n: int) -> list:
        return [self.popleft() for _ in range(n)]

    def append(self, block) -> None:
        self.free.add(block.block_id)
        if self._released is not None:
            self._released.append(block.block_id)
        else:
            self.queue.free([block.block_id])

    def extend(self, blocks) -> None:
        for block in blocks:
            self.append(block)

    def remove(self, block) -> None:
        self.free.discard(block.block_id)
        self.queue.remove(block.block_id)

    def wrap(self, free_blocks: Callable) -> Callable:
        """The pool's ``free_blocks`` with the request's now-free blocks handed over at once,
        in table order (the pool gives them tail first)."""
        def release(ordered_blocks, owner):
            self._released = []
            try:
                free_blocks(ordered_blocks, owner)
                released = self._released[::-1]
            finally:
                self._released = None
            if released:
                self.queue.free(released)
        return release


def run(make_queue: Callable | None) -> dict[str, float]:
    """The effect workload on the engine with ``make_queue``'s queue (None: its own)."""
    engine = simulated_engine(EFFECT_CONFIG, as_cost_model(None), {})
    if make_queue is not None:
        pool = engine.kv_cache.pool
        adapter = LearnerFreeQueue(make_queue([b.block_id for b in pool.blocks]), pool.blocks)
        pool.free_queue = adapter
        pool.free_blocks = adapter.wrap(pool.free_blocks)
    return drive(engine, EFFECT_WORKLOAD, exclusive=True).summary()


def effect_table(make_queue: Callable) -> str:
    """Yours beside the engine's own queue: prefix hit rate, TTFT p50 / p99 (ms)."""
    head = f"  {'':<11}{'hit rate':>10}{'TTFT p50':>10}{'TTFT p99':>10}   (ms)"
    rows = []
    for label, queue in (("yours", make_queue), ("reference", None)):
        try:
            s = run(queue)
        except Exception as exc:  # the learner's queue on a workload the grader did not draw
            rows.append(f"  {label:<11}could not run: {type(exc).__name__}: {exc}")
            continue
        rows.append(f"  {label:<11}{s['prefix_hit_rate']:>10.3f}{s['ttft_s_p50'] * 1e3:>10.2f}"
                    f"{s['ttft_s_p99'] * 1e3:>10.2f}")
    return f"On a larger workload ({ABOUT}, simulated):\n" + "\n".join([head] + rows)
