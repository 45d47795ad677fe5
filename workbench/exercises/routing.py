"""Exercise 6: a prefix-aware router.

The learner writes ``route(prompt_blocks, cached, waiting) -> replica index``: the prompt's
full blocks' chained hashes (first block first), one set per replica of the block hashes its
prefix cache holds now (as its KV events describe it), and one waiting-queue length per
replica. The rule: the replica whose cache holds the most *leading* blocks of the prompt
(the longest cached prefix); among those, the one with the fewest waiting requests; any
replica still tied is right.

The reference is the cluster's :class:`~workbench.cluster.precise_prefix.PrecisePrefix`
router (llm-d's precise prefix-cache scorer, fed by the replicas' KV events) with only its
``prefix`` and ``queue`` scorers, the prefix weighted so that it always decides first
(:data:`REFERENCE_WEIGHTS`: one cached block more outweighs any queue difference); its
max-score picker breaks the remaining ties at random, so the grader accepts any of them.

The grader runs a small simulated cluster (:meth:`Cluster.simulated`) on hypothesis-drawn
shared-prefix workloads (:func:`~workbench.cluster.shared_prefix.shared_prefix_workload`)
with the learner's function routing and the reference asked beside it at every arrival, and
stops at the first decision outside the reference's best replicas.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from hypothesis import strategies as st

from workbench.cluster.cluster import Cluster
from workbench.cluster.precise_prefix import PrecisePrefix
from workbench.cluster.router import RoutedRequest, Router, Routing
from workbench.cluster.shared_prefix import shared_prefix_workload
from workbench.core.kv_cache_utils import hash_request_blocks
from workbench.exercises.grader import CheckResult, Mismatch, call_solution, first_failure
from workbench.lab.workload import Workload

BLOCK_SIZE = 4
#: One cached block of a prompt of at most 256 blocks is worth > 1000 / 256 > 1, the most the
#: queue score (in [0, 1]) can differ by: the prefix decides, the queue breaks its ties.
REFERENCE_WEIGHTS = {"prefix": 1000.0, "queue": 1.0}


def reference_router() -> PrecisePrefix:
    """The cluster's precise-prefix router, prefix first and the waiting queue on ties."""
    return PrecisePrefix(dict(REFERENCE_WEIGHTS), seed=0)


def reference_route(prompt_blocks: Sequence, cached: Sequence[set], waiting: Sequence[int]) -> int:
    """The reference's rule in the stub's shape: the most leading blocks cached, then the
    fewest waiting; ties to the lowest index (the router itself draws among them at random)."""
    return min(range(len(cached)), key=lambda i: (-leading_blocks(prompt_blocks, cached[i]), waiting[i], i))


@dataclass(frozen=True)
class RoutingWorkload:
    """``num_replicas`` simulated replicas of ``num_kv_blocks`` blocks of :data:`BLOCK_SIZE`
    tokens each, serving ``workload`` (token-id prompts, arrivals in seconds)."""

    num_replicas: int
    num_kv_blocks: int
    workload: Workload
    about: str = ""
    max_model_len: int = 64

    def config(self) -> dict:
        return {"block_size": BLOCK_SIZE, "num_kv_blocks": self.num_kv_blocks, "max_model_len": self.max_model_len,
                "enable_prefix_caching": True, "keep_warm_s": 0.0}

    def __str__(self) -> str:
        return (f"{self.num_replicas} replicas of {self.num_kv_blocks} blocks of {BLOCK_SIZE} tokens, "
                f"{len(self.workload)} requests ({self.about or 'given'})")


@st.composite
def routing_workloads(draw) -> RoutingWorkload:
    """Shared-prefix workloads, small: 2-3 replicas, a few groups, arrivals fast enough to queue."""
    num_requests, num_groups = draw(st.integers(3, 14)), draw(st.integers(1, 3))
    prefix_len = BLOCK_SIZE * draw(st.integers(1, 5))
    rate, seed = draw(st.sampled_from([20.0, 200.0, 2000.0])), draw(st.integers(0, 2**16))
    workload = shared_prefix_workload(num_requests, rate, num_groups=num_groups, prefix_len=prefix_len,
                                      input_len=(prefix_len + 1, prefix_len + 3 * BLOCK_SIZE), output_len=(1, 4),
                                      seed=seed)
    about = (f"shared_prefix_workload({num_requests}, rate={rate}, num_groups={num_groups}, "
             f"prefix_len={prefix_len}, seed={seed})")
    return RoutingWorkload(draw(st.integers(2, 3)), draw(st.integers(24, 48)), workload, about)


def leading_blocks(prompt_blocks: Sequence, held) -> int:
    n = 0
    while n < len(prompt_blocks) and prompt_blocks[n] in held:
        n += 1
    return n


class GradedRouter(Router):
    """Routes with the learner's function; with ``grade``, asks the reference beside it at
    every arrival and raises :class:`Mismatch` at the first choice outside its best replicas."""

    name = "yours"
    reads_kv_events = True

    def __init__(self, solution: Callable, grade: bool = True) -> None:
        self.solution, self.grade = solution, grade
        self.reference = reference_router()
        self.decision = 0

    def on_kv_events(self, replica: int, batch) -> None:
        self.reference.on_kv_events(replica, batch)

    def route(self, request: RoutedRequest, replicas) -> Routing:
        k, n = self.decision, len(replicas)
        self.decision += 1
        blocks = hash_request_blocks(request.prompt_token_ids, BLOCK_SIZE)
        held = [self.reference.index.blocks.get(i, set()) for i in range(n)]
        waiting = [r.num_waiting for r in replicas]
        ref = self.reference.route(request, replicas)
        got = call_solution(k, self.solution, list(blocks), [frozenset(h) for h in held], list(waiting))
        valid = isinstance(got, int) and not isinstance(got, bool) and 0 <= got < n
        if not self.grade:
            if not valid:
                raise ValueError(f"route() returned {got!r}; replicas are 0..{n - 1}.")
            return Routing(got, ref.scores)
        best = max(ref.scores["total"])
        tied = [i for i, t in enumerate(ref.scores["total"]) if t == best]
        if not valid or got not in tied:
            cached = [leading_blocks(blocks, h) for h in held]
            raise Mismatch(k, _explain(k, request, len(blocks), cached, waiting, tied, got, n), tied, got,
                           _view(k, request.request_id, len(blocks), cached, waiting, tied, got,
                                 replicas[tied[0]].engine))
        return Routing(got, ref.scores)


def _explain(k, request, num_blocks, cached, waiting, tied, got, n) -> str:
    ref = tied[0] if len(tied) == 1 else f"one of {tied}"
    lines = [f"decision {k}: request {request.request_id} (arrives at {request.arrival:.4f} s, {num_blocks} full "
             f"prompt blocks). The reference sends it to replica {ref}; yours to replica {got!r}.",
             "  Candidates: " + "; ".join(f"replica {i}: {cached[i]} of {num_blocks} leading blocks cached, "
                                          f"{waiting[i]} waiting" for i in range(n))]
    if not (isinstance(got, int) and not isinstance(got, bool) and 0 <= got < n):
        lines.append(f"  route() must return a replica index, 0..{n - 1}.")
    elif cached[got] < cached[tied[0]]:
        lines.append(f"  Yours holds a shorter cached prefix of this prompt ({cached[got]} blocks) than replica "
                     f"{tied[0]} ({cached[tied[0]]}).")
    else:
        lines.append(f"  Both hold {cached[got]} leading blocks: the tie goes to the fewest waiting requests "
                     f"(replica {tied[0]}: {waiting[tied[0]]}; yours: {waiting[got]}).")
    return "\n".join(lines)


def _view(k, request_id, num_blocks, cached, waiting, tied, got, engine):
    """The decision side by side, above the StepPlayer of the reference's replica at its last
    step (its block map: the prefix it holds), when it has stepped."""
    def make():
        from workbench.exercises.grader import side_by_side
        from workbench.viz.player import StepPlayer

        rows = [("replica chosen", " or ".join(map(str, tied)), str(got))]
        rows += [(f"replica {i}: leading blocks cached / waiting", f"{c} of {num_blocks} / {w}",
                  f"{c} of {num_blocks} / {w}") for i, (c, w) in enumerate(zip(cached, waiting))]
        player = None
        if len(engine.history):
            player = StepPlayer(engine, controls=False, live_updates=False)
            player.show(engine.history[-1].step)
        return side_by_side(f"decision {k}: where {request_id} goes", rows, player)

    return make


def run_routing(workload: RoutingWorkload, solution: Callable, grade: bool = True):
    """Run the cluster with ``solution`` routing (graded at every arrival when ``grade``)."""
    cluster = Cluster.simulated(workload.num_replicas, workload.config(), router=GradedRouter(solution, grade))
    return cluster.run(workload.workload)


#: The larger workload a passing router is timed on (the effect in the simulator).
#: Twelve 192-token system prompts, more than one replica's cache holds.
EFFECT_WORKLOAD = RoutingWorkload(4, 200, shared_prefix_workload(
    240, 300.0, num_groups=12, prefix_len=192, input_len=(208, 256), output_len=(4, 16), seed=7),
    "shared_prefix_workload(240, rate=300, num_groups=12, prefix_len=192, seed=7)", max_model_len=512)


def effect(solution: Callable, workload: RoutingWorkload = EFFECT_WORKLOAD) -> str:
    """A table: prefix hit rate and TTFT p50 / p99 of ``solution`` beside the reference router
    and round robin, on ``workload`` (simulated)."""
    cluster = Cluster.simulated(workload.num_replicas, workload.config())
    rows = []
    for label, router in (("yours", GradedRouter(solution, grade=False)), ("reference", reference_router()),
                          ("round_robin", "round_robin")):
        s = cluster.with_router(router).run(workload.workload).summary()
        rows.append(f"  {label:<12}{s['prefix_hit_rate']:>10.3f}{s['ttft_s_p50'] * 1e3:>12.2f}"
                    f"{s['ttft_s_p99'] * 1e3:>12.2f}")
    head = f"  {'router':<12}{'hit rate':>10}{'TTFT p50':>12}{'TTFT p99':>12}   (ms)"
    return f"On a larger workload ({workload}, simulated):\n" + "\n".join([head] + rows)


def check_routing(solution: Callable, *, workloads: Sequence[RoutingWorkload] | None = None,
                  max_examples: int = 25, hints=(), with_effect: bool = True) -> CheckResult:
    """Grade a ``route(prompt_blocks, cached, waiting)`` function."""
    found = first_failure(routing_workloads(), lambda w: run_routing(w, solution), max_examples=max_examples,
                          workloads=workloads)
    if found is None:
        count = max_examples if workloads is None else len(workloads)
        message = f"your router chose one of the reference's best replicas at every arrival of {count} workloads."
        if with_effect:
            message += "\n" + effect(solution)
        return CheckResult("router", True, message, score=f"{count}/{count} workloads", unit="decision")
    workload, m = found
    label = "Smallest workload found" if workloads is None else "Workload"
    return CheckResult("router", False, f"{m.message}\n  {label}: {workload}", m.step, m.expected, m.got,
                       workload, hints=hints, view=m.view, unit="decision")
