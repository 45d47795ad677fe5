"""RejectionSampler: verifies a request's draft tokens against the target model (vLLM's rule).

A speculating request brings ``k`` drafts ``d_1..d_k`` and ``k + 1`` rows of target logits:
row ``j`` is the target's distribution for the token after the known tokens and ``d_1..d_j``.
A constrained request's grammar bitmask row ``j`` (its grammar after ``d_1..d_j``) masks row
``j`` first, before any other rule, as in plain decoding. Every sampling parameter applies to each row as it would in plain decoding: row ``j`` sees the
request's output tokens followed by ``d_1..d_j`` (penalties, bad words, min_tokens, logits
processors), then temperature, top-k, top-p and min-p give the target distribution ``p_j``
(:class:`~workbench.worker.sampler.Sampler`'s own steps, per row).

* **Greedy** requests accept ``d_j`` while it equals the argmax of row ``j - 1``; the first
  mismatch is replaced by that argmax. So the output is exactly plain greedy decoding's.
* **Sampled** requests accept ``d_j`` with probability ``min(1, p(d_j) / q(d_j))`` (one
  uniform draw per draft), ``q`` the distribution the draft was drawn from; at the first
  rejection the token is drawn from the residual ``max(0, p - q)`` normalised. Drafts with no
  ``q`` (n-gram proposals, greedy drafts) are deterministic: ``q`` is one-hot on the draft, so
  acceptance is ``p(d_j)`` and the residual is ``p`` without ``d_j``. Either way each emitted
  token is distributed exactly as ``p`` (Leviathan et al. 2023; Chen et al. 2023).
* When every draft is accepted, a **bonus** token is drawn from the last row (argmax for
  greedy), so a step emits between 1 and ``k + 1`` tokens.

Random draws (uniforms, the exponential race) come from the request's own generator when it
has a seed, else the sampler's shared one. Logprobs are those of the emitted tokens, from the
raw logits of their rows (as the plain sampler's). A row whose request's logits work raises
fails the request (``failed``), the others go on.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from workbench.request import Request
from workbench.utils.errors import describe
from workbench.worker.sampler import (Sampler, TokenLogprobs, _is_plain_greedy, apply_token_bitmask,
                                      argmax_rows, gather_logprobs)

_TINY = torch.finfo(torch.float32).tiny


@dataclass
class RejectionOutput:
    """Per request, in input order: how many drafts were accepted, the tokens emitted
    (accepted drafts, then the target's token) and their logprobs (None unless asked);
    ``failed``: request id -> message (such a request has ``num_accepted 0`` and no tokens)."""

    num_accepted: list[int]
    token_ids: list[list[int]]
    logprobs: list[list[TokenLogprobs] | None]
    failed: dict[str, str] = field(default_factory=dict)


def with_drafts(request: Request, drafts: Sequence[int]) -> Request:
    """A read-only view of ``request`` as if ``drafts`` had been generated (the state the
    target's row after those drafts is sampled in)."""
    if not drafts:
        return request
    return dataclasses.replace(request, output_token_ids=[*request.output_token_ids, *drafts])


def rejection_sample(
    target_probs: Tensor,
    draft_token_ids: Tensor,
    num_draft_tokens: Tensor,
    draft_probs: Tensor | None,
    generator: torch.Generator,
) -> tuple[Tensor, Tensor]:
    """The rule of the module docstring for a batch of sampled rows, vectorised.

    ``target_probs`` [B, K + 1, V]: row ``b``'s target distributions (positions past its
    ``num_draft_tokens[b]`` drafts + 1 are ignored); ``draft_token_ids`` [B, K] (padded);
    ``draft_probs`` [B, K, V] or None (one-hot drafts). Returns ``(num_accepted [B], token
    [B])``: the accepted prefix length and the token drawn after it (from the residual at the
    first rejection, else the bonus token from the last row). Draws: one uniform per draft
    position and one exponential race per row, from ``generator``.
    """
    batch, k_max = draft_token_ids.shape
    device = target_probs.device
    rows = torch.arange(batch, device=device)
    drafts = draft_token_ids.clamp_min(0)
    if k_max:
        p_d = target_probs[:, :k_max].gather(2, drafts.unsqueeze(2)).squeeze(2)
        q_d = (draft_probs.gather(2, drafts.unsqueeze(2)).squeeze(2).clamp_min(_TINY)
               if draft_probs is not None else torch.ones_like(p_d))
        u = torch.rand(batch, k_max, generator=generator, device=device)
        valid = torch.arange(k_max, device=device).unsqueeze(0) < num_draft_tokens.unsqueeze(1)
        accepted = (u < p_d / q_d) & valid
        num_accepted = accepted.long().cumprod(dim=1).sum(dim=1)
    else:
        num_accepted = torch.zeros(batch, dtype=torch.long, device=device)
    p = target_probs[rows, num_accepted]  # the target at the first rejected (or bonus) position
    rejected = num_accepted < num_draft_tokens
    if rejected.any():
        at = num_accepted.clamp_max(max(k_max - 1, 0))
        if draft_probs is not None:
            q = draft_probs[rows, at]
        else:
            q = torch.zeros_like(p).scatter_(1, drafts[rows, at].unsqueeze(1), 1.0)
        residual = torch.where(rejected.unsqueeze(1), (p - q).clamp_min(0.0), p)
        total = residual.sum(dim=1, keepdim=True)
        p = torch.where(total > 0, residual / total.clamp_min(_TINY), p)
    race = torch.empty_like(p).exponential_(generator=generator).clamp_min_(_TINY)
    return num_accepted, (p / race).argmax(dim=1)


class RejectionSampler:
    """Accepts or rejects each request's drafts (see module docstring) with ``sampler``'s
    logits processing and generators."""

    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler

    def __call__(
        self,
        logits: Tensor,
        requests: Sequence[Request],
        draft_token_ids: Sequence[Sequence[int]],
        draft_probs: Sequence[Tensor | None] | None = None,
        grammar_bitmask: Tensor | None = None,
    ) -> RejectionOutput:
        """``logits`` [sum(k_i + 1), vocab]: request ``i``'s ``k_i + 1`` rows in a run, in
        input order; ``draft_probs[i]`` [k_i, vocab] is the ``q`` its drafts were drawn from
        (None: deterministic drafts); ``grammar_bitmask`` [sum(k_i + 1), ceil(vocab / 32)]
        int32, one mask per row (-1: free), applied first."""
        counts = [len(d) + 1 for d in draft_token_ids]
        if logits.dim() != 2 or logits.shape[0] != sum(counts):
            raise ValueError(f"logits must have {sum(counts)} rows (k + 1 per request), got "
                             f"shape {tuple(logits.shape)}.")
        if grammar_bitmask is None and all(map(_is_plain_greedy, requests)):
            return self._plain_greedy(logits, draft_token_ids)
        draft_probs = list(draft_probs) if draft_probs is not None else [None] * len(requests)
        if grammar_bitmask is not None:
            logits = apply_token_bitmask(logits, grammar_bitmask)
        starts = [0]
        for c in counts:
            starts.append(starts[-1] + c)
        device = logits.device
        # The common case: one argmax. Drafts only add output tokens, so when a request is
        # plain greedy, so is each of its rows (its views with drafts).
        if all(_is_plain_greedy(r) for r in requests):
            x, failed, probs = logits, {}, None
        else:
            views = [with_drafts(r, d[:j]) for r, d in zip(requests, draft_token_ids)
                     for j in range(len(d) + 1)]
            x, failed = self.sampler.process_logits(logits, views)
            sampled_rows = [i for i, v in enumerate(views) if not v.sampling_params.greedy]
            probs = None
            if sampled_rows:
                probs = torch.zeros_like(x)
                rows = torch.tensor(sampled_rows, device=device)
                probs[rows] = self.sampler.target_probs(x[rows], [views[i] for i in sampled_rows])
        argmax = argmax_rows(x).tolist()
        tokens_of: dict[int, list[int]] = {}
        sampled = [i for i, r in enumerate(requests)
                   if not r.sampling_params.greedy and r.request_id not in failed]
        groups: dict[str | None, list[int]] = {}  # unseeded rows share one batch
        for i in sampled:
            groups.setdefault(requests[i].request_id if requests[i].sampling_params.seed is not None
                              else None, []).append(i)
        for members in groups.values():
            try:
                generator = self.sampler.generator(requests[members[0]], device)
            except Exception as exc:  # a bad seed: that request only
                failed[requests[members[0]].request_id] = describe(exc)
                continue
            k_max = max(len(draft_token_ids[i]) for i in members)
            p = torch.zeros(len(members), k_max + 1, logits.shape[1], device=device)
            q = None if all(draft_probs[i] is None for i in members) else torch.zeros(
                len(members), k_max, logits.shape[1], device=device)
            d = torch.zeros(len(members), k_max, dtype=torch.long, device=device)
            for row, i in enumerate(members):
                k = len(draft_token_ids[i])
                p[row, : k + 1] = probs[starts[i] : starts[i] + k + 1]
                d[row, :k] = torch.tensor(list(draft_token_ids[i]), dtype=torch.long)
                if q is not None:
                    q[row, :k] = (draft_probs[i] if draft_probs[i] is not None else
                                  torch.zeros(k, logits.shape[1], device=device).scatter_(
                                      1, d[row, :k].unsqueeze(1), 1.0))
            counts_t = torch.tensor([len(draft_token_ids[i]) for i in members], device=device)
            num_accepted, token = rejection_sample(p, d, counts_t, q, generator)
            for row, i in enumerate(members):
                a = int(num_accepted[row])
                tokens_of[i] = [*draft_token_ids[i][:a], int(token[row])]
        out = RejectionOutput([], [], [], failed)
        for i, (r, drafts) in enumerate(zip(requests, draft_token_ids)):
            lo, k = starts[i], len(drafts)
            tokens: list[int] = []
            if r.request_id not in failed:
                tokens = (self._verify_greedy(drafts, argmax[lo : lo + k + 1])
                          if r.sampling_params.greedy else tokens_of[i])
            out.token_ids.append(tokens)
            out.num_accepted.append(max(0, len(tokens) - 1))
            n_lp = r.sampling_params.logprobs
            if n_lp is not None and tokens:
                out.logprobs.append(gather_logprobs(logits[lo : lo + len(tokens)],
                                                    torch.tensor(tokens, device=device),
                                                    [n_lp] * len(tokens)))
            else:
                out.logprobs.append(None)
        return out

    def _plain_greedy(self, logits: Tensor, draft_token_ids: Sequence[Sequence[int]]) -> RejectionOutput:
        """Every request plain greedy, none constrained (a speculative step's common case):
        one argmax over all rows, then each request's drafts against its rows."""
        argmax = argmax_rows(logits).tolist()
        out = RejectionOutput([], [], [None] * len(draft_token_ids))
        lo = 0
        for drafts in draft_token_ids:
            tokens = self._verify_greedy(drafts, argmax[lo:lo + len(drafts) + 1])
            out.token_ids.append(tokens)
            out.num_accepted.append(len(tokens) - 1)
            lo += len(drafts) + 1
        return out

    @staticmethod
    def _verify_greedy(drafts: Sequence[int], argmax: list[int]) -> list[int]:
        tokens = []
        for j, d in enumerate(drafts):
            if d != argmax[j]:
                break
            tokens.append(d)
        tokens.append(argmax[len(tokens)])
        return tokens
