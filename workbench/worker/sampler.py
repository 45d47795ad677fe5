"""Sampler: one next token per row of a logits batch, each row with its own request's parameters.

Order of operations per row (vLLM v1's order, its default ``logprobs_mode="raw_logprobs"``):

0. **Grammar bitmask** (structured outputs): a row with a mask keeps only the tokens its bits
   allow (bit ``t % 32`` of int32 word ``t // 32``); the others become -inf before anything
   below, logprobs included (vLLM applies it to the logits the sampler receives).
1. **Logprobs** come from the *raw* logits: ``log_softmax(logits)`` as the model produced them.
   They do not reflect penalties, min_tokens, temperature or top-k/top-p/min-p truncation.
2. **Per-request logits work**, row by row and isolated: the request's ``logits_processors``
   (called as vLLM calls them: ``fn(prompt_token_ids, output_token_ids, logits)`` when the
   callable takes three parameters, else ``fn(output_token_ids, logits)``; each returns the
   row), then ``allowed_token_ids`` (every other token
   -inf), ``bad_words`` and ``logit_bias``. An exception raised there (or by a seeded
   generator, step 7) fails only that row: it samples no token (``token_ids[i] == -1``) and
   ``SamplerOutput.failed`` maps its request id to ``"ExcType: message"``. So does a row these
   steps leave with no finite logit. The other rows are sampled as if it were absent.
   Then the engine's **custom logits processors** (``--logits-processors``, vLLM v1's
   batch-level interface, :mod:`workbench.worker.logits_processor`) on the whole batch, in
   order (vLLM applies its argmax-invariant ones after the temperature; here all come here,
   which changes no greedy row); one that raises fails the step, as in vLLM.
3. **Penalties**: ``repetition_penalty`` over the prompt + output tokens (a seen token's positive
   logit is divided by it, a negative one multiplied), then ``frequency_penalty * count`` and
   ``presence_penalty * [count > 0]`` subtracted, with counts over the *output* tokens only
   (as vLLM and OpenAI).
4. **min_tokens**: while ``num_output_tokens < min_tokens`` the stop tokens (``stop_token_ids``
   and ``eos_token_id`` unless ``ignore_eos``, vLLM's ``all_stop_token_ids``) are set to ``-inf``.
5. **Greedy** rows (``SamplingParams.greedy``) take the argmax here; the others are divided
   by their temperature.
6. **min-p** (drop tokens whose probability, after the temperature, is below ``min_p`` times
   the largest), then **top-k** (keep the k largest of those left) and **top-p** (keep the
   smallest most-likely set whose probability is ``>= top_p``, at least one token), each on
   the distribution the previous one left. vLLM's order: min-p is its argmax-invariant
   built-in logits processor, applied after the temperature and before its top-k/top-p
   sampler. With probabilities (.4, .3, .15, .1, .05), ``min_p=0.3`` leaves (.4, .3, .15),
   which ``top_p=0.8`` cuts to the first two (.4/.85 + .3/.85 = .82).
7. **Sample** by the exponential race: ``argmax(probs / q)`` with ``q ~ Exp(1)`` i.i.d. per
   token, which picks token ``i`` with probability ``probs[i]``. A request with
   ``sampling_params.seed`` draws its ``q`` from its own ``torch.Generator`` (seeded once, kept
   across steps until :meth:`Sampler.remove`), so the same seed gives the same tokens whatever
   else is in the batch and whichever row it sits in. Unseeded rows draw from the sampler's own
   generator, seeded from ``Sampler(seed=...)``, so a whole run with the same schedule repeats.

Everything is vectorised over rows and vocabulary with torch; the only Python loops are over
requests (to gather their parameters and token ids). The model runner hands the rows'
parameters over as tensors (:class:`SamplingMetadata`, kept by its persistent batch), so that
a batch of plain greedy rows needs no pass over its requests. A batch whose every row is plain greedy
(no logits work, neutral penalties, min_tokens reached, no logprobs) is one ``argmax``: the
same tokens as the steps above, without their copies.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from workbench.request import Request
from workbench.utils.errors import describe
from workbench.worker.logits_processor import LogitsProcessor, LogitsProcessors

_NEG_INF = float("-inf")
_TINY = torch.finfo(torch.float32).tiny


@dataclass(frozen=True)
class TokenLogprobs:
    """One position's logprobs, from the raw logits (built by :func:`gather_logprobs`).

    ``rank`` is 1 + the number of tokens strictly more likely than ``token_id`` (1 = most
    likely); ``top`` holds the ``k`` most likely ``(token_id, logprob)`` pairs, most likely
    first, so ``top[i]`` has rank ``i + 1``.
    """

    token_id: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...]

    def ranked(self) -> list[tuple[int, float, int]]:
        """``(token_id, logprob, rank)``: the chosen token first, then each top-k token not
        already listed (vLLM's order for a position's logprobs dict)."""
        out = [(self.token_id, self.logprob, self.rank)]
        out += [(t, v, i) for i, (t, v) in enumerate(self.top, start=1) if t != self.token_id]
        return out


def gather_logprobs(
    logits: Tensor, token_ids: Tensor, num_logprobs: Sequence[int]
) -> list[TokenLogprobs]:
    """Row ``i``'s raw logprobs (``log_softmax`` in fp32) of ``token_ids[i]``, its rank and
    the ``num_logprobs[i]`` most likely tokens: the one place ranks and top-k are computed, for
    sampled tokens (the sampler) and prompt tokens (the runner's prompt logprobs)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(1, token_ids.unsqueeze(1))
    ranks = ((logprobs > chosen).sum(dim=1) + 1).tolist()
    max_k = min(max(num_logprobs, default=0), logprobs.shape[1])
    top_lp, top_ids = logprobs.topk(max_k, dim=-1, sorted=True)
    rows = zip(token_ids.tolist(), chosen.squeeze(1).tolist(), ranks, num_logprobs,
               top_ids.tolist(), top_lp.tolist())
    return [TokenLogprobs(token_id=t, logprob=v, rank=r, top=tuple(zip(ids[:k], lps[:k])))
            for t, v, r, k, ids, lps in rows]


@dataclass
class SamplerOutput:
    """``token_ids[i]`` is row ``i``'s token; ``logprobs[i]`` is None unless its request asked.

    ``failed`` maps the request id of each row whose per-request work raised to
    ``"ExcType: message"``; such a row has ``token_ids[i] == -1`` and no logprobs.
    """

    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]
    failed: dict[str, str] = field(default_factory=dict)

    def _repr_html_(self) -> str:
        from workbench.utils.reprs import html_table

        return html_table("SamplerOutput", {"token_ids": self.token_ids,
                                            "rows with logprobs": sum(
                                                lp is not None for lp in self.logprobs),
                                            "failed": self.failed or "none"})


def _check_token_ids(tokens: list[int], vocab_size: int, request: Request, what: str) -> None:
    if tokens and max(tokens) >= vocab_size:
        raise ValueError(
            f"request {request.request_id!r}: {what} contains token id {max(tokens)}, "
            f"which must be < the logits' vocab size {vocab_size}."
        )


def unpack_bitmask(bitmask: Tensor, vocab_size: int) -> Tensor:
    """[rows, words] packed int32 -> [rows, vocab_size] bool: token ``t`` is allowed iff bit
    ``t % 32`` of word ``t // 32`` is set (xgrammar's layout)."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.to(torch.int32).unsqueeze(-1) >> shifts) & 1
    return bits.flatten(1)[:, :vocab_size].bool()


def apply_token_bitmask(logits: Tensor, bitmask: Tensor) -> Tensor:
    """``logits`` with every token a row's mask forbids set to -inf (a new tensor)."""
    allowed = unpack_bitmask(bitmask.to(logits.device), logits.shape[1])
    return logits.masked_fill(~allowed, _NEG_INF)


def argmax_rows(x: Tensor) -> Tensor:
    """``x.argmax(dim=-1)`` of a 2-D tensor, exactly (the first maximum of a row; a NaN counts
    as the maximum, as in ``argmax``). fp32/fp64 CPU rows go through numpy's vectorised
    ``argmax``: ATen's CPU ``argmax`` walks a row element by element (0.36 ms for 96 x 4096
    fp32 logits against numpy's 0.04 ms here). Other dtypes and devices take ``argmax``."""
    if x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64):
        return torch.from_numpy(x.detach().numpy().argmax(axis=-1))
    return x.argmax(dim=-1)


def _takes_prompt_ids(fn) -> bool:
    """vLLM's rule for a per-request logits processor: one whose signature has exactly three
    parameters is called ``fn(prompt_token_ids, output_token_ids, logits)``, any other
    ``fn(output_token_ids, logits)`` (a callable without a readable signature: the latter)."""
    try:
        return len(inspect.signature(fn).parameters) == 3
    except (TypeError, ValueError):
        return False


def _request_logits(row: Tensor, request: Request) -> Tensor:
    """One row after its request's logits processors, allowed_token_ids, bad_words and
    logit_bias (steps in that order); raises if a processor misbehaves."""
    sp = request.sampling_params
    vocab_size = row.shape[0]
    for fn in sp.logits_processors or ():
        if _takes_prompt_ids(fn):
            out = fn(list(request.prompt_token_ids), list(request.output_token_ids), row)
        else:
            out = fn(list(request.output_token_ids), row)
        if not isinstance(out, Tensor) or out.shape != row.shape:
            raise TypeError(
                f"logits processor {getattr(fn, '__qualname__', fn)!s} must return a tensor "
                f"of shape {tuple(row.shape)}, got {type(out).__name__}"
                f"{tuple(out.shape) if isinstance(out, Tensor) else ''}."
            )
        row = out.to(torch.float32)
    if sp.allowed_token_ids is not None:
        _check_token_ids(sp.allowed_token_ids, vocab_size, request, "allowed_token_ids")
        keep = torch.zeros(vocab_size, dtype=torch.bool, device=row.device)
        keep[torch.tensor(sp.allowed_token_ids, device=row.device)] = True
        row = row.masked_fill(~keep, _NEG_INF)
    banned = _banned_bad_word_tokens(sp.bad_words_token_ids or (), request.output_token_ids)
    if banned:
        _check_token_ids(banned, vocab_size, request, "bad_words_token_ids")
        row = row.index_fill(0, torch.tensor(banned, device=row.device), _NEG_INF)
    if sp.logit_bias:
        tokens = list(sp.logit_bias)
        _check_token_ids(tokens, vocab_size, request, "logit_bias")
        bias = torch.tensor([sp.logit_bias[t] for t in tokens], dtype=row.dtype, device=row.device)
        row = row.index_add(0, torch.tensor(tokens, device=row.device), bias)
    if torch.isnan(row).any() or not torch.isfinite(row).any():
        raise ValueError("no token is left with a finite logit (NaN, or every token masked).")
    return row


def _banned_bad_word_tokens(words: Sequence[Sequence[int]], output: Sequence[int]) -> list[int]:
    """The last token of each bad word whose other tokens are the latest output tokens."""
    banned = []
    for word in words:
        prefix = list(word[:-1])
        if not prefix or list(output[len(output) - len(prefix):]) == prefix:
            banned.append(word[-1])
    return banned


def apply_penalties(logits: Tensor, requests: Sequence[Request]) -> None:
    """Apply repetition (prompt + output), frequency and presence (output only) penalties in place.

    Rows whose request leaves all three at their neutral values are untouched.
    """
    rows = [
        i
        for i, r in enumerate(requests)
        if r.sampling_params.repetition_penalty != 1.0
        or r.sampling_params.frequency_penalty != 0.0
        or r.sampling_params.presence_penalty != 0.0
    ]
    if not rows:
        return
    vocab_size, device = logits.shape[1], logits.device
    out_row: list[int] = []
    out_tok: list[int] = []
    seen_row: list[int] = []
    seen_tok: list[int] = []
    for j, i in enumerate(rows):
        r = requests[i]
        _check_token_ids(r.output_token_ids, vocab_size, r, "output_token_ids")
        out_row.extend([j] * r.num_output_tokens)
        out_tok.extend(r.output_token_ids)
        if r.sampling_params.repetition_penalty != 1.0:
            _check_token_ids(r.prompt_token_ids, vocab_size, r, "prompt_token_ids")
            seen_row.extend([j] * r.num_prompt_tokens)
            seen_tok.extend(r.prompt_token_ids)

    def idx(values: list[int]) -> Tensor:
        return torch.tensor(values, dtype=torch.long, device=device)

    counts = torch.zeros(len(rows), vocab_size, dtype=logits.dtype, device=device)
    ones = torch.ones(len(out_tok), dtype=logits.dtype, device=device)
    counts.index_put_((idx(out_row), idx(out_tok)), ones, accumulate=True)
    in_output = counts > 0

    def column(name: str) -> Tensor:
        values = [getattr(requests[i].sampling_params, name) for i in rows]
        return torch.tensor(values, dtype=logits.dtype, device=device).unsqueeze(1)

    row_idx = idx(rows)
    sub = logits[row_idx]
    rep = column("repetition_penalty")
    seen = in_output.clone()
    seen[idx(seen_row), idx(seen_tok)] = True
    penalised = torch.where(sub > 0, sub / rep, sub * rep)
    sub = torch.where(seen, penalised, sub)
    sub = sub - column("frequency_penalty") * counts - column("presence_penalty") * in_output
    logits[row_idx] = sub


def apply_min_tokens(logits: Tensor, requests: Sequence[Request]) -> None:
    """Set the stop tokens to -inf, in place, for rows that have not yet produced ``min_tokens``.

    The stop tokens are ``stop_token_ids`` plus ``eos_token_id`` unless ``ignore_eos`` (with
    ``ignore_eos`` EOS does not end the request, so there is nothing to hold back).
    """
    rows: list[int] = []
    cols: list[int] = []
    vocab_size = logits.shape[1]
    for i, r in enumerate(requests):
        sp = r.sampling_params
        if r.num_output_tokens >= sp.min_tokens:
            continue
        stops = list(sp.stop_token_ids or [])
        if r.eos_token_id is not None and not sp.ignore_eos:
            stops.append(r.eos_token_id)
        stops = [t for t in stops if t < vocab_size]  # ids outside the vocabulary cannot be sampled
        rows.extend([i] * len(stops))
        cols.extend(stops)
    if rows:
        device = logits.device
        logits[torch.tensor(rows, device=device), torch.tensor(cols, device=device)] = _NEG_INF


def apply_top_k_top_p(logits: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    """Keep, per row, the ``top_k[i]`` largest logits, then the smallest most-likely set of those
    whose probability reaches ``top_p[i]``; the rest become -inf. Returns a new tensor.

    ``top_k[i] >= vocab`` and ``top_p[i] == 1`` disable the filter for that row. The most likely
    token is always kept. Ties at the boundary are broken by the sort (so exactly k survive top-k).
    """
    vocab_size = logits.shape[1]
    values, order = logits.sort(dim=-1, descending=True)
    position = torch.arange(vocab_size, device=logits.device)
    values = values.masked_fill(position >= top_k.unsqueeze(1), _NEG_INF)
    top_p = top_p.unsqueeze(1)
    if bool((top_p < 1.0).any()):
        probs = values.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # probability of the strictly more likely tokens
        values = values.masked_fill((mass_before >= top_p) & (top_p < 1.0), _NEG_INF)
    return torch.full_like(logits, _NEG_INF).scatter(-1, order, values)


def apply_min_p(logits: Tensor, min_p: Tensor) -> Tensor:
    """Drop (set to -inf) tokens whose probability is below ``min_p[i]`` times the row's largest.

    Returns a new tensor; ``min_p[i] == 0`` keeps the row as is.
    """
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return logits.masked_fill(probs < threshold, _NEG_INF)


def _has_request_logits_work(sp) -> bool:
    return bool(sp.logits_processors or sp.allowed_token_ids is not None
                or sp.bad_words_token_ids or sp.logit_bias)


def is_plain_greedy_params(sp) -> bool:
    """True when these parameters make a row's token the argmax of its raw logits once
    ``min_tokens`` are out: greedy, no per-request logits work, neutral penalties, no logprobs."""
    return (sp.greedy and sp.logprobs is None and not _has_request_logits_work(sp)
            and sp.repetition_penalty == 1.0 and sp.frequency_penalty == 0.0
            and sp.presence_penalty == 0.0)


def _is_plain_greedy(request: Request) -> bool:
    """True when this row's token is the argmax of its raw logits and nothing else is asked:
    greedy, no per-request logits work, neutral penalties, min_tokens reached, no logprobs."""
    sp = request.sampling_params
    return is_plain_greedy_params(sp) and request.num_output_tokens >= sp.min_tokens


@dataclass(frozen=True)
class SamplingMetadata:
    """The rows' sampling parameters as tensors (vLLM's ``SamplingMetadata``), one entry per
    row of the logits, kept by the runner's persistent batch so that no step gathers them
    from the requests. ``all_plain_greedy`` True promises every row is plain greedy (one
    argmax); False promises nothing (the sampler then looks at the requests)."""

    all_plain_greedy: bool
    temperature: Tensor
    top_k: Tensor
    top_p: Tensor
    min_p: Tensor

    def select(self, rows: Sequence[int]) -> SamplingMetadata:
        """The same for ``rows`` only (their order)."""
        idx = torch.tensor(rows, dtype=torch.long)
        return SamplingMetadata(False, self.temperature[idx], self.top_k[idx], self.top_p[idx],
                                self.min_p[idx])


class Sampler:
    """Samples one token per row; holds the per-request generators of seeded requests.

    Invariant: a request with ``sampling_params.seed = s`` draws ``vocab`` exponentials per
    sampled step from its own generator seeded with ``s``, so its tokens depend only on its own
    logits and seed. :meth:`remove` forgets the generator (call it when the request finishes).
    """

    def __init__(self, seed: int = 0,
                 logits_processors: Sequence[LogitsProcessor] = ()) -> None:
        self.seed = seed
        self.logits_processors = LogitsProcessors(logits_processors)
        self._request_generators: dict[str, torch.Generator] = {}
        self._generators: dict[torch.device, torch.Generator] = {}

    def __repr__(self) -> str:
        return f"Sampler(seed={self.seed}, seeded_requests={len(self._request_generators)})"

    def _repr_html_(self) -> str:
        from workbench.utils.reprs import html_table

        return html_table("Sampler", {"seed": self.seed,
                                      "seeded requests": len(self._request_generators)})

    def remove(self, request_id: str) -> None:
        """Forget the per-request state (its seeded generator); unknown ids are ignored."""
        self._request_generators.pop(request_id, None)

    def _shared_generator(self, device: torch.device) -> torch.Generator:
        gen = self._generators.get(device)
        if gen is None:
            gen = torch.Generator(device=device)
            gen.manual_seed(self.seed)
            self._generators[device] = gen
        return gen

    def _request_generator(self, request: Request, device: torch.device) -> torch.Generator:
        gen = self._request_generators.get(request.request_id)
        if gen is None:
            gen = torch.Generator(device=device)
            gen.manual_seed(request.sampling_params.seed)
            self._request_generators[request.request_id] = gen
        return gen

    def _exponentials(
        self, requests: list[Request], vocab_size: int, device: torch.device,
        failed: dict[str, str],
    ) -> Tensor:
        """Exp(1) draws [len(requests), vocab]: seeded rows use their own generator (a row
        whose generator raises is recorded in ``failed`` and drawn from the shared one)."""
        q = torch.ones(len(requests), vocab_size, device=device)
        unseeded = [j for j, r in enumerate(requests) if r.sampling_params.seed is None]
        if unseeded:
            draws = torch.empty(len(unseeded), vocab_size, device=device)
            draws.exponential_(generator=self._shared_generator(device))
            q[torch.tensor(unseeded, device=device)] = draws
        for j, r in enumerate(requests):
            if r.sampling_params.seed is not None and r.request_id not in failed:
                try:
                    generator = self._request_generator(r, device)
                except Exception as exc:  # one request's fault: that row only
                    failed[r.request_id] = describe(exc)
                    continue
                q[j] = torch.empty(vocab_size, device=device).exponential_(generator=generator)
        return q.clamp_min_(_TINY)  # an Exp draw of exactly 0 would divide by zero

    def __call__(self, logits: Tensor, requests: Sequence[Request],
                 grammar_bitmask: Tensor | None = None,
                 metadata: SamplingMetadata | None = None) -> SamplerOutput:
        """Sample row ``i`` of ``logits`` [num_rows, vocab] for ``requests[i]`` (see module doc);
        ``grammar_bitmask`` [num_rows, ceil(vocab / 32)] int32 (-1: a free row) masks first;
        ``metadata``: the rows' parameters as tensors (else read from ``requests``)."""
        if logits.dim() != 2:
            raise ValueError(
                f"logits must be 2-D [num_rows, vocab], got shape {tuple(logits.shape)}."
            )
        if logits.shape[0] != len(requests):
            raise ValueError(
                f"logits has {logits.shape[0]} rows but {len(requests)} requests were given; "
                "row i must be the distribution for requests[i]."
            )
        num_rows, vocab_size = logits.shape
        if num_rows == 0:
            return SamplerOutput(token_ids=[], logprobs=[])
        if grammar_bitmask is not None:
            logits = apply_token_bitmask(logits, grammar_bitmask)
        custom = self.logits_processors
        if custom:
            custom.update_state(requests)
        if (not custom or custom.argmax_invariant) and (
                (metadata is not None and metadata.all_plain_greedy)
                or all(_is_plain_greedy(r) for r in requests)):  # the common batch: one argmax
            return SamplerOutput(token_ids=argmax_rows(logits).tolist(), logprobs=[None] * num_rows)
        device = logits.device
        x, failed = self.process_logits(logits, requests, custom)

        tokens = torch.empty(num_rows, dtype=torch.long, device=device)
        greedy_rows = [i for i, r in enumerate(requests) if r.sampling_params.greedy]
        if greedy_rows:
            rows = torch.tensor(greedy_rows, device=device)
            tokens[rows] = argmax_rows(x[rows])
        sampled_rows = [i for i, r in enumerate(requests) if not r.sampling_params.greedy]
        if sampled_rows:
            sampled = self._sample(x, [requests[i] for i in sampled_rows], sampled_rows, failed,
                                   metadata.select(sampled_rows) if metadata is not None else None)
            tokens[torch.tensor(sampled_rows, device=device)] = sampled
        if failed:
            bad_rows = [i for i, r in enumerate(requests) if r.request_id in failed]
            tokens[torch.tensor(bad_rows, device=device)] = -1

        logprobs: list[TokenLogprobs | None] = [None] * num_rows
        want_logprobs = [
            i for i, r in enumerate(requests)
            if r.sampling_params.logprobs is not None and r.request_id not in failed
        ]
        if want_logprobs:  # from the raw logits (``x`` holds the processed ones)
            entries = gather_logprobs(logits[want_logprobs], tokens[want_logprobs],
                                      [requests[i].sampling_params.logprobs for i in want_logprobs])
            for i, entry in zip(want_logprobs, entries):
                logprobs[i] = entry
        return SamplerOutput(token_ids=tokens.tolist(), logprobs=logprobs, failed=failed)

    def process_logits(self, logits: Tensor, requests: Sequence[Request],
                       custom: LogitsProcessors | None = None) -> tuple[Tensor, dict[str, str]]:
        """Steps 2-4 of the module docstring on an fp32 copy of ``logits`` (per-request logits
        work, the engine's ``custom`` processors when given, penalties, min_tokens): the logits
        greedy rows take the argmax of. Returns them and the rows that failed (request id ->
        message; such a row is left all zeros)."""
        x = logits.to(torch.float32, copy=True)
        failed: dict[str, str] = {}
        for i, r in enumerate(requests):
            if _has_request_logits_work(r.sampling_params):
                try:
                    x[i] = _request_logits(x[i], r)
                except Exception as exc:  # one request's fault: that row only
                    failed[r.request_id] = describe(exc)
                    x[i] = 0.0  # keep the batch finite; the row's token is dropped
        if custom:
            x = custom.apply(x)
        apply_penalties(x, requests)
        apply_min_tokens(x, requests)
        return x, failed

    def target_probs(self, x: Tensor, requests: Sequence[Request],
                     metadata: SamplingMetadata | None = None) -> Tensor:
        """Step 6 on processed logits ``x`` of non-greedy rows: the distribution each row
        samples from (temperature, min-p, top-k, top-p, softmax); the parameters from
        ``metadata`` when given (one entry per row of ``x``), else from ``requests``."""
        device = x.device
        vocab_size = x.shape[1]
        if metadata is None:
            params = [r.sampling_params for r in requests]
            metadata = SamplingMetadata(
                False, *(torch.tensor([getattr(p, name) for p in params], dtype=dtype)
                         for name, dtype in (("temperature", torch.float32), ("top_k", torch.long),
                                             ("top_p", torch.float32), ("min_p", torch.float32))))
        y = x / metadata.temperature.to(device).unsqueeze(1)
        if bool((metadata.min_p > 0.0).any()):  # vLLM: before top-k/top-p
            y = apply_min_p(y, metadata.min_p.to(device))
        top_k = metadata.top_k
        filters_k = (top_k > 0) & (top_k < vocab_size)
        if bool(filters_k.any() or (metadata.top_p < 1.0).any()):
            top_k = torch.where(filters_k, top_k, vocab_size).to(device)
            y = apply_top_k_top_p(y, top_k, metadata.top_p.to(device))
        return y.softmax(dim=-1)

    def generator(self, request: Request, device: torch.device) -> torch.Generator:
        """The generator ``request``'s random draws come from: its own when seeded, else
        the sampler's shared one (may raise for a bad seed)."""
        if request.sampling_params.seed is not None:
            return self._request_generator(request, device)
        return self._shared_generator(device)

    def _sample(
        self, x: Tensor, requests: list[Request], rows: list[int], failed: dict[str, str],
        metadata: SamplingMetadata | None = None,
    ) -> Tensor:
        """Temperature, min-p, top-k, top-p and the exponential race for the ``rows`` of x."""
        probs = self.target_probs(x[torch.tensor(rows, device=x.device)], requests, metadata)
        return (probs / self._exponentials(requests, x.shape[1], x.device, failed)).argmax(dim=-1)
