"""Exercise 3: the prefix cache's eviction order (the free-block queue).

The learner writes a ``FreeBlockQueue`` over block ids with vLLM's four operations:
``__init__(block_ids)`` (all free, block 0 evicted first), ``free(block_ids)`` (a request
released these blocks, given in its block-table order, each now unused), ``remove(block_id)``
(a prefix-cache hit takes a free block back) and ``popleft()`` (the next block to reuse,
evicting what it caches). The rule (:class:`~workbench.core.block_pool.FreeBlockQueue` and
:func:`~workbench.core.kv_cache_manager.freed_block_order`): least recently freed first, and a
request's blocks join the back tail first, so its last block -- the least likely to be shared --
is evicted before its first.

The grader steps the engine (simulated runner, prefix caching on, a pool small enough to
evict) and replays each step's KV events on the learner's queue and the reference beside it:
a fresh block handed out is a ``popleft()`` whose answer must be the block the engine took; a
hit on a free block is a ``remove()``; a request's blocks reaching no user are one ``free()``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from hypothesis import strategies as st

from workbench.core.block_pool import FreeBlockQueue, KVCacheBlock
from workbench.core.kv_cache_manager import freed_block_order
from workbench.core.kv_events import BlockAllocated, BlockFreed
from workbench.exercises.grader import CheckResult, Mismatch, call_solution, first_failure, side_by_side, sim_engine
from workbench.sampling_params import SamplingParams

BLOCK_SIZE = 2


class ReferenceFreeBlockQueue:
    """The engine's own free queue and freed-block order, in the stub's shape (block ids)."""

    def __init__(self, block_ids: Sequence[int]):
        self._blocks = {i: KVCacheBlock(i) for i in block_ids}
        self._queue = FreeBlockQueue(self._blocks[i] for i in block_ids)

    def free(self, block_ids: Sequence[int]) -> None:
        for block in freed_block_order([self._blocks[i] for i in block_ids]):
            self._queue.append(block)

    def remove(self, block_id: int) -> None:
        self._queue.remove(self._blocks[block_id])

    def popleft(self) -> int:
        return self._queue.popleft().block_id

    def __iter__(self):
        return iter(self._queue.block_ids())


@dataclass(frozen=True)
class EvictionWorkload:
    """A pool of ``num_blocks`` blocks of :data:`BLOCK_SIZE` tokens and requests
    ``(request_id, arrival_step, prompt_token_ids, max_tokens)``."""

    num_blocks: int
    max_num_seqs: int
    requests: tuple[tuple[str, int, tuple[int, ...], int], ...]

    def __str__(self) -> str:
        reqs = ", ".join(f"{rid}(arrives step {a}, prompt {list(p)}, max_tokens {m})" for rid, a, p, m in self.requests)
        return f"num_blocks={self.num_blocks} of {BLOCK_SIZE} tokens, max_num_seqs={self.max_num_seqs}, requests: {reqs}"


@st.composite
def eviction_workloads(draw) -> EvictionWorkload:
    """Prompts that share one of two prefixes (or none), in a pool with little to spare."""
    prefixes = [tuple(range(10 + 10 * k, 10 + 10 * k + BLOCK_SIZE * draw(st.integers(1, 3)))) for k in range(2)]
    requests, need, fresh = [], 1, 100
    for i in range(draw(st.integers(2, 6))):
        choice = draw(st.sampled_from([None, 0, 1]))
        suffix = draw(st.integers(1, 4))
        prompt = (prefixes[choice] if choice is not None else ()) + tuple(range(fresh, fresh + suffix))
        fresh += suffix
        max_tokens = draw(st.integers(1, 3))
        need = max(need, -(-(len(prompt) + max_tokens - 1) // BLOCK_SIZE))
        requests.append((f"r{i}", draw(st.integers(0, 5)), prompt, max_tokens))
    return EvictionWorkload(need + draw(st.integers(0, 4)), draw(st.integers(1, 3)), tuple(requests))


def run_eviction(workload: EvictionWorkload, make_queue: Callable):
    """Step the engine, replaying its KV events on ``make_queue``'s queue and the reference's;
    Mismatch at the first block handed out differently. Returns the engine."""
    engine = sim_engine(block_size=BLOCK_SIZE, num_kv_blocks=workload.num_blocks, max_num_seqs=workload.max_num_seqs,
                        max_num_batched_tokens=64, enable_prefix_caching=True)
    ids = list(range(workload.num_blocks))
    mine = call_solution(0, make_queue, list(ids))
    ref = ReferenceFreeBlockQueue(ids)
    refs = dict.fromkeys(ids, 0)
    tables: dict[str, list[int]] = {}
    freed_at: dict[int, str] = {}  # block -> how it last joined the queue
    pending = sorted(workload.requests, key=lambda r: r[1])
    step = 0
    while pending or engine.has_unfinished_requests():
        while pending and (pending[0][1] <= step or not engine.has_unfinished_requests()):
            rid, _, prompt, max_tokens = pending.pop(0)
            engine.add_request(rid, list(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True, detokenize=False))
        engine.step()
        engine.scheduler.check_invariants()
        events = list(engine.history[-1].kv_events)
        i = 0
        while i < len(events):
            event = events[i]
            if isinstance(event, BlockFreed):  # one request's release: a run of its BlockFreed events
                owner, released = event.request_id, []
                while i < len(events) and isinstance(events[i], BlockFreed) and events[i].request_id == owner:
                    refs[events[i].block_id] -= 1
                    released.append(events[i].block_id)
                    i += 1
                table = tables.pop(owner, [])
                now_free = [b for b in table if b in released and refs[b] == 0]
                kept = [b for b in table if b not in released]
                if kept:
                    tables[owner] = kept
                if now_free:
                    ref.free(list(now_free))
                    call_solution(step, lambda: mine.free(list(now_free)))
                    for pos, b in enumerate(now_free):
                        freed_at[b] = (f"freed at step {step} by {owner}, the {_nth(pos + 1)} of the "
                                       f"{len(now_free)} blocks it released, in table order")
                continue
            if isinstance(event, BlockAllocated):
                b, owner = event.block_id, event.request_id
                if event.prefix_hit:
                    if refs[b] == 0:
                        ref.remove(b)
                        call_solution(step, lambda: mine.remove(b))
                        freed_at[b] = f"taken back from the free queue by a prefix hit of {owner} at step {step}"
                else:
                    before, yours = list(ref), _order(mine)
                    expected = ref.popleft()
                    if expected != b:
                        raise RuntimeError(f"the reference queue gave block {expected}, the engine took {b}")
                    got = call_solution(step, lambda: mine.popleft())
                    if got != b:
                        raise Mismatch(step, _explain(step, owner, b, got, before, yours, freed_at), b, got,
                                       _view(engine, step, owner, b, got, before, yours))
                refs[b] += 1
                tables.setdefault(owner, []).append(b)
            i += 1
        step += 1
    return engine


def _order(queue) -> list[int] | None:
    try:
        return [int(b) for b in queue]
    except TypeError:
        return None


def _nth(n: int) -> str:
    return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


def _explain(step, owner, expected, got, before, yours, freed_at) -> str:
    def why(b):
        return freed_at.get(b, "free from the start") if isinstance(b, int) else "not a block id"

    lines = [f"step {step}: {owner} needed a new block. The engine took block {expected} from the front of its "
             f"free queue ({why(expected)}); your popleft() gave {got!r} ({why(got)}).",
             f"  The engine's free queue just before, front (next evicted) first: {before}"]
    if yours is not None:
        lines.append(f"  Yours just before (iterated): {yours}")
    if not isinstance(got, int):
        lines.append(f"  popleft() must return a block id (an int), not {type(got).__name__}.")
    elif got not in before:
        lines.append(f"  Block {got!r} is not free in the engine: a request is using it.")
    elif got == before[-1] and len(before) > 1:
        lines.append("  Yours took the back of the queue, the block freed most recently.")
    else:
        lines.append(f"  Yours is {_nth(before.index(got) + 1)} in the engine's queue.")
    return "\n".join(lines)


def _view(engine, step, owner, expected, got, before, yours):
    def make():
        from workbench.viz.player import StepPlayer

        player = StepPlayer(engine, controls=False, live_updates=False)
        player.show(step)
        rows = [(f"block handed to {owner}", str(expected), str(got)),
                ("free queue just before, front first", str(before), "-" if yours is None else str(yours))]
        return side_by_side(f"step {step}: which block is evicted", rows, player)

    return make


def check_eviction(solution: Callable, *, workloads: Sequence[EvictionWorkload] | None = None,
                   max_examples: int = 60, hints=(), with_effect: bool = True) -> CheckResult:
    """Grade a FreeBlockQueue class (or any callable making one from the block ids); on success
    (``with_effect``) the message ends with its hit rate and TTFT beside the engine's queue's
    on a larger workload."""
    found = first_failure(eviction_workloads(), lambda w: run_eviction(w, solution), max_examples=max_examples,
                          workloads=workloads)
    if found is None:
        count = max_examples if workloads is None else len(workloads)
        message = f"your queue evicted the engine's block every time in {count} workloads."
        if with_effect:
            from workbench.exercises.eviction_effect import effect_table

            message += "\n" + effect_table(solution)
        return CheckResult("eviction", True, message, score=f"{count}/{count} workloads")
    workload, m = found
    label = "Smallest workload found" if workloads is None else "Workload"
    return CheckResult("eviction", False, f"{m.message}\n  {label}: {workload}", m.step, m.expected, m.got,
                       workload, hints=hints, view=m.view)
