"""The features of a step's batch that its duration is modelled from (see CostModel).

All but the last two are read from the SchedulerOutput alone, so a real run's records and a
simulated step give the same numbers; those two come from the steps around it, counted by the
caller in step order:

* ``step``: 1 for every step that runs a batch (fixed cost: launches, Python, the driver);
* ``prefill_step``: 1 for a step with at least one prefill chunk (the prefill path's own
  fixed cost: its attention plan, masks and kernels; about 1.2 ms for the embedded model on
  CPU, against 0.8 ms for a whole one-sequence decode step);
* ``prefill_tokens``: tokens of prefill chunks (weights x tokens: the matmuls);
* ``prefill_chunks``: prefill chunks (each is its own attention call per layer, with its own
  gathers and mask);
* ``decode_seqs``: decode chunks, one token each (matmuls, sampling, per-row work);
* ``decode_seqs_sqrt``: its square root -- a decode's cost per sequence falls as the batch
  grows (one row is a matrix-vector product on one thread, many rows a matrix product on all),
  so the cost is concave in the batch size;
* ``decode_context``: KV tokens the decode rows attend to (sum of their ``seq_len``);
* ``prefill_attention``: query x key pairs of the prefill chunks, ``q * (computed + (q + 1) / 2)``
  per chunk (a chunk's tokens times the context they attend to, causal);
* ``spec_tokens``: draft tokens verified (speculative decoding): the target's extra query
  tokens, and for a draft model its forward passes that proposed them;
* ``spec_seqs``: decode rows that verify drafts (their multi-token attention, the rejection
  sampler's per-row work, and the proposer's per-request cost).
* ``lora_tokens``: tokens computed under a LoRA adapter (the low-rank update per token);
* ``lora_adapters``: distinct adapters in the batch (a gather / kernel launch set each);
* ``lora_loads``: adapters copied into a device slot for this step -- not in the
  SchedulerOutput: the caller counts them (:class:`~workbench.lab.sim.lora_slots.LoRASlots`);
* ``after_prefill``: 1 when the step just before ran a prefill chunk. That step's first tokens
  are processed (outputs, detokenizer state) in the time counted towards this one, and its
  large activations have pushed weights and KV out of the CPU's caches: measured on the
  project's VM at 20 requests/s, a decode step right after a prefill ran 12% (0.42 ms) over a
  model without this feature, the one after it 5%, later ones within 2%.
"""

from __future__ import annotations

from workbench.core.sched.output import SchedulerOutput

FEATURES = ("step", "prefill_step", "prefill_tokens", "prefill_chunks", "decode_seqs", "decode_seqs_sqrt", "decode_context",
            "prefill_attention", "spec_tokens", "spec_seqs", "lora_tokens", "lora_adapters", "lora_loads",
            "after_prefill")
#: The index of ``prefill_step`` in FEATURES: a step's features say whether it ran a prefill.
PREFILL_STEP = FEATURES.index("prefill_step")


def step_features(so: SchedulerOutput, lora_loads: int = 0, after_prefill: bool = False) -> tuple[float, ...]:
    """The FEATURES of ``so``, in order, with ``lora_loads`` adapter loads and whether the step
    before ran a prefill (``after_prefill``); all zero for an empty step."""
    if not so.scheduled:
        return (0.0,) * len(FEATURES)
    prefill = chunks = decode = context = attention = spec = spec_seqs = lora_tokens = 0
    for s in so.scheduled:  # one pass (LoRA included: every chunk has num_new_tokens >= 1)
        if s.lora_name:
            lora_tokens += s.num_new_tokens
        if s.is_prefill:
            q = s.num_new_tokens
            prefill += q
            chunks += 1
            attention += q * (s.num_computed_tokens + (q + 1) / 2)
        else:
            decode += 1
            context += s.num_computed_tokens + s.num_new_tokens
            if s.spec_token_ids:
                spec += len(s.spec_token_ids)
                spec_seqs += 1
    num_loras = len(so.lora_names) if lora_tokens else 0  # no second pass without adapters
    return (1.0, 1.0 if chunks else 0.0, float(prefill), float(chunks), float(decode), decode ** 0.5, float(context),
            float(attention), float(spec), float(spec_seqs),
            float(lora_tokens), float(num_loras), float(lora_loads), 1.0 if after_prefill else 0.0)
