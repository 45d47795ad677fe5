"""Sampler tests: every expectation is worked out by hand or with plain math, never captured."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from workbench.request import Request
from workbench.worker.sampler import (Sampler, SamplerOutput, TokenLogprobs, apply_penalties,
                                      argmax_rows, gather_logprobs)
from workbench.sampling_params import SamplingParams

# A 5-token distribution with easy numbers: token 2 is the most likely, then 4, 0, 1, 3.
PROBS = {2: 0.40, 4: 0.30, 0: 0.15, 1: 0.10, 3: 0.05}
LOGITS = [math.log(PROBS[t]) for t in range(5)]


def req(rid: str = "r", prompt=(1,), output=(), eos: int | None = None, **params) -> Request:
    return Request(
        rid,
        list(prompt),
        SamplingParams(**params),
        eos_token_id=eos,
        output_token_ids=list(output),
    )


def draw(params: dict, n: int, logits=LOGITS, seed: int = 0) -> list[int]:
    """n samples of one distribution, as n identical unseeded rows of one batch."""
    rows = torch.tensor([logits] * n, dtype=torch.float32)
    return Sampler(seed=seed)(rows, [req(f"r{i}", **params) for i in range(n)]).token_ids


# --- truncation: top-k, top-p, min-p ----------------------------------------------------------

@pytest.mark.parametrize(
    "params, allowed",
    [
        ({"top_k": 1}, {2}),
        ({"top_k": 3}, {2, 4, 0}),
        ({"top_k": 50}, {0, 1, 2, 3, 4}),  # more than the vocabulary: no filter
        # top-p: cumulative mass before each token, most likely first: 0, .40, .70, .85, .95
        ({"top_p": 0.35}, {2}),
        ({"top_p": 0.65}, {2, 4}),
        ({"top_p": 0.80}, {2, 4, 0}),
        # min-p: threshold min_p * 0.40
        ({"min_p": 0.5}, {2, 4}),  # 0.20: drops .15, .10, .05
        ({"min_p": 0.3}, {2, 4, 0}),  # 0.12: keeps .40 .30 .15
        ({"min_p": 0.2}, {2, 4, 0, 1}),  # 0.08
        # vLLM's order: min-p first (threshold .3 * .40 = .12 keeps .40 .30 .15), then top-p on
        # what is left, renormalised by .85: .471 .353 .176, mass before 0 .471 .824 -> {2, 4}
        # (top-p first would keep {2, 4, 0}, which min-p .3 then leaves alone: .176 > .141)
        ({"min_p": 0.3, "top_p": 0.8}, {2, 4}),
        # min-p .4 (threshold .16) keeps .40 .30; top-k 4 and top-p .8 then keep both
        # (.571 .429: mass before 0 .571)
        ({"top_k": 4, "top_p": 0.8, "min_p": 0.4}, {2, 4}),
        # min-p .2 (threshold .08) keeps {2, 4, 0, 1}; top-k 2 then keeps {2, 4}
        ({"min_p": 0.2, "top_k": 2}, {2, 4}),
        # temperature .5 squares the probabilities: .16 .09 .0225 .01 .0025 (sum .285)
        # -> .561 .316 .079 .035 .009; mass before: 0 .561 .877 -> top-p .8 keeps {2, 4}
        ({"temperature": 0.5, "top_p": 0.8}, {2, 4}),
        # temperature 2 flattens: sqrt(p) = .632 .548 .387 .316 .224 (sum 2.107)
        # -> .300 .260 .184 .150 .106; mass before 0 .300 .560 .744 .894 -> top-p .8 keeps four
        ({"temperature": 2.0, "top_p": 0.8}, {2, 4, 0, 1}),
    ],
)
def test_truncation_never_emits_excluded_tokens(params, allowed):
    counts = Counter(draw(params, 4000))
    assert set(counts) == allowed  # nothing outside, and every allowed token does occur


def test_min_p_comes_before_top_p_as_in_vllm():
    """The issue's case, as exact probabilities: (.4, .3, .15, .1, .05) with min_p=0.3 and
    top_p=0.8. min-p (threshold .12) leaves .4 .3 .15 (sum .85); top-p on those, .471 + .353
    = .824 >= .8, keeps two tokens, renormalised to .4/.7 and .3/.7."""
    probs = Sampler().target_probs(torch.tensor([LOGITS]), [req(min_p=0.3, top_p=0.8)])[0]
    expected = [0.0, 0.0, 0.4 / 0.7, 0.0, 0.3 / 0.7]
    assert probs.tolist() == pytest.approx(expected, abs=1e-6)


def test_truncation_per_row_in_one_batch():
    """Rows with different top-k/top-p/min-p in one call each keep their own allowed set."""
    cases = [
        ({"top_k": 1}, {2}),
        ({"top_p": 0.65}, {2, 4}),
        ({"min_p": 0.2}, {2, 4, 0, 1}),
        ({}, {0, 1, 2, 3, 4}),
    ]
    n = 1500
    requests = [req(f"{c}-{i}", **params) for i in range(n) for c, (params, _) in enumerate(cases)]
    tokens = Sampler()(torch.tensor([LOGITS] * len(requests)), requests).token_ids
    for c, (_, allowed) in enumerate(cases):
        assert set(tokens[c :: len(cases)]) == allowed


# --- temperature: the empirical distribution is softmax(logits / T) ---------------------------

@pytest.mark.parametrize("temperature", [1.0, 0.7, 2.5])
@pytest.mark.parametrize("seeded", [False, True])
def test_temperature_matches_softmax(temperature, seeded):
    logits = [1.0, -0.5, 0.3, 2.0, 0.0, -2.0]
    weights = [math.exp(v / temperature) for v in logits]
    expected = [w / sum(weights) for w in weights]
    n = 3000 if seeded else 20000
    seeds = list(range(n)) if seeded else [None] * n
    requests = [req(f"r{i}", temperature=temperature, seed=s) for i, s in enumerate(seeds)]
    tokens = Sampler()(torch.tensor([logits] * n), requests).token_ids
    counts = Counter(tokens)
    for t, p in enumerate(expected):
        # 5 standard errors of a binomial proportion: a false alarm is ~1e-6 per token
        assert abs(counts[t] / n - p) <= 5 * math.sqrt(p * (1 - p) / n), (t, counts[t] / n, p)


# --- greedy and seeds --------------------------------------------------------------------------

def test_greedy_is_argmax():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(64, 100, generator=g)
    expected = [max(range(100), key=lambda t: row[t]) for row in logits.tolist()]
    requests = [req(f"r{i}", temperature=0.0, top_k=5, top_p=0.3, seed=i) for i in range(64)]
    assert Sampler()(logits, requests).token_ids == expected


@pytest.mark.parametrize("width", [4096, 4160, 100, 64, 1])
def test_argmax_rows_is_argmax(width):
    """``argmax_rows`` picks what ``argmax`` picks: the first maximum, ties, +-inf rows, a
    NaN anywhere (the first NaN wins), few distinct values, a non-contiguous view."""
    g = torch.Generator().manual_seed(width)
    for _ in range(20):
        x = torch.randn(12, width, generator=g)
        k = torch.randint(0, width, (4,), generator=g)
        x[0, k] = x[0].max() + 1
        x[1, k[:2]] = float("nan")
        x[2] = 0.0
        x[3, k] = float("inf")
        x[4] = float("-inf")
        x[5, k[0]], x[5, k[1]] = float("inf"), float("nan")
        x[6] = torch.randint(0, 3, (width,), generator=g).float()
        assert torch.equal(argmax_rows(x), x.argmax(dim=-1))
        wide = torch.randn(5, 2 * width, generator=g)[:, ::2]
        assert torch.equal(argmax_rows(wide), wide.argmax(dim=-1))
    assert argmax_rows(torch.empty(0, width)).shape == (0,)


def test_plain_greedy_batch_takes_argmax_rows():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(7, 4096, generator=g)
    logits[3, 100] = logits[3, 3000] = logits.max() + 1  # a tie: the first one
    requests = [req(f"r{i}", temperature=0.0) for i in range(7)]
    assert Sampler()(logits, requests).token_ids == logits.argmax(dim=-1).tolist()


def _run(sampler: Sampler, steps: list[torch.Tensor], target: Request, row: int, others: list):
    """Sample `target` at `row` for each step's logits, among `others`; return its tokens."""
    tokens = []
    for step, target_logits in enumerate(steps):
        batch = list(others)
        batch.insert(row, target)
        noise_gen = torch.Generator().manual_seed(step)
        logits = torch.randn(len(batch), target_logits.shape[0], generator=noise_gen)
        logits[row] = target_logits
        tokens.append(sampler(logits, batch).token_ids[row])
    return tokens


def test_seed_reproducible_across_batches_and_rows():
    vocab = 50
    g = torch.Generator().manual_seed(7)
    steps = [0.3 * torch.randn(vocab, generator=g) for _ in range(12)]  # flat: many tokens likely
    params = dict(temperature=1.0, top_k=40, seed=1234)
    alone = _run(Sampler(seed=0), steps, req("a", **params), 0, [])
    others = [
        req("x", temperature=0.8),
        req("y", seed=99),
        req("z", temperature=0.0),
        req("w", top_p=0.9),
    ]
    crowded = _run(Sampler(seed=5), steps, req("a2", **params), 3, others)
    middle = _run(Sampler(seed=9), steps, req("a3", **params), 1, others[:2])
    assert alone == crowded == middle
    other_seed = _run(Sampler(seed=0), steps, req("a", **{**params, "seed": 4321}), 0, [])
    assert other_seed != alone


def test_remove_forgets_the_generator():
    vocab = 50
    g = torch.Generator().manual_seed(3)
    steps = [0.3 * torch.randn(vocab, generator=g) for _ in range(6)]
    sampler = Sampler()
    first = _run(sampler, steps, req("a", seed=77), 0, [])
    continued = _run(sampler, steps, req("a", seed=77), 0, [])  # same id: generator carries on
    sampler.remove("a")
    restarted = _run(sampler, steps, req("a", seed=77), 0, [])
    assert restarted == first
    assert continued != first


def test_unseeded_runs_repeat_with_the_sampler_seed():
    logits = torch.zeros(200, 30)
    requests = [req(f"r{i}") for i in range(200)]
    a = Sampler(seed=11)(logits, requests).token_ids
    b = Sampler(seed=11)(logits, requests).token_ids
    c = Sampler(seed=12)(logits, requests).token_ids
    assert a == b and a != c


# --- penalties ---------------------------------------------------------------------------------

PEN_LOGITS = [2.0, -1.0, 0.5, -0.5, 1.5, 0.0]
PEN_PARAMS = dict(
    prompt=[0, 1, 0],
    output=[2, 2, 3],
    repetition_penalty=2.0,
    frequency_penalty=0.5,
    presence_penalty=0.25,
)


def test_penalties_hand_computed():
    r = req(**PEN_PARAMS)
    # token 0: in prompt, positive -> 2.0 / 2 = 1.0; not in output
    # token 1: in prompt, negative -> -1.0 * 2 = -2.0
    # token 2: output x2 -> 0.5 / 2 = 0.25; - 0.5 * 2 - 0.25 = -1.0
    # token 3: output x1 -> -0.5 * 2 = -1.0; - 0.5 * 1 - 0.25 = -1.75
    # token 4, 5: never seen -> unchanged
    expected = [1.0, -2.0, -1.0, -1.75, 1.5, 0.0]
    neutral = req("n", prompt=[0, 1], output=[2, 3])
    freq_only = req("f", prompt=[0, 4], output=[4, 1], frequency_penalty=-1.0)
    # frequency/presence count output tokens only: token 4 once (+1.0), token 1 once (+1.0);
    # token 0, in the prompt only, is untouched
    logits = torch.tensor([PEN_LOGITS] * 3)
    apply_penalties(logits, [r, neutral, freq_only])
    assert logits[0].tolist() == pytest.approx(expected, abs=1e-6)
    assert logits[1].tolist() == PEN_LOGITS
    assert logits[2].tolist() == pytest.approx([2.0, 0.0, 0.5, -0.5, 2.5, 0.0], abs=1e-6)


def test_penalties_change_greedy_and_sampling():
    params = PEN_PARAMS
    logits = torch.tensor([PEN_LOGITS, PEN_LOGITS])
    out = Sampler()(logits, [req("g", temperature=0.0, **params), req("raw", temperature=0.0)])
    assert out.token_ids == [4, 0]  # penalised argmax is token 4 (1.5 > 1.0); raw argmax is token 0
    # sampling follows softmax of the hand-computed penalised logits
    expected_logits = [1.0, -2.0, -1.0, -1.75, 1.5, 0.0]
    z = sum(math.exp(v) for v in expected_logits)
    n = 20000
    batch = [req(f"r{i}", **params) for i in range(n)]
    tokens = Sampler()(torch.tensor([PEN_LOGITS] * n), batch).token_ids
    counts = Counter(tokens)
    for t, v in enumerate(expected_logits):
        p = math.exp(v) / z
        assert abs(counts[t] / n - p) <= 5 * math.sqrt(p * (1 - p) / n)


# --- min_tokens ----------------------------------------------------------------------------------

def test_min_tokens_masks_eos_and_stop_token_ids():
    # eos = 5 and stop token 3 are the two most likely; token 1 comes next
    logits = torch.tensor([[0.0, 1.0, 0.5, 3.0, -1.0, 4.0]] * 4)
    params = dict(min_tokens=2, stop_token_ids=[3], temperature=0.0)
    batch = [
        req("a", output=[], eos=5, **params),
        req("b", output=[1], eos=5, **params),
        req("c", output=[1, 1], eos=5, **params),  # min_tokens reached: eos is allowed again
        # ignore_eos: eos does not stop the request, so only token 3 is held back
        req("d", output=[], eos=5, ignore_eos=True, **params),
    ]
    assert Sampler()(logits, batch).token_ids == [1, 1, 5, 5]
    # sampled rows never draw the held-back tokens
    n = 3000
    rows = torch.tensor([[0.0, 1.0, 0.5, 3.0, -1.0, 4.0]] * n)
    batch = [req(f"r{i}", eos=5, min_tokens=1, stop_token_ids=[3]) for i in range(n)]
    tokens = Sampler()(rows, batch).token_ids
    assert set(tokens) == {0, 1, 2, 4}


# --- logprobs ------------------------------------------------------------------------------------

def _log_softmax(row: list[float]) -> list[float]:
    top = max(row)
    lse = top + math.log(sum(math.exp(v - top) for v in row))
    return [v - lse for v in row]


def test_logprobs_are_raw_log_softmax_with_ranks_and_sorted_top():
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(6, 20, generator=g)
    batch = [
        req("greedy", temperature=0.0, logprobs=3),
        req("sampled", temperature=0.5, top_k=4, logprobs=5, seed=1),
        req("penalised", output=[0, 1, 2], frequency_penalty=2.0, repetition_penalty=1.8,
            logprobs=2, seed=2),
        req("zero", logprobs=0, seed=3),
        req("none", seed=4),
        req("all", logprobs=25, seed=5),  # more than the vocabulary: all 20 tokens
    ]
    out = Sampler()(logits, batch)
    assert isinstance(out, SamplerOutput) and out.logprobs[4] is None
    for i, (r, token, entry) in enumerate(zip(batch, out.token_ids, out.logprobs)):
        if r.sampling_params.logprobs is None:
            continue
        expected = _log_softmax(logits[i].tolist())
        assert isinstance(entry, TokenLogprobs) and entry.token_id == token
        assert entry.logprob == pytest.approx(expected[token], abs=1e-5)
        assert entry.rank == 1 + sum(v > expected[token] for v in expected)
        k = min(r.sampling_params.logprobs, 20)
        by_prob = sorted(range(20), key=lambda t: -expected[t])[:k]
        assert [t for t, _ in entry.top] == by_prob
        top_logprobs = [lp for _, lp in entry.top]
        assert top_logprobs == pytest.approx([expected[t] for t in by_prob], abs=1e-5)
    assert out.logprobs[0].rank == 1 and out.logprobs[3].top == ()


def test_gather_logprobs_hand_worked_ties_and_per_row_k():
    """Row 0 is PROBS (ranks 2 > 4 > 0 > 1 > 3); row 1 has tokens 1 and 3 tied on top."""
    tied = [math.log(p) for p in (0.1, 0.3, 0.2, 0.3, 0.1)]
    out = gather_logprobs(torch.tensor([LOGITS, tied]), torch.tensor([0, 3]), [2, 0])
    assert [(e.token_id, e.rank) for e in out] == [(0, 3), (3, 1)]  # a tie is not "more likely"
    assert out[0].logprob == pytest.approx(math.log(0.15), abs=1e-6)
    assert [t for t, _ in out[0].top] == [2, 4] and out[1].top == ()
    assert [v for _, v in out[0].top] == pytest.approx([math.log(0.4), math.log(0.3)], abs=1e-6)


def test_ranked_lists_the_chosen_token_first_then_the_top_k_by_position():
    inside = TokenLogprobs(4, -1.2, 2, ((2, -0.9), (4, -1.2), (0, -1.9)))
    assert inside.ranked() == [(4, -1.2, 2), (2, -0.9, 1), (0, -1.9, 3)]
    outside = TokenLogprobs(3, -3.0, 5, ((2, -0.9),))
    assert outside.ranked() == [(3, -3.0, 5), (2, -0.9, 1)]


def test_a_row_whose_generator_fails_gets_no_logprobs_and_spares_the_others(monkeypatch):
    sampler = Sampler()
    real = sampler._request_generator

    def fragile(request, device):
        if request.request_id == "bad":
            raise RuntimeError("no generator")
        return real(request, device)

    monkeypatch.setattr(sampler, "_request_generator", fragile)
    rows = torch.tensor([LOGITS, LOGITS])
    out = sampler(rows, [req("bad", seed=1, logprobs=1), req("ok", seed=2, logprobs=1)])
    assert out.failed == {"bad": "RuntimeError: no generator"}
    assert out.token_ids[0] == -1 and out.logprobs[0] is None
    assert out.logprobs[1].token_id == out.token_ids[1] and out.logprobs[1].top[0][0] == 2


# --- mixed batch: each row as if alone ---------------------------------------------------------

def test_mixed_batch_rows_behave_as_if_alone():
    vocab = 40
    g = torch.Generator().manual_seed(21)

    def make():
        return [
            req("greedy", temperature=0.0, logprobs=2),
            req("topk", temperature=0.9, top_k=5, seed=10, logprobs=1),
            req("topp", temperature=1.3, top_p=0.7, seed=11),
            req("minp", min_p=0.2, seed=12),
            req("pen", prompt=[1, 2, 3], output=[4, 4], repetition_penalty=1.5,
                presence_penalty=1.0, seed=13),
            req("mintok", eos=0, min_tokens=3, stop_token_ids=[1], seed=14, logprobs=0),
            req("all", temperature=0.6, top_k=10, top_p=0.9, min_p=0.05, frequency_penalty=0.7,
                output=[5], seed=15),
        ]

    together, alone = Sampler(seed=1), Sampler(seed=2)
    together_reqs, alone_reqs = make(), make()
    for step in range(8):
        logits = torch.randn(len(together_reqs), vocab, generator=g)
        logits[:, :2] += 3.0  # make eos / stop token attractive so min_tokens matters
        order = torch.randperm(len(together_reqs), generator=g).tolist()
        batch = together_reqs if step == 0 else [together_reqs[i] for i in order]
        rows = logits if step == 0 else logits[order]
        out = together(rows, batch)
        for pos, r in enumerate(batch):
            i = together_reqs.index(r)
            single = alone(logits[i : i + 1], [alone_reqs[i]])
            assert out.token_ids[pos] == single.token_ids[0], (step, r.request_id)
            assert out.logprobs[pos] == single.logprobs[0]
        for ra, rb in zip(together_reqs, alone_reqs):  # both copies advance with the same token
            tok = out.token_ids[batch.index(ra)]
            ra.output_token_ids.append(tok)
            rb.output_token_ids.append(tok)
    assert all(t not in (0, 1) for t in together_reqs[5].output_token_ids[:3])


# --- errors --------------------------------------------------------------------------------------

def test_clear_errors():
    with pytest.raises(ValueError, match="rows but 2 requests"):
        Sampler()(torch.zeros(3, 5), [req("a"), req("b")])
    with pytest.raises(ValueError, match="2-D"):
        Sampler()(torch.zeros(5), [req("a")])
    with pytest.raises(ValueError, match="output_token_ids contains token id 9.*vocab size 5"):
        Sampler()(torch.zeros(1, 5), [req("a", output=[9], presence_penalty=1.0)])
    assert Sampler()(torch.zeros(0, 5), []) == SamplerOutput(token_ids=[], logprobs=[])


def test_all_greedy_batch_takes_the_argmax_like_the_full_path():
    """The all-plain-greedy shortcut gives the tokens the full path gives: a batch with one
    row that needs the full path (logprobs) samples every other row the same."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 50, generator=gen)
    plain = [req(f"r{i}", temperature=0) for i in range(5)]
    fast = Sampler()(logits, plain)
    mixed = plain[:4] + [req("r4", temperature=0, logprobs=1)]
    full = Sampler()(logits, mixed)
    assert fast.token_ids == full.token_ids == logits.argmax(dim=-1).tolist()
    assert fast.logprobs == [None] * 5 and full.logprobs[4] is not None
