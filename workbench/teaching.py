"""teaching_config: a deliberately small engine on which serving effects show within seconds."""

from __future__ import annotations

from workbench.config import EngineConfig

#: A pool of 24 blocks of 4 tokens (96 token slots), 32 tokens per step, at most 4
#: sequences: on a default ``Workload.poisson()`` (12 prompts of 8-40 tokens, 4-16 outputs)
#: it fills the pool, chunks prefills, preempts and resumes from the prefix cache, within
#: about 50 steps (a few seconds) of the embedded model.
TEACHING_DEFAULTS = dict(
    block_size=4,
    num_kv_blocks=24,
    max_num_batched_tokens=32,
    max_num_seqs=4,
    device="cpu",
    dtype="float32",
)


def teaching_config(**overrides) -> EngineConfig:
    """EngineConfig of the teaching engine (:data:`TEACHING_DEFAULTS`), with ``overrides``
    (any EngineConfig field) applied."""
    return EngineConfig(**{**TEACHING_DEFAULTS, **overrides})
