"""RejectionSampler: verifies a request's draft tokens against the target model (vLLM's rule).

A speculating request brings ``k`` drafts ``d_1..d_k`` and ``k + 1`` rows of target logits:
row ``j`` is the target's distribution for the token after the known tokens and ``d_1..d_j``.
Every sampling parameter applies to each row as it would in plain decoding: row ``j`` sees the
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
from workbench.worker.sampler import Sampler, TokenLogprobs, _is_plain_greedy, gather_logprobs

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


def _race(probs: Tensor, generator: torch.Generator) -> int:
    """One token drawn from ``probs`` [vocab] by the exponential race."""
    q = torch.empty_like(probs).exponential_(generator=generator).clamp_min_(_TINY)
    return int((probs / q).argmax())


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
    ) -> RejectionOutput:
        """``logits`` [sum(k_i + 1), vocab]: request ``i``'s ``k_i + 1`` rows in a run, in
        input order; ``draft_probs[i]`` [k_i, vocab] is the ``q`` its drafts were drawn from
        (None: deterministic drafts)."""
        counts = [len(d) + 1 for d in draft_token_ids]
        if logits.dim() != 2 or logits.shape[0] != sum(counts):
            raise ValueError(f"logits must have {sum(counts)} rows (k + 1 per request), got "
                             f"shape {tuple(logits.shape)}.")
        draft_probs = list(draft_probs) if draft_probs is not None else [None] * len(requests)
        views = [with_drafts(r, d[:j]) for r, d in zip(requests, draft_token_ids)
                 for j in range(len(d) + 1)]
        starts = [0]
        for c in counts:
            starts.append(starts[-1] + c)
        device = logits.device
        if all(_is_plain_greedy(v) for v in views):  # the common case: one argmax
            x, failed, probs = logits, {}, None
        else:
            x, failed = self.sampler.process_logits(logits, views)
            sampled_rows = [i for i, v in enumerate(views) if not v.sampling_params.greedy]
            probs = None
            if sampled_rows:
                probs = torch.zeros_like(x)
                rows = torch.tensor(sampled_rows, device=device)
                probs[rows] = self.sampler.target_probs(x[rows], [views[i] for i in sampled_rows])
        argmax = x.argmax(dim=-1).tolist()
        out = RejectionOutput([], [], [], failed)
        for i, (r, drafts) in enumerate(zip(requests, draft_token_ids)):
            lo, k = starts[i], len(drafts)
            tokens: list[int] = []
            if r.request_id not in failed:
                try:
                    if r.sampling_params.greedy:
                        tokens = self._verify_greedy(drafts, argmax[lo : lo + k + 1])
                    else:
                        tokens = self._verify_sampled(drafts, probs[lo : lo + k + 1], draft_probs[i],
                                                      self.sampler.generator(r, device))
                except Exception as exc:  # one request's fault (its generator): that request only
                    failed[r.request_id] = describe(exc)
                    tokens = []
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

    @staticmethod
    def _verify_greedy(drafts: Sequence[int], argmax: list[int]) -> list[int]:
        tokens = []
        for j, d in enumerate(drafts):
            if d != argmax[j]:
                break
            tokens.append(d)
        tokens.append(argmax[len(tokens)])
        return tokens

    @staticmethod
    def _verify_sampled(drafts: Sequence[int], p: Tensor, q: Tensor | None,
                        generator: torch.Generator) -> list[int]:
        """``p`` [k + 1, vocab] target distributions, ``q`` [k, vocab] or None (one-hot)."""
        k = len(drafts)
        if k:
            idx = torch.tensor(list(drafts), device=p.device)
            pos = torch.arange(k, device=p.device)
            p_d = p[pos, idx]
            q_d = q[pos, idx].clamp_min(_TINY) if q is not None else torch.ones_like(p_d)
            u = torch.rand(k, generator=generator, device=p.device)
            accepted = (u < p_d / q_d).tolist()
            a = accepted.index(False) if False in accepted else k
        else:
            a = 0
        tokens = list(drafts[:a])
        if a == k:  # every draft accepted: the bonus token, from the last row
            tokens.append(_race(p[k], generator))
            return tokens
        if q is not None:
            residual = (p[a] - q[a]).clamp_min(0.0)
        else:
            residual = p[a].clone()
            residual[drafts[a]] = 0.0
        total = residual.sum()
        tokens.append(_race(residual / total if total > 0 else p[a], generator))
        return tokens
