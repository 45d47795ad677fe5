"""Greedy parity: the engine's tokens equal transformers' ``generate`` for each prompt alone.

The engine runs every prompt in one batch with a tight KV pool and token budget, so the run
exercises chunked prefill, preemption by recompute and prefix-cache hits (asserted from the
step history); the reference runs each prompt alone, fp32 on CPU.
"""

import pytest
import torch
import transformers

from workbench import LLMEngine, SamplingParams, default_model_path
from workbench.benchmarks.checks import copy_tokenizer, generate, greedy_mismatches, hf_greedy

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


@pytest.mark.parametrize("gemm", ["torch", "onednn", "numba"])  # the CPU linear paths (kernels/cpu_linear.py)
def test_embedded_model_matches_transformers_with_eos(tiny, gemm, monkeypatch):
    monkeypatch.setenv("WORKBENCH_CPU_GEMM", gemm)
    path, model, prompts = tiny
    engine = tight_engine(path)
    outs = generate(engine, prompts, SamplingParams(temperature=0, max_tokens=24))
    for ids, out in zip(prompts, outs):
        expected, _ = hf_greedy(model, ids, 24, stop_at_eos=True)
        assert out.token_ids == expected
        assert out.finish_reason == ("stop" if len(expected) < 24 else "length")
    assert_history_exercised(engine)


def make_random_checkpoint(tmp_path_factory, name, config):
    path = tmp_path_factory.mktemp(name)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(path)
    copy_tokenizer(path)
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
    outs = generate(engine, prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    parity = greedy_mismatches([o.token_ids for o in outs], model, prompts, 12)
    assert parity.identical == len(prompts), parity.mismatches
    assert_history_exercised(engine)
