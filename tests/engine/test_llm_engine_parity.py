"""Greedy parity: the engine's tokens equal transformers' ``generate`` for each prompt alone.

The engine runs every prompt in one batch with a tight KV pool and token budget, so the run
exercises chunked prefill, preemption by recompute and prefix-cache hits (asserted from the
step history); the reference runs each prompt alone, fp32 on CPU.
"""

import shutil

import pytest
import torch
import transformers

from workbench import LLMEngine, SamplingParams, default_model_path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")

PROMPTS = [
    "ROMEO:",
    "JULIET:\nO Romeo, Romeo! wherefore art thou Romeo?",
    "KING HENRY:\nOnce more unto the breach, dear friends, once more;",
    "KING HENRY:\nOnce more unto the breach, dear friends, once more; or close the wall",
    "HAMLET:\nTo be, or not to be, that is the question:",
    "HAMLET:\nTo be, or not to be, that is the question: whether 'tis nobler in the mind",
    "PORTIA:\nThe quality of mercy is not strain'd,",
    "LEAR:",
    "MACBETH:\nTomorrow, and tomorrow, and tomorrow, creeps in this petty pace",
    "OTHELLO:\nIt is the cause, it is the cause, my soul.",
    "PUCK:\nIf we shadows have offended, think but this, and all is mended,",
    "First Citizen:\nBefore we proceed any further, hear me speak.",
    "All:\nSpeak, speak.",
]


def hf_greedy(model, prompt_ids, max_new_tokens, stop_at_eos):
    config = transformers.GenerationConfig(
        do_sample=False,
        max_new_tokens=max_new_tokens,
        eos_token_id=model.generation_config.eos_token_id if stop_at_eos else None,
        pad_token_id=model.generation_config.pad_token_id,
    )
    ids = torch.tensor([prompt_ids])
    with torch.inference_mode():  # an explicit mask: never let generate guess padding
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
    return out[0, len(prompt_ids):].tolist()


def run_engine(engine, prompt_ids, params):
    for i, ids in enumerate(prompt_ids):
        engine.add_request(f"r{i}", {"prompt_token_ids": ids}, params)
    results = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            results[out.request_id] = out
        engine.scheduler.check_invariants()
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks, "blocks leaked"
    return [results[f"r{i}"].outputs[0] for i in range(len(prompt_ids))]


def assert_history_exercised(engine):
    rows = engine.history.to_dataframe()
    chunked = any(  # a prefill chunk that stops short of the prompt's end
        s.is_prefill and not s.samples for r in engine.history for s in r.scheduler_output.scheduled
    )
    assert chunked, "no chunked prefill happened"
    assert rows["preempted"].sum() > 0, "no preemption happened"
    assert rows["prefix_hit_tokens"].sum() > 0, "no prefix-cache hit happened"


def tight_engine(path, **kw):
    return LLMEngine(
        model=str(path), dtype="float32", device="cpu", block_size=4, num_kv_blocks=40,
        max_num_seqs=6, max_num_batched_tokens=24, enable_prefix_caching=True,
        enable_chunked_prefill=True, **kw,
    )


@pytest.fixture(scope="module")
def tiny():
    path = default_model_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    prompts = [tokenizer(p).input_ids for p in PROMPTS]
    return path, model, prompts


def test_embedded_model_matches_transformers_with_eos(tiny):
    path, model, prompts = tiny
    engine = tight_engine(path)
    outs = run_engine(engine, prompts, SamplingParams(temperature=0, max_tokens=24))
    for ids, out in zip(prompts, outs):
        expected = hf_greedy(model, ids, 24, stop_at_eos=True)
        assert out.token_ids == expected
        assert out.finish_reason == ("stop" if len(expected) < 24 else "length")
    assert_history_exercised(engine)


def make_random_checkpoint(tmp_path_factory, name, config):
    path = tmp_path_factory.mktemp(name)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(path)
    for f in TOKENIZER_FILES:
        src = default_model_path() / f
        if src.exists():
            shutil.copy(src, path / f)
    return path, model.eval()


def small_config(kind, vocab_size):
    common = dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        initializer_range=0.2, bos_token_id=1, eos_token_id=2,
    )
    if kind == "llama":
        return transformers.LlamaConfig(**common, tie_word_embeddings=False)
    if kind == "qwen2":
        return transformers.Qwen2Config(**common, tie_word_embeddings=True)
    return transformers.Qwen3Config(**common, head_dim=32, tie_word_embeddings=False)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_random_weight_architectures_match_transformers(kind, tmp_path_factory, tiny):
    _, tiny_model, prompts = tiny
    vocab = tiny_model.config.vocab_size
    path, model = make_random_checkpoint(tmp_path_factory, kind, small_config(kind, vocab))
    engine = tight_engine(path)
    outs = run_engine(engine, prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    for ids, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(model, ids, 12, stop_at_eos=False)
    assert_history_exercised(engine)
