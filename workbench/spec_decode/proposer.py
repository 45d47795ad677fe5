"""make_proposer: the proposer ``speculative_config`` names, built (and checked) at start-up."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from workbench.config import SpeculativeConfig
from workbench.spec_decode.ngram_proposer import NgramProposer

if TYPE_CHECKING:
    import torch

    from workbench.model.model_config import ModelConfig
    from workbench.spec_decode.draft_model_proposer import DraftModelProposer


def make_proposer(config: SpeculativeConfig | None, target: ModelConfig, tokenizer: Any, *,
                  device: torch.device, block_size: int, attention_backend: str, num_blocks: int,
                  load_format: str = "auto", seed: int = 0) -> NgramProposer | DraftModelProposer | None:
    """None without speculation; an :class:`NgramProposer`; or a :class:`DraftModelProposer`
    (its own weights and a paged KV cache of ``num_blocks`` blocks). Both have
    ``propose(requests) -> {id: drafts}`` and ``remove(finished ids)``. A draft model that is
    missing or whose vocabulary or tokenizer differs from the target's raises ValueError here."""
    if config is None:
        return None
    if config.method == "ngram":
        return NgramProposer(config)
    from workbench.spec_decode.draft_model_proposer import DraftModelProposer  # torch: only for a draft model

    return DraftModelProposer(config, target, tokenizer, device=device, block_size=block_size,
                              attention_backend=attention_backend, num_blocks=num_blocks,
                              load_format=load_format, seed=seed)
