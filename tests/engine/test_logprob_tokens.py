"""The strings of logprob tokens (``Logprob.decoded_token``) as vLLM makes them.

vLLM's rules (``vllm/v1/engine/logprobs.py: LogprobsProcessor._verify_tokens`` and
``_correct_decoded_token``; ``vllm/tokenizers/detokenizer_utils.py: convert_ids_list_to_tokens``):
a token that is one byte of a multi-byte character gets what it adds after the sampled tokens
before it ("" until the character is complete, the whole character on the byte that completes
it); a SentencePiece piece keeps its leading space (``▁the`` reads " the", ``the`` "the").

References: Python's own UTF-8 decoding of the bytes (``bytes.fromhex(...).decode()``) and the
vocabulary's pieces, never the code's earlier output. Both the streamed (DELTA) and the final
outputs are checked; the SentencePiece-style tokenizer is trained here, on the shipped corpus
(``data/shakespeare``), with byte fallback as Llama-2's.
"""

from __future__ import annotations

import gzip
import json
import pathlib

import pytest
from logits_processor_support import forcing
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from workbench import LLMEngine, SamplingParams
from workbench.engine.output_processor import OutputProcessor
from workbench.engine.parallel_sampling import ParentRequest
from workbench.request import Request, RequestStatus
from workbench.sampling_params import RequestOutputKind
from workbench.worker.sampler import TokenLogprobs

DELTA, FINAL = RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY
CORPUS = pathlib.Path(__file__).resolve().parents[2] / "data" / "shakespeare" / "corpus"
EMOJI = "\U0001F600"  # F0 9F 98 80: four bytes, four tokens in the embedded byte-level BPE


# --------------------------------------------------------------- the embedded model, end to end

@pytest.fixture(scope="module")
def engine():
    return LLMEngine(device="cpu", dtype="float32", block_size=8, num_kv_blocks=64)


def run(engine, rid, prompt, params):
    engine.add_request(rid, prompt, params)
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.request_id == rid]
    return outs


@pytest.mark.parametrize("kind", [DELTA, FINAL])
def test_bytes_of_an_emoji_read_empty_until_the_last_carries_it(engine, kind):
    tok = engine.tokenizer
    ids = tok.encode(" " + EMOJI, add_special_tokens=False)
    assert len(ids) == 5 and tok.decode(ids[1:]) == EMOJI  # " " then one token per byte
    params = SamplingParams(temperature=0, max_tokens=len(ids), logprobs=2,
                            logits_processors=[forcing(ids)], output_kind=kind)
    outs = run(engine, f"emoji-{kind.name}", "ROMEO:", params)
    positions = [p for o in outs for p in o.outputs[0].logprobs]
    assert [o.outputs[0].token_ids for o in outs][-1][-1] == ids[-1]
    sampled = [p[t].decoded_token for p, t in zip(positions, ids)]
    # vLLM: the sampled tokens before each byte are its context; F0, 9F, 98 complete nothing
    # ("" each), 80 completes the emoji and carries it whole
    assert sampled == [" ", "", "", "", EMOJI]
    assert all("\ufffd" not in lp.decoded_token for p in positions for lp in p.values())


def test_prompt_logprob_bytes_use_the_prompt_tokens_before_them(engine):
    tok = engine.tokenizer
    prompt = tok.encode("A " + EMOJI, add_special_tokens=False)
    assert len(prompt) == 6
    (out,) = run(engine, "prompt-emoji", prompt,
                 SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1, output_kind=FINAL))
    plp = out.prompt_logprobs
    assert plp[0] is None
    assert [plp[i][t].decoded_token for i, t in enumerate(prompt) if i] == [" ", "", "", "", EMOJI]


# ------------------------------------------------------- a SentencePiece (Llama-2 style) tokenizer

@pytest.fixture(scope="module")
def sp_tok() -> Tokenizer:
    """BPE over Metaspace pieces (``▁the``) trained on two plays, then byte fallback added as
    Llama-2 has it: ``<0x00>``..``<0xFF>`` in the vocabulary, decoded by the same decoder
    chain (▁ -> space, byte fallback, fuse, strip the first space)."""
    text = "".join(gzip.open(CORPUS / f"{play}.txt.gz", "rt", encoding="utf-8").read()
                   for play in ("hamlet", "macbeth"))
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=800, special_tokens=["<unk>", "<s>", "</s>"],
                                  show_progress=False)
    bpe.train_from_iterator(text.splitlines(), trainer)
    spec = json.loads(bpe.to_str())
    vocab = spec["model"]["vocab"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    spec["model"]["byte_fallback"] = True
    tok = Tokenizer.from_str(json.dumps(spec))
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    return tok


def track(proc, request):
    parent = ParentRequest(request.request_id, None, request.prompt_token_ids,
                           request.sampling_params, arrival_time=request.arrival_time)
    parent.children, parent.deferred = [request], []
    proc.add_request(parent)


def feed(proc, request, steps):
    """Play the scheduler: one (token, TokenLogprobs) per step; the outputs of every step."""
    outs = []
    for i, (token_id, lp) in enumerate(steps):
        request.output_token_ids.append(token_id)
        if i == len(steps) - 1:
            request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        outs += proc.process([request], logprobs={request.request_id: lp}).outputs
    return [p for o in outs for p in o.outputs[0].logprobs]


def words_with_and_without_space(tok, n):
    """n words whose piece exists both as ``▁word`` and as ``word`` in the vocabulary."""
    vocab = tok.get_vocab()
    words = sorted(w[1:] for w in vocab if w.startswith("\u2581") and len(w) > 2 and w[1:] in vocab)
    assert len(words) >= n, words
    return words[:n]


@pytest.mark.parametrize("kind", [DELTA, FINAL])
def test_sentencepiece_pieces_keep_their_leading_space(sp_tok, kind):
    vocab = sp_tok.get_vocab()
    words = words_with_and_without_space(sp_tok, 5)
    # the collision vLLM's fix removes: decoded alone, both pieces read the same
    assert sp_tok.decode([vocab["\u2581" + words[0]]]) == sp_tok.decode([vocab[words[0]]])
    top = []
    for w in words:
        top += [(vocab["\u2581" + w], -1.0 - len(top)), (vocab[w], -1.0 - len(top) - 1)]
    proc = OutputProcessor(sp_tok)
    request = Request("r", [vocab["<s>"]], SamplingParams(logprobs=10, output_kind=kind))
    track(proc, request)
    first = top[0][0]
    (position,) = feed(proc, request, [(first, TokenLogprobs(first, -1.0, 1, tuple(top)))])
    assert len(position) == 10
    strings = {t: lp.decoded_token for t, lp in position.items()}
    assert strings == {**{vocab["\u2581" + w]: " " + w for w in words},
                       **{vocab[w]: w for w in words}}
    assert len(set(strings.values())) == 10  # 10 logprobs, 10 distinct keys for top_logprobs


@pytest.mark.parametrize("kind", [DELTA, FINAL])
def test_byte_fallback_tokens_decode_with_the_sampled_tokens_before_them(sp_tok, kind):
    vocab = sp_tok.get_vocab()
    char = "\u6771"  # 東 = E6 9D B1, not in the vocabulary: three byte-fallback tokens
    assert char.encode() == bytes.fromhex("e69db1")
    byte = {b: vocab[f"<0x{b:02X}>"] for b in range(256)}
    the = vocab["\u2581the"]
    assert sp_tok.encode(char, add_special_tokens=False).ids[-3:] == [byte[0xE6], byte[0x9D], byte[0xB1]]
    # the last position's candidates: the sampled B1, the alternative byte B2 and "▁the"
    other = bytes.fromhex("e69db2").decode()  # what E6 9D B2 would have written
    steps = [
        (the, TokenLogprobs(the, -0.1, 1, ((the, -0.1),))),
        (byte[0xE6], TokenLogprobs(byte[0xE6], -0.2, 1, ((byte[0xE6], -0.2), (the, -3.0)))),
        (byte[0x9D], TokenLogprobs(byte[0x9D], -0.3, 1, ((byte[0x9D], -0.3),))),
        (byte[0xB1], TokenLogprobs(byte[0xB1], -0.4, 1, ((byte[0xB1], -0.4), (byte[0xB2], -1.0),
                                                         (the, -2.0)))),
    ]
    proc = OutputProcessor(sp_tok)
    request = Request("r", [vocab["<s>"]], SamplingParams(logprobs=3, output_kind=kind))
    track(proc, request)
    positions = feed(proc, request, steps)
    strings = [{t: lp.decoded_token for t, lp in p.items()} for p in positions]
    assert strings == [
        {the: " the"},
        {byte[0xE6]: "", the: " the"},  # E6 alone completes nothing: ""
        {byte[0x9D]: ""},
        # each candidate on its own, after the sampled "▁the", E6, 9D: B1 completes 東, the
        # alternative B2 its own character, and "▁the" is clean
        {byte[0xB1]: char, byte[0xB2]: other, the: " the"},
    ]
