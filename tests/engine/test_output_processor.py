"""Outputs: incremental detokenization, stop strings, finish reasons, RequestOutput.

References are independent of the code under test: the tokenizer's own ``decode`` of
the whole sequence, ``str.find`` / a character-by-character scan of the full text for
stop strings, and hand-worked expectations.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from workbench.engine.detokenizer import IncrementalDetokenizer
from workbench.engine.output_processor import OutputProcessor
from workbench.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from workbench.engine.parallel_sampling import ParentRequest
from workbench.request import Request, RequestStatus
from workbench.sampling_params import RequestOutputKind, SamplingParams
from workbench.worker.sampler import TokenLogprobs

FINAL, DELTA = RequestOutputKind.FINAL_ONLY, RequestOutputKind.DELTA

FFFD = "\ufffd"
SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
WORDS = "the quick brown fox jumps over lazy dog café naïve 東京 京都 😀 🎉 résumé hello world stop END"


def _corpus() -> list[str]:
    rnd = random.Random(0)
    words = WORDS.split()
    return [" ".join(rnd.choice(words) for _ in range(12)) for _ in range(300)]


@pytest.fixture(scope="module")
def tok() -> PreTrainedTokenizerFast:
    """A byte-level BPE (GPT-2 style) with few merges, so rare characters stay split in bytes."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(_corpus(), trainer)
    return PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>")


def ids_of(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def make_request(prompt_ids, rid="r", **params) -> Request:
    params.setdefault("output_kind", FINAL)
    return Request(rid, list(prompt_ids), SamplingParams(**params))


def track(proc, prompt, *children, parent_id=None) -> ParentRequest:
    """Add a request to the processor whose n sequences are the hand-made ``children``
    (the test plays the scheduler on them)."""
    first = children[0]
    parent = ParentRequest(parent_id or first.request_id, prompt, first.prompt_token_ids,
                           first.sampling_params, arrival_time=first.arrival_time)
    assert [c.request_id for c in parent.children] == [c.request_id for c in children]
    parent.children, parent.deferred = list(children), []
    proc.add_request(parent)
    return parent


def process(proc, requests, logprobs=None):
    """One step's processing: (outputs, the ids it asks the scheduler to finish STOPPED)."""
    result = proc.process(requests, logprobs=logprobs)
    return result.outputs, [rid for rid, status in result.reqs_to_abort.items()
                            if status is RequestStatus.FINISHED_STOPPED]


def drive(proc, request, token_ids, finish_after=None, status=None, stop_reason=None):
    """Play the engine: one token per step, the scheduler's status set before process().

    ``finish_after``: the step (1-based) at which the scheduler finishes the request with
    ``status``; stop-string ids returned by process() are finished as FINISHED_STOPPED.
    Returns every RequestOutput produced and, per step, the outputs of that step.
    """
    outputs = []
    for step, token_id in enumerate(token_ids, start=1):
        request.output_token_ids.append(token_id)
        if finish_after == step:
            request.status, request.stop_reason = status, stop_reason
        outs, stop_ids = process(proc, [request])
        outputs.extend(outs)
        if stop_ids:
            assert stop_ids == [request.request_id] and not request.is_finished
            request.status = RequestStatus.FINISHED_STOPPED
        if request.is_finished:
            break
    return outputs


# ------------------------------------------------------------- incremental detokenization
# Pieces, not single characters: flags and ZWJ emoji are several code points.
TEXTS = st.lists(
    st.sampled_from(list("ab xyz.,\n") + list("éïç東京都新しい") + ["😀", "🐍", "🎉", "🇯🇵", "👩‍💻"]),
    min_size=1,
    max_size=20,
).map("".join)


def test_tokenizer_splits_multibyte_characters(tok):
    # The property tests below are only meaningful if characters really straddle tokens.
    for ch in ["🐍", "新"]:
        pieces = [tok.decode([i]) for i in ids_of(tok, ch)]
        assert len(pieces) > 1 and all(FFFD in p for p in pieces), pieces


@settings(max_examples=120, **SETTINGS)
@given(text=TEXTS, data=st.data())
def test_streamed_text_equals_decode_and_never_shows_fffd(tok, text, data):
    ids = ids_of(tok, text)
    split = data.draw(st.integers(0, len(ids)), label="prompt/output split")
    prompt, out = ids[:split], ids[split:]
    expected = tok.decode(out)
    detok = IncrementalDetokenizer(tok, make_request(prompt))
    deltas = []
    for token_id in out:
        assert detok.update([token_id]) is None
        deltas.append(detok.get_delta(finished=False))
        if FFFD not in expected:
            assert FFFD not in deltas[-1]
        assert expected.startswith(detok.text)
    detok.flush()
    deltas.append(detok.get_delta(finished=True))
    assert detok.text == expected
    assert "".join(deltas) == expected


@settings(max_examples=80, **SETTINGS)
@given(raw=st.lists(st.integers(0, 399), max_size=25), skip=st.booleans())
def test_any_token_sequence_ends_equal_to_decode(tok, raw, skip):
    # Arbitrary ids: invalid UTF-8 byte runs and special tokens included. After flush()
    # the text is exactly what decode() gives (U+FFFD where decode puts it).
    ids = [i % len(tok) for i in raw]
    detok = IncrementalDetokenizer(tok, make_request([], skip_special_tokens=skip))
    detok.update(ids)
    detok.flush()
    assert detok.text == tok.decode(ids, skip_special_tokens=skip)


def test_chunks_of_several_tokens_per_update(tok):
    text = "café 🐍 東京 新しい"
    ids = ids_of(tok, text)
    detok = IncrementalDetokenizer(tok, make_request(ids_of(tok, "hello ")))
    for start in range(0, len(ids), 3):
        detok.update(ids[start : start + 3])
    assert detok.text == text


def test_prompt_context_keeps_sentencepiece_leading_space():
    # Metaspace decoders drop the space of the first token of a sequence; primed with
    # the prompt, the output " world" keeps it, as in decode(prompt + output).
    sp = Tokenizer(models.BPE(unk_token="<unk>"))
    sp.pre_tokenizer = pre_tokenizers.Metaspace()
    sp.decoder = decoders.Metaspace()
    sp.train_from_iterator(
        _corpus(), trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>"], show_progress=False)
    )
    prompt = sp.encode("hello").ids
    full = sp.encode("hello world fox").ids
    assert full[: len(prompt)] == prompt
    out = full[len(prompt) :]
    assert sp.decode(out) == "world fox"  # decoded alone the space is lost
    detok = IncrementalDetokenizer(sp, make_request(prompt))
    for token_id in out:
        detok.update([token_id])
    assert detok.text == " world fox"


def test_stream_restarts_after_a_decode_error(tok, monkeypatch):
    # DecodeStream raises when a decoder rewrites text it already returned; the
    # detokenizer restarts the stream and replays the held tokens.
    text = "ab 🐍 xyz"
    ids = ids_of(tok, text)
    detok = IncrementalDetokenizer(tok, make_request([]))
    detok.update(ids[:2])
    real = detok._stream

    class FailOnce:
        def step(self, tokenizer, token_id):
            raise Exception("Invalid prefix encountered")  # noqa: TRY002 - what tokenizers raises

    detok._stream = FailOnce()
    for token_id in ids[2:]:
        detok.update([token_id])
    assert detok._stream is not real
    assert detok.text == text


# ------------------------------------------------------------------------- stop strings
def reference_stop(text: str, stops: list[str], include: bool) -> tuple[str, str | None]:
    """Scan left to right; the first stop string complete wins (the longest on a tie)."""
    for end in range(1, len(text) + 1):
        hits = [s for s in stops if text[:end].endswith(s)]
        if hits:
            stop = max(hits, key=len)
            return (text[:end] if include else text[: end - len(stop)]), stop
    return text, None


def stream_through_processor(tok, out_ids, include, stops, check_prefix_of=None):
    """Stream tokens through the OutputProcessor as DELTA outputs; return (outputs, text)."""
    proc = OutputProcessor(tok)
    request = make_request(ids_of(tok, "hi "), stop=stops, include_stop_str_in_output=include,
                           max_tokens=None, output_kind=DELTA)
    track(proc, "hi ", request)
    outs = drive(proc, request, out_ids, finish_after=len(out_ids),
                 status=RequestStatus.FINISHED_LENGTH_CAPPED)
    streamed = ""
    for out in outs:
        streamed += out.outputs[0].text
        if check_prefix_of is not None:
            # The held-back text never leaks: what was streamed so far is always a prefix
            # of the final text, so a stop string that is later cut never went out.
            assert check_prefix_of.startswith(streamed), (streamed, check_prefix_of)
    return outs, streamed


def test_stop_string_across_token_boundary(tok):
    text = "the quick brown fox jumps over"
    ids = ids_of(tok, text)
    stop = "own fox ju"
    pieces = [tok.decode([i]) for i in ids]
    assert not any(stop in p for p in pieces) and len(ids) > 3  # the stop spans tokens
    cut = text.find(stop)
    for include, expected in [(False, text[:cut]), (True, text[: cut + len(stop)])]:
        outs, streamed = stream_through_processor(tok, ids, include, [stop], expected)
        final = outs[-1]
        assert final.finished and streamed == expected
        assert final.outputs[0].finish_reason == "stop" and final.outputs[0].stop_reason == stop
        # tokens keep everything generated up to the token that completed the stop
        n_done = sum(len(o.outputs[0].token_ids) for o in outs)
        assert ids[:n_done] == [t for o in outs for t in o.outputs[0].token_ids]
        assert tok.decode(ids[:n_done]).find(stop) == cut
        assert stop not in tok.decode(ids[: n_done - 1])


def test_partial_stop_is_held_back_then_released(tok):
    detok = IncrementalDetokenizer(tok, make_request([], stop=["END"]))
    detok.update(ids_of(tok, "abc E"))
    assert detok.get_delta(finished=False) == "abc"  # " E" could start "END"
    detok.update(ids_of(tok, "x"))
    assert detok.get_delta(finished=False) == " "  # "Ex" is not a stop, " Ex"[:-2] freed
    assert detok.get_delta(finished=True) == "Ex"


def test_earliest_stop_wins_whatever_the_list_order(tok):
    text = "hello world"
    ids = ids_of(tok, text)
    for stops in (["world", "lo"], ["lo", "world"]):
        detok = IncrementalDetokenizer(tok, make_request([], stop=stops))
        assert detok.update(ids) == "lo"
        assert detok.text == "hel"
    # Same end: the longer one (it starts first) wins.
    detok = IncrementalDetokenizer(tok, make_request([], stop=["wor", "o wor"]))
    assert detok.update(ids) == "o wor" and detok.text == "hell"


@settings(max_examples=150, **SETTINGS)
@given(
    text=st.text(st.sampled_from("ab c东😀"), min_size=1, max_size=24),
    stops=st.lists(st.text(st.sampled_from("ab c东😀"), min_size=1, max_size=4), min_size=1,
                   max_size=3),
    include=st.booleans(),
)
def test_stop_strings_match_a_character_scan(tok, text, stops, include):
    ids = ids_of(tok, text)
    expected, expected_stop = reference_stop(text, stops, include)
    outs, streamed = stream_through_processor(tok, ids, include, stops, check_prefix_of=expected)
    final = outs[-1].outputs[0]
    assert streamed == expected
    assert outs[-1].finished
    if expected_stop is None:
        assert (final.finish_reason, final.stop_reason) == ("length", None)
    else:
        assert (final.finish_reason, final.stop_reason) == ("stop", expected_stop)


def test_stop_strings_wait_for_min_tokens(tok):
    pieces = [ids_of(tok, p) for p in ("a", " b", " a", " b")]
    ids = [t for p in pieces for t in p]
    first_b = len(pieces[0]) + len(pieces[1])  # tokens out when the first "b" completes
    detok = IncrementalDetokenizer(tok, make_request([], stop=["b"], min_tokens=first_b + 1))
    outcomes = [detok.update([i]) for i in ids]
    # the first "b" is ignored (fewer than min_tokens tokens out); the second one stops
    assert outcomes == [None] * (len(ids) - 1) + ["b"]
    assert detok.text == "a b a "


@pytest.mark.parametrize("min_extra, stops_at_first", [(0, False), (-1, True)])
def test_stop_strings_count_only_after_more_than_min_tokens(tok, min_extra, stops_at_first):
    """vLLM checks stop strings only once more than min_tokens tokens are out: a "b" completed
    by token number min_tokens is ignored, one completed by token min_tokens + 1 stops."""
    pieces = [ids_of(tok, p) for p in ("a", " b", " a", " b")]
    ids = [t for p in pieces for t in p]
    first_b = len(pieces[0]) + len(pieces[1])  # tokens out when the first "b" completes
    detok = IncrementalDetokenizer(tok, make_request([], stop=["b"], min_tokens=first_b + min_extra))
    outcomes = [detok.update([i]) for i in ids]
    stop_at = first_b if stops_at_first else len(ids)
    assert outcomes == [None] * (stop_at - 1) + ["b"] + [None] * (len(ids) - stop_at)
    assert detok.text == ("a " if stops_at_first else "a b a ")


@pytest.mark.parametrize("kind", [DELTA, FINAL])
def test_min_tokens_stop_string_rule_in_outputs(tok, kind):
    """The same rule as the outputs show it: min_tokens = the token that completes the first
    "b" lets it through; the second "b" stops the request (text and finish streamed alike)."""
    pieces = [ids_of(tok, p) for p in ("a", " b", " a", " b", " a")]
    ids = [t for p in pieces for t in p]
    first_b = len(pieces[0]) + len(pieces[1])
    proc = OutputProcessor(tok)
    request = make_request([5], stop=["b"], min_tokens=first_b, max_tokens=len(ids),
                           output_kind=kind)
    track(proc, None, request)
    outs, stopped = [], []
    for token_id in ids:
        request.output_token_ids.append(token_id)
        new, ended = process(proc, [request])
        outs += new
        stopped += ended
        if ended:
            request.status = RequestStatus.FINISHED_STOPPED  # the scheduler's part
            break
    text = "".join(o.outputs[0].text for o in outs) if kind is DELTA else outs[-1].outputs[0].text
    final = outs[-1].outputs[0]
    assert stopped == ["r"] and (final.finish_reason, final.stop_reason) == ("stop", "b")
    assert text == "a b a "
    assert len(request.output_token_ids) == first_b + len(pieces[2]) + len(pieces[3])


# ---------------------------------------------------------------------- finish reasons
def test_length_and_abort(tok):
    proc = OutputProcessor(tok)
    ids = ids_of(tok, "the fox")
    r1 = make_request([5], "r1", max_tokens=len(ids))
    r2 = make_request([5], "r2")
    track(proc, None, r1)
    track(proc, None, r2)
    out = drive(proc, r1, ids, finish_after=len(ids),
                status=RequestStatus.FINISHED_LENGTH_CAPPED)
    assert len(out) == 1 and out[0].finished
    assert (out[0].outputs[0].finish_reason, out[0].outputs[0].stop_reason) == ("length", None)
    r2.output_token_ids.append(ids_of(tok, "x")[0])
    assert process(proc, [r2]) == ([], [])  # FINAL_ONLY: nothing until finished
    assert proc.has_unfinished_requests()
    assert proc.child_ids(["r2", "unknown"]) == ["r2"]
    (aborted,) = proc.abort(["r2", "unknown"])
    assert aborted.request_id == "r2" and aborted.finished
    assert aborted.outputs[0].finish_reason == "abort" and aborted.outputs[0].text == "x"
    assert not proc.has_unfinished_requests()
    assert proc.child_ids(["r2"]) == [] and proc.abort(["r2"]) == []


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("skip", [True, False])
def test_eos_text_is_left_out(tok, include, skip):
    proc = OutputProcessor(tok)
    request = make_request([5], include_stop_str_in_output=include, skip_special_tokens=skip)
    track(proc, None, request)
    ids = ids_of(tok, "the fox") + [tok.eos_token_id]
    (out,) = drive(proc, request, ids, finish_after=len(ids),
                   status=RequestStatus.FINISHED_STOPPED)
    c = out.outputs[0]
    assert (c.finish_reason, c.stop_reason) == ("stop", None)
    assert c.token_ids == ids  # the eos token id is reported
    assert c.text == ("the fox</s>" if include and not skip else "the fox")


@pytest.mark.parametrize("include", [False, True])
def test_stop_token_id(tok, include):
    stop_id = ids_of(tok, ".")[0]
    proc = OutputProcessor(tok)
    request = make_request([5], stop_token_ids=[stop_id], include_stop_str_in_output=include)
    track(proc, None, request)
    ids = ids_of(tok, "the fox.")
    assert ids[-1] == stop_id
    (out,) = drive(proc, request, ids, finish_after=len(ids),
                   status=RequestStatus.FINISHED_STOPPED, stop_reason=stop_id)
    c = out.outputs[0]
    assert (c.finish_reason, c.stop_reason) == ("stop", stop_id)
    assert c.text == ("the fox." if include else "the fox")


def test_stop_string_beats_length_in_the_same_step(tok):
    proc = OutputProcessor(tok)
    ids = ids_of(tok, "the fox")
    request = make_request([5], stop=["fox"], max_tokens=len(ids))
    track(proc, None, request)
    request.output_token_ids.extend(ids)
    request.status = RequestStatus.FINISHED_LENGTH_CAPPED
    outs, stop_ids = process(proc, [request])
    assert stop_ids == []  # already finished by the scheduler
    assert (outs[0].outputs[0].finish_reason, outs[0].outputs[0].stop_reason) == ("stop", "fox")
    assert outs[0].outputs[0].text == "the "


@pytest.mark.parametrize("skip", [True, False])
def test_skip_special_tokens(tok, skip):
    bos, eos = tok.bos_token_id, tok.eos_token_id
    ids = ids_of(tok, "a") + [bos] + ids_of(tok, " b") + [eos] + ids_of(tok, "c")
    proc = OutputProcessor(tok)
    request = make_request([5], skip_special_tokens=skip)
    track(proc, None, request)
    (out,) = drive(proc, request, ids, finish_after=len(ids),
                   status=RequestStatus.FINISHED_LENGTH_CAPPED)
    assert out.outputs[0].text == tok.decode(ids, skip_special_tokens=skip)
    assert out.outputs[0].text == ("a bc" if skip else "a<s> b</s>c")


# ------------------------------------------------------------------------ n > 1, streams
def test_n2_children_share_one_output(tok):
    a, b = ids_of(tok, "the fox"), ids_of(tok, "lazy dog jumps")
    for stream in (False, True):
        proc = OutputProcessor(tok)
        kind = DELTA if stream else FINAL
        kids = [make_request([5, 6], f"{i}_p", n=2, output_kind=kind) for i in range(2)]
        track(proc, "P", *kids, parent_id="p")
        seen: list[RequestOutput] = []
        for step in range(max(len(a), len(b))):
            live = []
            for kid, ids in zip(kids, (a, b)):
                if step < len(ids):
                    kid.output_token_ids.append(ids[step])
                    if step == len(ids) - 1:
                        kid.status = RequestStatus.FINISHED_LENGTH_CAPPED
                    live.append(kid)
            outs, _ = process(proc, live)
            seen.extend(outs)
        assert {o.request_id for o in seen} == {"p"} and seen[-1].finished
        assert all(not o.finished for o in seen[:-1])
        if not stream:
            (only,) = seen
            assert [c.index for c in only.outputs] == [0, 1]
            assert [c.text for c in only.outputs] == ["the fox", "lazy dog jumps"]
            assert [c.token_ids for c in only.outputs] == [a, b]
        else:
            assert len(seen) == max(len(a), len(b))
            for index, ids in ((0, a), (1, b)):
                mine = [c for o in seen for c in o.outputs if c.index == index]
                assert len(mine) == len(ids)  # one delta per step it was updated, none after
                assert [t for c in mine for t in c.token_ids] == ids
                assert "".join(c.text for c in mine) == tok.decode(ids)
                assert [c.finish_reason for c in mine] == [None] * (len(ids) - 1) + ["length"]
        assert seen[-1].prompt == "P" and seen[-1].prompt_token_ids == [5, 6]
        assert not proc.has_unfinished_requests()


def test_add_request_rejects_ids_in_flight(tok):
    proc = OutputProcessor(tok)
    track(proc, None, make_request([1], "0_p", n=2), make_request([1], "1_p", n=2), parent_id="p")
    with pytest.raises(ValueError, match="'p' is already in flight"):
        track(proc, None, make_request([1], "p"))
    with pytest.raises(ValueError, match="'1_p' is already in flight"):
        track(proc, None, make_request([1], "1_p"))
    assert proc.get_num_unfinished_requests() == 1  # a refused request leaves nothing behind
    with pytest.raises(KeyError, match="never added"):
        process(proc, [make_request([1], "nope")])


# ---------------------------------------------------------------------------- logprobs
def test_logprobs_become_vllm_dicts(tok):
    proc = OutputProcessor(tok)
    request = make_request([5], logprobs=2, output_kind=DELTA)
    track(proc, None, request)
    a, b = ids_of(tok, "the fox")[:2]
    steps = [
        (a, TokenLogprobs(a, -0.5, 1, ((a, -0.5), (b, -1.5)))),
        (b, TokenLogprobs(b, -3.0, 4, ((a, -0.25), (7, -1.0)))),
    ]
    outs = []
    for i, (token_id, lp) in enumerate(steps):
        request.output_token_ids.append(token_id)
        if i == len(steps) - 1:
            request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        outs += process(proc, [request], {request.request_id: lp})[0]
    first, second = (o.outputs[0] for o in outs)
    assert first.logprobs == [
        {a: Logprob(-0.5, 1, tok.decode([a])), b: Logprob(-1.5, 2, tok.decode([b]))}
    ]
    assert second.logprobs == [
        {b: Logprob(-3.0, 4, tok.decode([b])), a: Logprob(-0.25, 1, tok.decode([a])),
         7: Logprob(-1.0, 2, tok.decode([7]))}
    ]
    assert list(second.logprobs[0]) == [b, a, 7]  # sampled token first
    assert first.cumulative_logprob == pytest.approx(-0.5)
    assert second.cumulative_logprob == pytest.approx(-3.5)


def test_missing_logprobs_is_an_error_and_none_when_not_asked(tok):
    proc = OutputProcessor(tok)
    asked, plain = make_request([5], "asked", logprobs=0), make_request([5], "plain")
    track(proc, None, asked)
    track(proc, None, plain)
    plain.output_token_ids.append(9)
    plain.status = RequestStatus.FINISHED_LENGTH_CAPPED
    (out,), _ = process(proc, [plain])
    assert out.outputs[0].logprobs is None and out.outputs[0].cumulative_logprob is None
    asked.output_token_ids.append(9)
    asked.status = RequestStatus.FINISHED_LENGTH_CAPPED
    (failed,), _ = process(proc, [asked])  # a missing entry fails this request only
    assert failed.finished and failed.outputs[0].finish_reason == "error"
    assert "asked for logprobs=0" in failed.error


# --------------------------------------------------------------------- reprs and metrics
def test_metrics_and_reprs(tok):
    proc = OutputProcessor(tok)
    request = make_request(ids_of(tok, "hi"), "r<1>", max_tokens=2)
    request.arrival_time, request.first_scheduled_time = 100.0, 100.25
    request.first_token_time, request.finished_time = 100.5, 102.0
    request.num_preemptions, request.num_cached_tokens = 1, 16
    track(proc, "hi", request)
    (out,) = drive(proc, request, ids_of(tok, "<i>"), finish_after=2,
                   status=RequestStatus.FINISHED_LENGTH_CAPPED)
    m = out.metrics
    assert (m.time_to_first_token, m.queue_time, m.e2e_latency) == (0.5, 0.25, 2.0)
    assert out.num_cached_tokens == 16
    assert repr(m) == "RequestMetrics(num_preemptions=1, num_cached_tokens=16)"
    text = tok.decode(out.outputs[0].token_ids)
    assert repr(out) == (
        f"RequestOutput(request_id='r<1>', prompt='hi', outputs=[CompletionOutput(index=0, "
        f"text={text!r}, finish_reason='length')], finished=True)"
    )
    html = out._repr_html_()
    assert "<table>" in html and "r&lt;1&gt;" in html and "<i" not in html
    assert RequestMetrics().time_to_first_token is None and RequestMetrics().e2e_latency is None
    c = CompletionOutput(0, "x", [1], -1.23456, None)
    assert not c.finished()
    assert repr(c) == (
        "CompletionOutput(index=0, text='x', token_ids=[1], cumulative_logprob=-1.2346, "
        "logprobs=None, finish_reason=None, stop_reason=None)"
    )


def test_cumulative_text_never_shows_a_stop_string_it_later_cuts(tok):
    text = "the quick brown fox jumps over"
    ids = ids_of(tok, text)
    stop = "own fox ju"
    proc = OutputProcessor(tok)
    request = make_request([5], stop=[stop], output_kind=RequestOutputKind.CUMULATIVE)
    track(proc, None, request)
    outs = drive(proc, request, ids, finish_after=len(ids),
                 status=RequestStatus.FINISHED_LENGTH_CAPPED)
    final = text[: text.find(stop)]
    assert outs[-1].outputs[0].text == final and outs[-1].finished
    assert len(outs) > 2 and all(final.startswith(o.outputs[0].text) for o in outs)


def test_parent_request_fans_out_seeded_children():
    params = SamplingParams(n=3, seed=10, max_tokens=4)
    parent = ParentRequest("p", "hi", [1, 2], params, eos_token_id=7, priority=2,
                           arrival_time=5.0)
    assert [c.request_id for c in parent.children] == ["0_p", "1_p", "2_p"]
    assert [c.sampling_params.seed for c in parent.children] == [10, 11, 12]
    assert all(c.sampling_params.n == 1 and c.priority == 2 and c.arrival_time == 5.0
               and c.eos_token_id == 7 for c in parent.children)
    assert parent.deferred == parent.children[1:] and parent.release_siblings() == []
    parent.children[0].output_token_ids.append(3)  # child 0 computed its prompt
    assert parent.release_siblings() == parent.children[1:] and parent.deferred == []
    top = ParentRequest("t", None, [1], SamplingParams(n=2, seed=2**63 - 1), arrival_time=0.0)
    assert [c.sampling_params.seed for c in top.children] == [2**63 - 1, -(2**63)]
    single = ParentRequest("q", None, [1], SamplingParams(), arrival_time=0.0)
    assert [c.request_id for c in single.children] == ["q"] and single.deferred == []


@pytest.mark.parametrize("seed", range(4))
def test_counts_only_fast_path_keeps_the_general_paths_stats(seed):
    """A FINAL_ONLY request without text or logprobs is only counted until it finishes
    (``SequenceState.counts_only``: ``process`` skips ``_update``); the same tokens, on the same
    clock, through the general path (a CUMULATIVE twin) must give the same IterationStats every
    step -- several tokens a step (speculative decoding), none, the first token, the finish --
    and the same final tokens and finish."""
    rnd = random.Random(seed)
    kinds = (FINAL, RequestOutputKind.CUMULATIVE)
    procs = {kind: OutputProcessor(tokenizer=None) for kind in kinds}
    reqs = {kind: [] for kind in kinds}
    for i in range(12):
        prompt, max_tokens = [rnd.randrange(100) for _ in range(rnd.randint(1, 20))], rnd.randint(1, 30)
        for kind in kinds:
            params = SamplingParams(max_tokens=max_tokens, detokenize=False, output_kind=kind)
            parent = ParentRequest(f"r{i}", None, prompt, params, arrival_time=0.5 * i)
            procs[kind].add_request(parent)
            parent.children[0].status = RequestStatus.RUNNING
            reqs[kind].append(parent.children[0])
    assert all(s.counts_only for _, s in procs[FINAL]._sequences.values())
    assert not any(s.counts_only for _, s in procs[kinds[1]]._sequences.values())
    finals = {kind: {} for kind in kinds}
    for step in range(60):
        now = 10.0 + step
        plan = [(i, rnd.choice([0, 1, 1, 1, 2, 3])) for i, r in enumerate(reqs[FINAL]) if not r.is_finished]
        if not plan:
            break
        stats = {}
        for kind in kinds:
            updated = []
            for i, n in plan:
                r = reqs[kind][i]
                n = min(n, r.sampling_params.max_tokens - r.num_output_tokens)
                r.output_token_ids.extend(random.Random(f"{seed}-{i}-{step}-{j}").randrange(100) for j in range(n))
                if r.first_token_time is None and r.output_token_ids:
                    r.first_token_time = now
                if r.num_output_tokens == r.sampling_params.max_tokens:
                    r.status, r.finished_time = RequestStatus.FINISHED_LENGTH_CAPPED, now
                updated.append(r)
            result = procs[kind].process(updated, now=now)
            for out in result.outputs:
                if out.finished:
                    finals[kind][out.request_id] = [(c.token_ids, c.finish_reason) for c in out.outputs]
            s = result.stats
            stats[kind] = (s.num_prompt_tokens, s.num_generation_tokens, s.time_to_first_tokens_iter,
                           s.inter_token_latencies_iter, s.finished_requests)
        assert stats[FINAL] == stats[kinds[1]], f"step {step}"
    assert finals[FINAL] == finals[kinds[1]] and len(finals[FINAL]) == 12
