"""AttentionMetadata: how the packed tokens of one forward map onto sequences and KV-cache slots."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class AttentionMetadata:
    """Per-forward batch layout, shared by every attention layer (built by the model runner).

    Sequence ``s`` owns tokens ``query_start_loc[s]:query_start_loc[s+1]`` of the packed batch;
    after this forward its cache holds ``seq_lens[s]`` tokens (the new ones last), in the blocks
    ``block_tables[s]``. Token ``t``'s K/V go to ``slot_mapping[t] = block * block_size + offset``
    (-1: not written). ``backend`` ("torch", "triton" or "cpu") selects every kernel of the
    forward; ``plan`` is the backend's per-forward layout (``kernels.plan_attention``), which
    the model fills in once and every layer reuses.
    """

    slot_mapping: torch.Tensor  # int64 [num_tokens]
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks_per_seq]
    query_start_loc: torch.Tensor  # int32 [num_seqs + 1]
    seq_lens: torch.Tensor  # int32 [num_seqs]
    backend: str = "torch"
    plan: Any = None

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.shape[0]
