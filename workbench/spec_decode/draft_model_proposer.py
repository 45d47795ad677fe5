"""DraftModelProposer: a smaller model with the target's tokenizer drafts ``k`` tokens greedily.

The draft runs through the same :class:`~workbench.worker.model_runner.ModelRunner` code as the
target, with its own weights and its own paged KV cache, bookkept by its own
:class:`~workbench.core.kv_cache_manager.KVCacheManager` (no prefix caching): per request, a
shadow request whose ``num_computed_tokens`` counts the positions whose draft K/V hold the
request's real tokens. Each ``propose`` feeds the tokens the draft has not seen (the
common prefix of what it was fed and the real tokens is kept, so accepted drafts are not
recomputed), takes the argmax, then feeds each draft back for the next, ``k`` forward passes
in all, batched over the requests. Drafts are argmax proposals (as vLLM's draft proposers):
deterministic, so the rejection sampler needs no ``q``. A request the draft cache cannot hold
this step gets no drafts (nothing else changes).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

from workbench.config import SpeculativeConfig
from workbench.core.kv_cache_manager import KVCacheManager
from workbench.core.sched.output import ScheduledRequest, SchedulerOutput
from workbench.model.loader import ModelLoadError, resolve_model_path
from workbench.model.model_config import ModelConfig
from workbench.model.tokenizer import load_tokenizer
from workbench.request import Request
from workbench.sampling_params import SamplingParams
from workbench.worker.model_runner import ModelRunner

_GREEDY = SamplingParams(temperature=0.0, max_tokens=None)


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def check_draft(draft: ModelConfig, draft_tokenizer: Any, target: ModelConfig, tokenizer: Any) -> None:
    """Raise ValueError naming ``speculative_config.model`` when the draft cannot draft for the
    target: another vocabulary size, another tokenizer (token -> id map or eos), or a shorter
    context than the target's ``max_model_len``."""
    where = f"speculative_config.model ({draft.path})"
    if draft.vocab_size != target.vocab_size:
        raise ValueError(f"{where}: the draft's vocabulary has {draft.vocab_size} tokens but the "
                         f"target's has {target.vocab_size}; a draft must share the target's tokenizer.")
    if draft_tokenizer.get_vocab() != tokenizer.get_vocab() or (
            draft_tokenizer.eos_token_id != tokenizer.eos_token_id):
        raise ValueError(f"{where}: the draft's tokenizer differs from the target's (token ids or "
                         "eos); a draft must share the target's tokenizer.")
    if draft.max_model_len < target.max_model_len:
        raise ValueError(f"{where}: the draft's context ({draft.max_model_len} positions) is shorter "
                         f"than the target's max_model_len ({target.max_model_len}).")


class DraftModelProposer:
    """Drafts with a second model (see module docstring)."""

    def __init__(self, config: SpeculativeConfig, target: ModelConfig, tokenizer: Any, *,
                 device: torch.device, block_size: int, attention_backend: str, num_blocks: int,
                 load_format: str = "auto", seed: int = 0) -> None:
        try:
            path = resolve_model_path(config.model)
            draft = ModelConfig.from_pretrained(path, dtype=target.dtype, device=device)
        except (ModelLoadError, FileNotFoundError) as exc:
            raise ValueError(f"speculative_config.model: the draft model {config.model!r} cannot be "
                             f"loaded: {exc}") from None
        check_draft(draft, load_tokenizer(path), target, tokenizer)
        draft = ModelConfig.from_pretrained(path, dtype=target.dtype, device=device,
                                            max_model_len=target.max_model_len)
        self.k = config.num_speculative_tokens
        self.model_config = draft
        self.runner = ModelRunner(draft, device=device, block_size=block_size,
                                  attention_backend=attention_backend, load_format=load_format,
                                  seed=seed)
        self.runner.allocate_kv_cache(num_blocks)
        self.kv_cache = KVCacheManager(num_blocks, block_size, enable_prefix_caching=False)
        self._shadows: dict[str, Request] = {}  # request id -> the draft cache's view of it
        self._num_steps = 0

    def propose(self, requests: Iterable[Request]) -> dict[str, list[int]]:
        """Request id -> its ``k`` drafts (fewer near ``max_model_len``; none when the draft
        cache is full)."""
        max_len = self.model_config.max_model_len
        first: list[ScheduledRequest] = []
        ks: dict[str, int] = {}
        for r in requests:
            tokens = r.all_token_ids
            k = min(self.k, max_len - len(tokens) - 1)
            if k < 1:
                continue
            shadow = self._shadows.get(r.request_id)
            if shadow is None:
                shadow = self._shadows[r.request_id] = Request(r.request_id, [], _GREEDY)
            valid = min(_common_prefix(shadow.prompt_token_ids[: shadow.num_computed_tokens], tokens),
                        len(tokens) - 1)
            shadow.num_computed_tokens = valid
            shadow.prompt_token_ids = list(tokens)
            if self.kv_cache.block_ids(r.request_id):
                self.kv_cache.free_unneeded_blocks(shadow)
            if self.kv_cache.allocate_slots(shadow, len(tokens) - valid + k - 1) is None:
                continue
            ks[r.request_id] = k
            first.append(self._chunk(shadow, valid, tokens[valid:]))
        if not first:
            return {}
        drafts: dict[str, list[int]] = {rid: [] for rid in ks}
        chunks = first
        for _ in range(max(ks.values())):
            out = self.runner.execute(SchedulerOutput(step=self._num_steps, scheduled=tuple(chunks)),
                                      self._shadows)
            self._num_steps += 1
            following = []
            for c in chunks:
                token = out.sampled_token_ids[c.request_id]
                d = drafts[c.request_id]
                d.append(token)
                shadow = self._shadows[c.request_id]
                shadow.num_computed_tokens = c.seq_len
                if len(d) < ks[c.request_id]:
                    shadow.prompt_token_ids.append(token)
                    following.append(self._chunk(shadow, c.seq_len, [token]))
            chunks = following
            if not chunks:
                break
        return drafts

    def _chunk(self, shadow: Request, start: int, token_ids: Sequence[int]) -> ScheduledRequest:
        return ScheduledRequest(
            request_id=shadow.request_id, num_computed_tokens=start, num_new_tokens=len(token_ids),
            token_ids=tuple(token_ids), block_ids=self.kv_cache.block_ids(shadow.request_id),
            is_prefill=len(token_ids) > 1, samples=True)

    def fork_shared(self) -> list:
        """What an engine's fork shares with this proposer: the draft model's config and weights."""
        return self.runner.fork_shared()

    def remove(self, request_ids: Iterable[str]) -> None:
        """Free the draft cache of finished requests."""
        for rid in request_ids:
            shadow = self._shadows.pop(rid, None)
            if shadow is not None:
                self.kv_cache.free(shadow)

    def __repr__(self) -> str:
        mc = self.model_config
        return (f"DraftModelProposer(model={mc.path.name}, layers={mc.num_layers}, k={self.k}, "
                f"blocks={self.kv_cache.num_blocks}, requests={len(self._shadows)})")
