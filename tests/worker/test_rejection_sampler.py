"""RejectionSampler: its output distribution is the target's (a statistical test on a small
vocabulary with known p and q), greedy verification is plain greedy decoding, and every
sampling parameter applies at each verified position (checked against the plain Sampler
decoding one position at a time)."""

import pytest
import torch

from workbench.request import Request
from workbench.sampling_params import SamplingParams
from workbench.worker.rejection_sampler import RejectionSampler, rejection_sample, with_drafts
from workbench.worker.sampler import argmax_rows
from workbench.worker.sampler import Sampler, gather_logprobs

N = 200_000
# Total-variation distance of N draws from their distribution: about sqrt(V / N) / 2 ~ 0.003;
# a residual formula off by one term is off by ~0.05 or more (checked once by mutating it).
TV_BOUND = 0.012

P = torch.tensor([[0.40, 0.25, 0.15, 0.12, 0.08],  # target after the known tokens
                  [0.05, 0.10, 0.50, 0.05, 0.30],  # after draft 1
                  [0.20, 0.20, 0.20, 0.20, 0.20]])  # after draft 2 (bonus row)
Q = torch.tensor([[0.10, 0.50, 0.10, 0.20, 0.10],
                  [0.30, 0.10, 0.20, 0.30, 0.10]])


def tv(counts: torch.Tensor, p: torch.Tensor) -> float:
    return 0.5 * float((counts / counts.sum() - p).abs().sum())


def draw_drafts(q: torch.Tensor, n: int, gen: torch.Generator) -> torch.Tensor:
    return torch.stack([torch.multinomial(q[j], n, replacement=True, generator=gen)
                        for j in range(q.shape[0])], dim=1)


@pytest.mark.parametrize("with_q", [True, False])
def test_emitted_tokens_are_distributed_as_the_target(with_q):
    gen = torch.Generator().manual_seed(0)
    if with_q:  # drafts drawn from q, verified against p
        drafts = draw_drafts(Q, N, gen)
        q = Q.expand(N, -1, -1)
    else:  # deterministic proposals (n-gram): always tokens 1 then 2, q one-hot
        drafts = torch.tensor([[1, 2]]).expand(N, -1)
        q = None
    num_accepted, token = rejection_sample(P.expand(N, -1, -1), drafts, torch.full((N,), 2), q, gen)
    first = torch.where(num_accepted > 0, drafts[:, 0], token)
    assert tv(torch.bincount(first, minlength=5).float(), P[0]) < TV_BOUND
    # given the first draft was accepted, the next token follows row 1
    after = num_accepted >= 1
    second = torch.where(num_accepted[after] > 1, drafts[after, 1], token[after])
    assert tv(torch.bincount(second, minlength=5).float(), P[1]) < TV_BOUND
    # acceptance of draft 1 happens with probability sum_x min(p(x), q(x)) (one-hot q: p(1))
    expected = float(torch.minimum(P[0], Q[0]).sum()) if with_q else float(P[0, 1])
    assert float(after.float().mean()) == pytest.approx(expected, abs=0.01)
    # every draft accepted: the bonus token follows the last row
    bonus = token[num_accepted == 2]
    assert tv(torch.bincount(bonus, minlength=5).float(), P[2]) < 0.03  # fewer draws here


def request(rid="r", outputs=(), **params) -> Request:
    return Request(rid, [4, 2], SamplingParams(**{"max_tokens": 50, **params}),
                   eos_token_id=0, output_token_ids=list(outputs))


def test_greedy_accepts_while_the_draft_is_the_argmax():
    logits = torch.tensor([[0.0, 3.0, 1.0, 0.0],   # argmax 1
                           [0.0, 0.0, 4.0, 1.0],   # argmax 2
                           [5.0, 0.0, 0.0, 1.0],   # argmax 0
                           [0.0, 0.0, 0.0, 9.0]])  # bonus row: 3
    rs = RejectionSampler(Sampler())
    out = rs(logits, [request(temperature=0.0)], [[1, 2, 3]])
    assert out.num_accepted == [2] and out.token_ids == [[1, 2, 0]]  # draft 3 != 0: replaced
    out = rs(logits, [request(temperature=0.0)], [[1, 2, 0]])
    assert out.num_accepted == [3] and out.token_ids == [[1, 2, 0, 3]]  # all accepted + bonus
    out = rs(logits[:2], [request(temperature=0.0)], [[2]])
    assert out.num_accepted == [0] and out.token_ids == [[1]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_row_argmax_is_torch_argmax_ties_nan_and_inf_included(dtype):
    """The greedy rows' argmax: the first maximum wins a tie, a NaN counts as the maximum (its
    first one), an all -inf row gives 0, on contiguous rows and strided views, as
    ``torch.argmax`` says."""
    x = torch.randn(7, 300, generator=torch.Generator().manual_seed(0))
    x[1, [17, 250]] = 9.0
    x[2, [40, 80]] = float("nan")
    x[3] = float("-inf")
    x[4, 5] = float("inf")
    x[5, [3, 200]] = float("inf")
    x = x.to(dtype)
    assert argmax_rows(x).tolist()[1:6] == [17, 40, 0, 5, 3]
    for rows in (x, x[:, ::3], x.t().contiguous().t(), x[:0]):
        assert argmax_rows(rows).tolist() == torch.argmax(rows, dim=-1).tolist()


GREEDY_PARAMS = [
    dict(frequency_penalty=2.0),
    dict(presence_penalty=2.0, repetition_penalty=1.7),
    dict(min_tokens=4),  # eos (0) is masked until 4 outputs, drafts counted
    dict(bad_words_token_ids=[[1, 2]]),  # 2 is banned right after 1
    dict(logit_bias={3: 1.5}),
    dict(logits_processors=[lambda out, row: row - 2.0 * (torch.arange(row.numel()) == (len(out) % 5))]),
]


@pytest.mark.parametrize("params", GREEDY_PARAMS, ids=lambda p: next(iter(p)))
def test_every_sampling_parameter_applies_at_each_verified_position(params):
    """The drafts are what plain greedy decoding with the Sampler gives position by position
    (so all must be accepted); a wrong draft at the end is replaced by that decoding's token."""
    torch.manual_seed(1)
    logits = torch.randn(6, 5)
    sampler = Sampler()
    base = request(outputs=[1, 3], temperature=0.0, **params)
    plain = []
    for j in range(6):
        out = sampler(logits[j : j + 1], [with_drafts(base, plain)])
        plain.append(out.token_ids[0])
    rs = RejectionSampler(sampler)
    out = rs(logits, [base], [plain[:5]])
    assert out.token_ids == [plain] and out.num_accepted == [5]
    wrong = plain[:4] + [(plain[4] + 1) % 5]
    out = rs(logits[:6], [base], [wrong])
    assert out.token_ids == [plain[:5]] and out.num_accepted == [4]


def test_logprobs_are_those_of_the_emitted_tokens_from_the_raw_logits():
    torch.manual_seed(2)
    logits = torch.randn(4, 6)
    r = request(temperature=0.0, logprobs=2, frequency_penalty=1.0)
    out = RejectionSampler(Sampler())(logits, [r], [[0, 0, 0]])
    tokens = out.token_ids[0]
    want = gather_logprobs(logits[: len(tokens)], torch.tensor(tokens), [2] * len(tokens))
    assert out.logprobs == [want]


def test_seeded_requests_repeat_whatever_the_batch():
    torch.manual_seed(3)
    logits = torch.randn(3, 8)
    seeded = request("s", temperature=0.9, seed=42, top_k=5)
    a = RejectionSampler(Sampler(seed=1))(logits, [seeded], [[1, 2]])
    other = request("o", temperature=1.0)
    b = RejectionSampler(Sampler(seed=2))(torch.cat([torch.randn(2, 8), logits]),
                                          [other, request("s", temperature=0.9, seed=42, top_k=5)],
                                          [[3], [1, 2]])
    assert a.token_ids[0] == b.token_ids[1]


def test_top_k_truncation_applies_to_the_verified_rows():
    """With top_k=1 the target is one-hot on each row's argmax: a sampled request then
    accepts exactly the greedy run, and its replacement token is the argmax."""
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0], [0.0, 0.0, 5.0]])
    out = RejectionSampler(Sampler())(logits, [request(temperature=1.0, top_k=1)], [[1, 2]])
    assert out.token_ids == [[1, 0]] and out.num_accepted == [1]
