"""Pooling models (runner="pooling", convert="embed") against transformers' hidden states.

The reference is ``AutoModel`` (the bare Llama model, its final norm applied) on the embedded
model in data/, pooled (LAST / MEAN / CLS / ALL) and L2-normalized by hand.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers

from workbench import LLM, LLMEngine, SamplingParams
from workbench.model.loader import default_model_path
from workbench.pooling_params import PoolingParams

TEXTS = [
    "ROMEO: But soft, what light through yonder window breaks? It is the east.",
    "JULIET:",
    "HAMLET: To be, or not to be, that is the question: whether 'tis nobler in the mind",
    "ROMEO: But soft, what light through yonder window breaks? It is the east, and Juliet",
    "KING:",
]


@pytest.fixture(scope="module")
def hf():
    path = default_model_path()
    model = transformers.AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    return model, tokenizer


def reference(hf, text: str, pooling_type: str, normalize: bool = True) -> torch.Tensor:
    model, tokenizer = hf
    ids = tokenizer(text, return_tensors="pt").input_ids
    with torch.no_grad():
        states = model(ids).last_hidden_state[0]
    pooled = {"LAST": states[-1], "MEAN": states.mean(0), "CLS": states[0], "ALL": states}[pooling_type]
    return F.normalize(pooled, dim=-1) if normalize else pooled


def embed_llm(**kw) -> LLM:
    kw = {"block_size": 4, "num_kv_blocks": 128, "max_num_seqs": 8, **kw}
    return LLM(runner="pooling", convert="embed", dtype="float32", device="cpu", **kw)


@pytest.fixture(scope="module")
def embedder() -> LLM:
    """An embedding LLM with the defaults (LAST, normalized), shared by the tests that only read."""
    return embed_llm()


def test_last_pooling_under_chunked_prefill_and_prefix_hits_matches_transformers(hf):
    llm = embed_llm(max_num_batched_tokens=16)  # prompts of 3..22 tokens: chunked
    cfg = llm.engine.config
    assert (cfg.pooler_config.pooling_type, cfg.enable_chunked_prefill, cfg.enable_prefix_caching) == (
        "LAST", True, True)
    first = llm.embed(TEXTS, use_tqdm=False)
    again = llm.embed(TEXTS, use_tqdm=False)  # the same prompts: served from the prefix cache
    chunked = [r for r in llm.engine.history if r.scheduler_output.scheduled
               and any(not c.samples for c in r.scheduler_output.scheduled)]
    assert chunked, "no prompt was split over steps"
    assert sum(o.num_cached_tokens for o in again) > 0 and first[3].num_cached_tokens > 0  # text 0's prefix
    for text, a, b in zip(TEXTS, first, again):
        ref = reference(hf, text, "LAST")
        assert torch.allclose(torch.tensor(a.outputs.embedding), ref, atol=1e-5)
        assert torch.allclose(torch.tensor(b.outputs.embedding), ref, atol=1e-5)
    assert llm.engine.kv_cache.num_free_blocks == llm.engine.kv_cache.num_blocks


@pytest.mark.parametrize("pooling_type", ["MEAN", "CLS"])
def test_mean_and_cls_pooling_match_transformers_without_chunking_as_vllm(hf, pooling_type):
    llm = embed_llm(pooler_config={"pooling_type": pooling_type})
    cfg = llm.engine.config  # vLLM: only LAST pooling keeps chunked prefill and prefix caching
    assert not cfg.enable_chunked_prefill and not cfg.enable_prefix_caching
    for text, out in zip(TEXTS, llm.embed(TEXTS, use_tqdm=False)):
        assert torch.allclose(torch.tensor(out.outputs.embedding), reference(hf, text, pooling_type),
                              atol=1e-5)


def test_token_embed_on_a_last_engine_pools_every_position_over_chunks(hf):
    llm = embed_llm(max_num_batched_tokens=8)
    llm.embed(TEXTS[:1], use_tqdm=False)  # caches text 0's blocks; token_embed must not read them
    outs = llm.encode(TEXTS, pooling_task="token_embed", use_tqdm=False)
    for text, out in zip(TEXTS, outs):
        assert out.num_cached_tokens == 0
        ref = reference(hf, text, "ALL")
        assert out.outputs.data.shape == ref.shape
        assert torch.allclose(out.outputs.data, ref, atol=1e-5)


def test_normalize_false_and_truncation(hf, embedder):
    llm = embedder
    (raw,) = llm.embed(TEXTS[2], pooling_params=PoolingParams(normalize=False), use_tqdm=False)
    assert torch.allclose(torch.tensor(raw.outputs.embedding), reference(hf, TEXTS[2], "LAST", False),
                          atol=1e-5)
    (cut,) = llm.embed(TEXTS[2], truncate_prompt_tokens=5, use_tqdm=False)
    full = hf[1](TEXTS[2]).input_ids
    assert cut.prompt_token_ids == full[-5:]


def test_a_pooling_request_is_prefill_only_and_frees_its_blocks_at_once():
    engine = LLMEngine(model=None, device="cpu", block_size=4, num_kv_blocks=64,
                       max_num_batched_tokens=8, runner="pooling")
    ids = engine.tokenizer(TEXTS[2]).input_ids  # 22 tokens: 3 steps of 8
    engine.add_request("e", TEXTS[2], PoolingParams())
    steps = []
    while engine.has_unfinished_requests():
        steps.append(engine.step())
    assert len(steps) == -(-len(ids) // 8)
    assert [o.request_id for o in steps[-1]] == ["e"] and not any(steps[:-1])
    last = engine.history[-1]
    assert last.finished_request_ids == ("e",) and last.sampled_token_ids == {}
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks
    # its full blocks stay cached for the next request with the same prefix
    engine.add_request("e2", TEXTS[2], PoolingParams())
    while engine.has_unfinished_requests():
        (out,) = engine.step() or (None,)
    assert out.num_cached_tokens == (len(ids) - 1) // 4 * 4


def test_an_embedding_beside_generation_changes_no_greedy_token(hf):
    def run(with_embedding: bool):
        engine = LLMEngine(dtype="float32", device="cpu", block_size=4, num_kv_blocks=128,
                           max_num_batched_tokens=16)
        params = SamplingParams(temperature=0, max_tokens=12)
        for i, text in enumerate(TEXTS[:3]):
            engine.add_request(f"g{i}", text, params)
        if with_embedding:
            engine.add_request("emb", TEXTS[3], PoolingParams())
        outs = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    outs[out.request_id] = out
        return outs

    alone, mixed = run(False), run(True)
    for i in range(3):
        assert mixed[f"g{i}"].outputs[0].token_ids == alone[f"g{i}"].outputs[0].token_ids
    assert torch.allclose(mixed["emb"].outputs.data, reference(hf, TEXTS[3], "LAST"), atol=1e-5)


def test_matryoshka_dimensions_truncate_then_normalize(hf, tmp_path, embedder):
    # the embedded model, declared matryoshka (config.json's is_matryoshka, as vLLM reads it)
    import json

    src = default_model_path()
    for f in src.iterdir():
        if f.is_file():
            (tmp_path / f.name).symlink_to(f)
    config = json.loads((src / "config.json").read_text())
    (tmp_path / "config.json").unlink()
    (tmp_path / "config.json").write_text(json.dumps({**config, "is_matryoshka": True}))
    llm = embed_llm(model=str(tmp_path))
    (out,) = llm.embed(TEXTS[0], pooling_params=PoolingParams(dimensions=16), use_tqdm=False)
    states = reference(hf, TEXTS[0], "LAST", normalize=False)
    assert torch.allclose(torch.tensor(out.outputs.embedding), F.normalize(states[:16], dim=-1),
                          atol=1e-5)
    with pytest.raises(ValueError, match="Dimensions must be greater than 0"):
        llm.embed(TEXTS[0], pooling_params=PoolingParams(dimensions=0), use_tqdm=False)
    with pytest.raises(ValueError, match="does not support matryoshka"):
        embedder.embed(TEXTS[0], pooling_params=PoolingParams(dimensions=16), use_tqdm=False)


def test_generation_and_embedding_refuse_the_other_kind_of_model(embedder):
    with pytest.raises(ValueError, match=r"LLM.generate\(\) is only supported for generative models"):
        embedder.generate("ROMEO:", SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="Embedding API is not supported by this model"):
        LLM(device="cpu", num_kv_blocks=16).embed("ROMEO:")
    with pytest.raises(ValueError, match="pooling_task is required"):
        embedder.encode("ROMEO:")
