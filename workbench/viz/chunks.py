"""What each step's batch did, classified once for every view (player, timeline, step plot).

A scheduled chunk is ``decode`` (one token after the prompt), ``recompute`` (a prompt chunk
below the tokens the request had computed before its latest preemption: K/V the preemption
dropped) or ``prefill`` (a prompt chunk computed for the first time). A step whose batch is
empty gets a sentence saying why nothing ran.
"""

from __future__ import annotations


def request_adapters(records) -> dict[str, str]:
    """``request_id -> LoRA adapter name`` for every request the records scheduled under one."""
    return {c.request_id: c.lora_name for r in records for c in r.scheduler_output.scheduled
            if c.lora_name}


def request_label(request_id: str, adapters: dict[str, str]) -> str:
    """A request as the views label it: its id, and its adapter in brackets when it has one."""
    name = adapters.get(request_id)
    return f"{request_id} [{name}]" if name else request_id


def chunk_kinds(records) -> dict[tuple[int, str], str]:
    """``(step, request_id) -> kind`` for every chunk the records scheduled."""
    high_water: dict[str, int] = {}
    kinds: dict[tuple[int, str], str] = {}
    for record in records:
        for event in record.request_events:
            if event.kind == "scheduled":
                kind = "decode"
                if event.is_prefill:
                    kind = "recompute" if event.start < high_water.get(event.request_id, 0) else "prefill"
                kinds[event.step, event.request_id] = kind
            elif event.kind == "preempted":
                high_water[event.request_id] = max(high_water.get(event.request_id, 0),
                                                   event.num_computed_tokens)
    return kinds


def empty_batch_reason(record) -> str | None:
    """Why no request ran in the step (None when its batch was not empty)."""
    so = record.scheduler_output
    if so.scheduled:
        return None
    if so.preempted_request_ids:
        victims = ", ".join(so.preempted_request_ids)
        return (f"empty batch: the running request first in the policy's order needed a new KV block and "
                f"none was free; the policy preempted {victims}, the last its own victim, so no request "
                f"ran in this step.")
    if record.num_waiting:
        return "empty batch: no request was running and the first waiting one did not fit the free KV blocks."
    return "empty batch: there was no request to run."
