"""Speculative decoding as the views draw it: each draft's fate, the slots drafts wrote, the
budget they took, acceptance by draft position and tokens emitted per step.

Every function reads StepRecords only (``record.spec_decode``: request id ->
``SpecDecodeResult``; ``scheduler_output.scheduled``: the drafts' positions), so a replayed
history draws the same. A draft is ``accepted`` (the target agreed: a prefix of the drafts)
or ``rejected`` (the first the target refused and every draft after it); the step's own
token is the ``bonus`` token when every draft was accepted, else the ``recovered`` token the
rejection sampler drew in place of the first rejected draft (vLLM's names). A stop condition
inside an accepted run (eos, a stop string, max_tokens) emits fewer tokens than marked.
Each fate has a colour and a mark character, so it also reads without colour.
"""

from __future__ import annotations

from matplotlib.patches import Patch
from matplotlib.ticker import MaxNLocator

from workbench.metrics.spec_stats import spec_decode_summary
from workbench.metrics.spec_stats import acceptance_by_position
from workbench.viz.colors import SPEC_COLORS
from workbench.viz.plots import _axes, _records

SPEC_MEANINGS = {
    "accepted": "draft accepted (the target's token agreed)",
    "rejected": "draft rejected (its slot is written again by the next step)",
    "bonus": "bonus token (every draft accepted: the target's next token comes free)",
    "recovered": "recovered token (the target's own token in place of the first rejected draft)",
}


def draft_fates(record, request_id: str) -> list[tuple[int, str]]:
    """``(token id, fate)`` per draft the request verified in the step, then its sampled
    token as ``bonus`` or ``recovered``; [] when the request did not speculate there."""
    result = record.spec_decode.get(request_id)
    if result is None:
        return []
    fates = [(t, "accepted" if j < result.num_accepted else "rejected")
             for j, t in enumerate(result.draft_token_ids)]
    sampled = record.sampled_token_ids.get(request_id)
    if sampled is not None:
        fates.append((sampled, "bonus" if result.bonus else "recovered"))
    return fates


def draft_slots(record, block_size: int) -> dict[int, dict[int, tuple[str, str]]]:
    """``block id -> {slot: (request id, fate)}`` for the KV slots the step's drafts wrote:
    draft j of a chunk sits at position ``seq_len - len(drafts) + j`` of its request, so in
    block ``block_ids[pos // block_size]``, slot ``pos % block_size``. Rejected slots hold
    K/V of tokens the request does not have: the next step overwrites them (a block holding
    only rejected drafts goes back to the pool at once)."""
    slots: dict[int, dict[int, tuple[str, str]]] = {}
    for chunk in record.scheduler_output.scheduled:
        result = record.spec_decode.get(chunk.request_id)
        if result is None:
            continue
        first = chunk.seq_len - len(chunk.spec_token_ids)
        for j in range(len(chunk.spec_token_ids)):
            pos = first + j
            fate = "accepted" if j < result.num_accepted else "rejected"
            block = chunk.block_ids[pos // block_size]
            slots.setdefault(block, {})[pos % block_size] = (chunk.request_id, fate)
    return slots


def budget_split(record) -> dict[str, int]:
    """The step's scheduled tokens by kind: ``prefill``, ``decode`` (known tokens of decoding
    requests) and ``drafts`` (tokens scheduled only to be verified); they sum to the total."""
    drafts = record.scheduler_output.num_spec_tokens
    return {"prefill": record.num_prefill_tokens, "decode": record.num_decode_tokens - drafts,
            "drafts": drafts}


def emitted_tokens(record, request_id: str) -> int:
    """Tokens the step gave the request as marked: its accepted drafts plus its sampled
    token (0 when it sampled none)."""
    if request_id not in record.sampled_token_ids:
        return 0
    result = record.spec_decode.get(request_id)
    return 1 + (result.num_accepted if result is not None else 0)


def plot_acceptance(history, ax=None, label: str | None = None):
    """Acceptance rate by draft position (1 = the first draft), with each position's count
    of drafts over its bar. A position is reached only when the drafts before it exist, so
    the rate can rise or fall along the positions."""
    rows = acceptance_by_position(history[:])
    ax = _axes(ax, (5, 3))
    if not rows:
        ax.set_title("no drafts verified")
        return ax
    x = [r["position"] + 1 for r in rows]
    bars = ax.bar(x, [r["rate"] for r in rows], color=SPEC_COLORS["accepted"], label=label)
    for bar, r in zip(bars, rows):
        ax.annotate(f"{r['accepted']}/{r['drafted']}", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center", va="bottom", fontsize=8)
    ax.set_ylim(0, 1.15)
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance rate")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    summary = spec_decode_summary(history[:])
    ax.set_title(f"acceptance {summary['spec_acceptance_rate']:.0%}, mean accepted length "
                 f"{summary['spec_mean_acceptance_length']:.2f}", fontsize=10)
    return ax


def plot_tokens_per_step(history, ax=None, last: int = 200):
    """Tokens emitted per step (every request together): the target's own sampled tokens
    and, stacked on them, the accepted drafts (the tokens speculation added)."""
    records = _records(history, last)
    ax = _axes(ax)
    if not records:
        ax.set_title("no steps yet")
        return ax
    steps = [r.step for r in records]
    own = [len(r.sampled_token_ids) for r in records]
    extra = [sum(res.num_accepted for res in r.spec_decode.values()) for r in records]
    ax.bar(steps, own, width=0.85, color="0.6")
    ax.bar(steps, extra, bottom=own, width=0.85, color=SPEC_COLORS["accepted"])
    ax.set_xlabel("step")
    ax.set_ylabel("tokens emitted")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    total = sum(own) + sum(extra)
    ax.set_title(f"{total} tokens in {len(records)} steps ({total / len(records):.2f} per step)", fontsize=10)
    ax.legend(handles=[Patch(color="0.6", label="sampled by the target"),
                       Patch(color=SPEC_COLORS["accepted"], label="accepted drafts")],
              fontsize="small", loc="upper right")
    return ax
