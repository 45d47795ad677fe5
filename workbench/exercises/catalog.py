"""The exercises: each one's stub (what the learner fills in), reference (the engine's own
piece in the stub's shape), grader and hints. ``notebooks/exercises/NN_name.ipynb`` holds the
prose and the stub; ``check(name, solution)`` grades."""

from __future__ import annotations

import textwrap
from collections.abc import Callable
from dataclasses import dataclass

from workbench.exercises import batch_effect, batching, eviction, policy, rejection, routing
from workbench.exercises.grader import CheckResult


@dataclass(frozen=True)
class Exercise:
    number: int
    name: str
    title: str
    stub: str
    reference: Callable[[], object]  # () -> the reference in the stub's shape
    grade: Callable[..., CheckResult]  # (solution, **options) -> CheckResult
    hints: tuple[str, ...]

    @property
    def notebook(self) -> str:
        return f"notebooks/exercises/{self.number:02d}_{self.name}.ipynb"


_SCHEDULE_STUB = textwrap.dedent('''\
    def schedule(running, waiting, max_num_batched_tokens, max_num_seqs):
        """One step's batch: a list of (request_id, num_new_tokens).

        running, waiting: lists of RequestView (request_id, num_prompt_tokens, num_tokens,
        num_computed_tokens), running in their order, waiting in serving order.
        """
        batch = []
        # your code here
        return batch
''')

_ADMISSION_HINTS = (
    "Serve the running requests before anyone waiting: each gets what it has left to compute, "
    "as far as the budget goes.",
    "A waiting request is admitted only while fewer than max_num_seqs requests run -- count the "
    "running ones too.",
    "With chunked prefill off, a waiting request needs all its tokens in this step: it fits when "
    "its tokens are <= the budget left (not <). The first one that does not fit stops the pass.",
)

_CHUNKED_HINTS = (
    "Every request -- running or waiting -- gets min(tokens it has left, budget left).",
    "A running request may still be in its prompt (num_computed_tokens < num_prompt_tokens): "
    "it continues with its next chunk, not with one decode token.",
    "A waiting request that does not fit whole is split: it takes what is left of the budget "
    "and runs its next chunk in a later step.",
)

EXERCISES: dict[str, Exercise] = {}


def register(exercise: Exercise) -> None:
    EXERCISES[exercise.name] = exercise


register(Exercise(
    1, "admission", "The waiting-queue admission loop under a token budget and max_num_seqs",
    _SCHEDULE_STUB, lambda: batching.admission_reference,
    lambda solution, **kw: batch_effect.check_with_effect("admission", solution, False, hints=_ADMISSION_HINTS,
                                                          **kw),
    _ADMISSION_HINTS))

register(Exercise(
    4, "chunked_prefill", "Chunked prefill: splitting long prompts under the budget",
    _SCHEDULE_STUB, lambda: batching.chunked_prefill_reference,
    lambda solution, **kw: batch_effect.check_with_effect("chunked_prefill", solution, True, hints=_CHUNKED_HINTS,
                                                          **kw),
    _CHUNKED_HINTS))


_EVICTION_STUB = textwrap.dedent('''\
    class FreeBlockQueue:
        """The free KV blocks (block ids) in eviction order."""

        def __init__(self, block_ids):
            """Every block starts free, in id order: block 0 is evicted first."""
            # your code here

        def free(self, block_ids):
            """A request released these blocks (in its block-table order); none has a user now."""
            # your code here

        def remove(self, block_id):
            """A prefix-cache hit takes this free block back into use."""
            # your code here

        def popleft(self):
            """The next block to reuse (its cached content is evicted): return its id."""
            # your code here

        def __iter__(self):
            """Optional: the queue, next evicted first (the grader shows it)."""
            return iter(())
''')

_EVICTION_HINTS = (
    "Evict the block freed longest ago first (least recently used): free() adds at the back, "
    "popleft() takes from the front.",
    "A prefix-cache hit on a free block puts it back in use: remove() must take it out of the queue, "
    "or popleft() will hand out a block a request is reading.",
    "vLLM adds a freed request's blocks tail first (its last block first), so its last block -- the "
    "one least likely shared with another prompt -- is evicted before its first.",
)

register(Exercise(
    3, "eviction", "The prefix cache's eviction order: the free-block queue",
    _EVICTION_STUB, lambda: eviction.ReferenceFreeBlockQueue,
    lambda solution, **kw: eviction.check_eviction(solution, hints=_EVICTION_HINTS, **kw),
    _EVICTION_HINTS))


_POLICY_STUB = textwrap.dedent('''\
    from workbench.core.sched.policies import SchedulingPolicy


    class ShortestPromptFirst(SchedulingPolicy):
        """Serve the waiting request with the fewest prompt tokens first."""

        name = "my_spf"

        def sort_key(self, request):
            """The waiting-queue key: the smallest key is served first."""
            # your code here
            return 0
''')

_POLICY_HINTS = (
    "The key is a tuple compared element by element: put what decides first, first.",
    "Shortest prompt first orders by request.num_prompt_tokens -- not num_tokens, which grows with "
    "the generated tokens of a preempted request.",
    "Break ties by request.arrival_time: a preempted request re-enters the queue later than "
    "requests that arrived after it, and must not lose its place to them.",
)

register(Exercise(
    2, "policy", "A scheduling policy: shortest prompt first, and the starvation it causes",
    _POLICY_STUB, lambda: policy.ShortestPromptFirstPolicy,
    lambda solution, **kw: policy.check_policy(solution, hints=_POLICY_HINTS, **kw),
    _POLICY_HINTS))


_REJECTION_STUB = textwrap.dedent('''\
    import torch


    def verify(p, q, draft, generator):
        """One draft position: p, q are the target's and the draft's probabilities (1-D tensors),
        draft a token drawn from q. Return (accepted, token): (True, draft), or (False, a token
        drawn from the residual distribution). Draw randomness from generator only."""
        # your code here
        return True, draft
''')

_REJECTION_HINTS = (
    "Accept the draft with probability min(1, p[draft] / q[draft]): compare one uniform draw "
    "(torch.rand(1, generator=generator)) with that ratio.",
    "On rejection, draw from the residual: the part of p that q does not already cover, "
    "max(0, p - q), normalised (torch.multinomial normalises for you).",
    "Both terms of the residual matter: drawing from p alone over-weights the tokens the draft "
    "model proposes often; max(0, q - p) is the draft's excess, not the target's.",
)

register(Exercise(
    5, "rejection", "Speculative decoding's rejection sampler: accept, or resample from the residual",
    _REJECTION_STUB, lambda: rejection.reference_verify,
    lambda solution, **kw: rejection.check_rejection(solution, hints=_REJECTION_HINTS, **kw),
    _REJECTION_HINTS))


_ROUTER_STUB = textwrap.dedent('''\
    def route(prompt_blocks, cached, waiting):
        """The replica (its index) an arriving request is sent to.

        prompt_blocks: the hashes of the prompt's full KV blocks, first block first (a block's
        hash names its whole prefix). cached: one set per replica, the block hashes its prefix
        cache holds now. waiting: one int per replica, the requests in its waiting queue.
        """
        # your code here
        return 0
''')

_ROUTER_HINTS = (
    "For each replica count the prompt's blocks it holds from the first one on, stopping at the "
    "first block it does not hold: only a cached *prefix* is reused.",
    "Send the request to the replica with the most leading blocks cached -- even if its queue is "
    "longer; the queue only decides between replicas that hold equally many.",
    "Between replicas holding equally many leading blocks (often none), pick the one with the "
    "fewest waiting requests -- not simply the lowest index.",
)

register(Exercise(
    6, "router", "A prefix-aware router: the longest cached prefix, then the shortest queue",
    _ROUTER_STUB, lambda: routing.reference_route,
    lambda solution, **kw: routing.check_routing(solution, hints=_ROUTER_HINTS, **kw),
    _ROUTER_HINTS))
