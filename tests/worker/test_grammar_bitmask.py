"""The sampler's grammar bitmask: unpacked as xgrammar packs it, applied before every other
rule. References: xgrammar's own ``apply_token_bitmask_inplace`` and hand-built masks."""

from __future__ import annotations

import torch
import xgrammar as xgr

from workbench.request import Request
from workbench.sampling_params import SamplingParams
from workbench.worker.sampler import Sampler, apply_token_bitmask, unpack_bitmask


def test_masking_equals_xgrammars_own():
    gen = torch.Generator().manual_seed(0)
    vocab = 100  # not a multiple of 32: the last word's high bits are past the vocabulary
    logits = torch.randn(3, vocab, generator=gen)
    bitmask = torch.randint(-2**31, 2**31 - 1, (3, 4), generator=gen, dtype=torch.int32)
    expected = logits.clone()
    xgr.apply_token_bitmask_inplace(expected, bitmask, vocab_size=vocab)
    assert torch.equal(apply_token_bitmask(logits, bitmask), expected)


def test_unpack_reads_bit_t_mod_32_of_word_t_div_32():
    bitmask = torch.zeros(1, 2, dtype=torch.int32)
    bitmask[0, 0] = 1 << 5        # token 5
    bitmask[0, 1] = 1 | (1 << 3)  # tokens 32 and 35
    allowed = unpack_bitmask(bitmask, 40)
    assert allowed.nonzero()[:, 1].tolist() == [5, 32, 35]


def req(rid, **kw):
    return Request(rid, [1, 2, 3], SamplingParams(**kw))


def test_the_mask_comes_before_logit_bias_and_logprobs():
    logits = torch.zeros(2, 64)
    logits[:, 7] = 5.0  # the free favourite
    bitmask = torch.full((2, 2), -1, dtype=torch.int32)
    bitmask[0] = 0
    bitmask[0, 0] = (1 << 9) | (1 << 10)  # row 0 may say 9 or 10 only
    rows = [req("a", temperature=0, logit_bias={7: 100.0, 10: 1.0}, logprobs=1),
            req("b", temperature=0)]
    out = Sampler()(logits, rows, bitmask)
    assert out.token_ids == [10, 7]  # bias cannot bring back a masked token; the free row is free
    assert out.logprobs[0].top[0][0] in (9, 10)  # logprobs see the masked logits
