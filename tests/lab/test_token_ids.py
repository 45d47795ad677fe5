"""TokenIds and the generators' fast paths: numpy and Python ids make equal workloads, bad ids
still raise, prompts are the corpus' own ids kept as plain tuples, equal output lengths share
one SamplingParams."""

import copy
import dataclasses
import gc
import pickle

import numpy as np
import pytest
from transformers import AutoTokenizer

from workbench import SamplingParams, Workload, WorkloadRequest
from workbench.lab.corpus_prompts import PromptCutter
from workbench.lab.sim.simulate import lean_requests
from workbench.lab.token_ids import TokenIds
from workbench.engine.input_processor import InputProcessor
from workbench.lab.workload import exact_length_params
from workbench.model.loader import default_model_path
from workbench.sampling_params import RequestOutputKind


@pytest.mark.parametrize("ids", [
    [3, 4, 5],
    (3, 4, 5),
    [np.int64(3), np.int32(4), np.uint8(5)],
    np.array([3, 4, 5], dtype=np.int64),
    np.array([3, 4, 5], dtype=np.uint16),
])
def test_numpy_and_python_ids_are_the_same_python_ints(ids):
    tid = TokenIds(ids)
    assert tid == (3, 4, 5) and hash(tid) == hash((3, 4, 5)) and repr(tid) == "(3, 4, 5)"
    assert [type(t) for t in tid] == [int, int, int]
    request = WorkloadRequest("a", ids, SamplingParams())
    assert request == WorkloadRequest("a", [3, 4, 5], SamplingParams()) and type(request.prompt) is tuple


@pytest.mark.parametrize("ids, shown", [
    ([1, "x"], "'x'"),
    ([1, True], "True"),
    ([1, 2.0], "2.0"),
    ([1, None], "None"),
    (np.array([1.0, 2.0]), "1-D array of float64"),
    (np.array([True, False]), "1-D array of bool"),
    (np.array([[1, 2]]), "2-D array of int64"),
])
def test_bad_ids_raise_naming_the_request_and_the_value(ids, shown):
    with pytest.raises(ValueError, match=r"token ids must be integers, got .*" + shown.replace("(", r"\(")):
        TokenIds(ids)
    with pytest.raises(ValueError, match="request 'a': prompt token ids must be integers, got"):
        WorkloadRequest("a", ids, SamplingParams())


def test_slices_and_sums_of_token_ids_stay_token_ids_and_the_rest_acts_as_a_tuple():
    tid = TokenIds(range(10))
    assert type(tid[2:5]) is TokenIds and tid[2:5] == (2, 3, 4)
    assert type(tid[3]) is int and tid[-1] == 9
    assert type(tid[:2] + tid[8:]) is TokenIds and tid[:2] + tid[8:] == (0, 1, 8, 9)
    assert type(tid + (10,)) is tuple and tid + (10,) == tuple(range(11))
    assert type((10,) + tid) is tuple
    with pytest.raises(TypeError):
        tid + [10]  # as a tuple: no list concatenation
    for back in (pickle.loads(pickle.dumps(tid)), copy.copy(tid), copy.deepcopy(tid)):
        assert type(back) is TokenIds and back == tid


def test_token_id_prompts_are_slices_of_the_corpus_after_bos():
    """The independent reference: the corpus re-encoded by the engine's own tokenizer."""
    tok = AutoTokenizer.from_pretrained(str(default_model_path()))
    cutter = PromptCutter(None, np.random.default_rng(0), text=False)
    corpus = tok(cutter.corpus, add_special_tokens=False).input_ids
    w = Workload.poisson(40, input_len=(16, 300), seed=4, text=False)
    corpus_ints = {id(t) for t in cutter.ids}
    for r in w:
        assert type(r.prompt) is tuple and r.prompt[0] == tok.bos_token_id
        body = list(r.prompt[1:])
        found = [i for i, t in enumerate(corpus) if t == body[0] and corpus[i : i + len(body)] == body]
        assert set(found) & set(cutter.line_starts)
        # The corpus' own int objects, not copies.
        assert all(id(t) in corpus_ints for t in body)
    # Plain tuples of ints: the collector stops tracking them (a tuple subclass it never would).
    gc.collect()
    assert not any(gc.is_tracked(r.prompt) for r in w)


def test_the_engine_takes_token_ids_as_a_list_and_checks_them_against_the_model():
    tok = AutoTokenizer.from_pretrained(str(default_model_path()))
    ip = InputProcessor(tok, max_model_len=64, vocab_size=4096)
    params = SamplingParams(max_tokens=4)
    ids = [0, 5, 4000, 17]
    made = ip.process_inputs("a", TokenIds(ids), params)
    assert made.prompt_token_ids == ids and type(made.prompt_token_ids) is list
    assert made == ip.process_inputs("a", ids, params)
    with pytest.raises(ValueError, match="Token id 4096 is out of vocabulary"):
        ip.process_inputs("a", TokenIds([1, 4096]), params)
    with pytest.raises(ValueError, match=r"prompt_token_ids must be integers in \[0, 4096\)"):
        ip.process_inputs("a", TokenIds([1, -1]), params)
    with pytest.raises(ValueError, match="The decoder prompt cannot be empty"):
        ip.process_inputs("a", TokenIds(), params)


def test_equal_output_lengths_share_one_checked_params():
    template = SamplingParams(temperature=0.5, min_tokens=2)
    params = exact_length_params(template, [4, 7, 4, 9, 7])
    assert [p.max_tokens for p in params] == [4, 7, 4, 9, 7]
    assert params[0] is params[2] and params[1] is params[4] and params[0] is not params[1]
    for p, n in zip(params, [4, 7, 4, 9, 7]):
        assert p == dataclasses.replace(template, max_tokens=n, ignore_eos=True)
    assert template.max_tokens == 16 and not template.ignore_eos
    # The first length (in request order) that the template refuses raises the constructor's error.
    with pytest.raises(ValueError, match="min_tokens must be <= max_tokens=3, got 5"):
        exact_length_params(SamplingParams(min_tokens=5), [9, 3, 2])
    w = Workload.poisson(50, output_len=(4, 6), seed=2, text=False)
    assert len({id(r.params) for r in w}) == len({r.params.max_tokens for r in w}) == 3


def test_lean_requests_share_the_lean_copy_of_shared_params():
    w = Workload.poisson(30, output_len=(4, 6), seed=2, text=False)
    stop = WorkloadRequest("s", (1, 5, 6), SamplingParams(stop=["\n"]))
    lean = lean_requests([*w, stop])
    assert lean[-1] is stop  # stop strings need text: left as it is
    for r, copy_ in zip(w, lean):
        assert copy_.request_id == r.request_id and copy_.prompt is r.prompt
        assert not copy_.params.detokenize and copy_.params.output_kind is RequestOutputKind.FINAL_ONLY
        assert r.params.detokenize and r.params.output_kind is RequestOutputKind.CUMULATIVE
        assert dataclasses.replace(copy_.params, detokenize=True, output_kind=RequestOutputKind.CUMULATIVE) == r.params
    assert len({id(r.params) for r in lean[:-1]}) == len({id(r.params) for r in w}) == 3
