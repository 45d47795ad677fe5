"""Multi-LoRA against transformers + PEFT running the same adapters (fp32, CPU).

For each adapter shipped in data/loras/: the logits of a packed forward mixing both adapters
and the base model equal PEFT's (each sequence alone, its adapter set) within 1e-4; the
engine's greedy tokens equal PEFT's ``generate`` for every prompt, in one batch mixing the
adapters and the base model under a pool tight enough for chunked prefill and preemption;
and a PEFT-merged checkpoint (``merge_and_unload``) loaded as a plain model gives the same
tokens as the engine serving the unmerged adapter.
"""

from __future__ import annotations

import pytest
import torch
from lora_support import base_model

from workbench import LLMEngine, LoRARequest, SamplingParams
from workbench.benchmarks.checks import copy_tokenizer, hf_greedy
from workbench.model.attention import AttentionMetadata
from workbench.model.loader import EMBEDDED_LORAS, embedded_lora_path

PROMPTS = [
    "DROMIO OF SYRACUSE:\nMaster,",
    "ANTIPHOLUS OF EPHESUS:",
    "TIMON:\nI will",
    "APEMANTUS:\nThou art",
    "ROMEO:",
    "HAMLET:\nTo be, or not to be, that is the question:",
    "ADRIANA:\nAy, ay, Antipholus, look strange and frown:",
]
LORAS = {name: LoRARequest(name, i + 1, str(embedded_lora_path(name)))
         for i, name in enumerate(EMBEDDED_LORAS)}
#: Prompt i runs under ADAPTERS[i % 3]: both adapters and the base model in every batch.
ADAPTERS = [*EMBEDDED_LORAS, None]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def peft():
    from peft import PeftModel

    model = PeftModel.from_pretrained(base_model(), LORAS[EMBEDDED_LORAS[0]].lora_path,
                                      adapter_name=EMBEDDED_LORAS[0])
    for name in EMBEDDED_LORAS[1:]:
        model.load_adapter(LORAS[name].lora_path, adapter_name=name)
    return model.eval()


def peft_run(model, name, fn):
    """``fn(model)`` with adapter ``name`` active (None: the base model)."""
    if name is None:
        with model.disable_adapter():
            return fn(model)
    model.set_adapter(name)
    return fn(model)


@pytest.fixture(scope="module")
def prompts():
    engine_tok = LLMEngine(device="cpu", dtype="float32", num_kv_blocks=8).tokenizer
    return [engine_tok(p).input_ids for p in PROMPTS]


def lora_engine(**kw):
    kw = {**dict(dtype="float32", device="cpu", block_size=4, num_kv_blocks=24, max_num_seqs=6,
                 max_num_batched_tokens=24, enable_lora=True, max_loras=2), **kw}
    return LLMEngine(**kw)


def run(engine, prompts, adapters):
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for i, (ids, name) in enumerate(zip(prompts, adapters)):
        engine.add_request(f"r{i}", {"prompt_token_ids": ids}, params,
                           lora_request=None if name is None else LORAS[name])
    results = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            results[out.request_id] = out
        engine.scheduler.check_invariants()
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks, "blocks leaked"
    return [results[f"r{i}"].outputs[0].token_ids for i in range(len(prompts))]


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_mixed_forward_logits_match_peft(peft, prompts, backend):
    """One packed forward: sequence i under ADAPTERS[i % 3]; its logits at every position
    against PEFT's for that sequence alone; and each adapter changes the logits."""
    engine = lora_engine(attention_backend=backend, num_kv_blocks=64)
    for lora in LORAS.values():
        engine.add_lora(lora)
    runner = engine.runner
    seqs = prompts[:6]
    adapters = [ADAPTERS[i % 3] for i in range(len(seqs))]
    bs, per = 4, 64 // len(seqs)
    ids, pos, slots, starts, tables = [], [], [], [0], []
    for s, seq in enumerate(seqs):
        table = list(range(s * per, (s + 1) * per))
        ids += seq
        pos += range(len(seq))
        slots += [table[p // bs] * bs + p % bs for p in range(len(seq))]
        starts.append(starts[-1] + len(seq))
        tables.append(table)
    runner.lora_manager.set_active_adapters([None if a is None else LORAS[a] for a in adapters],
                                            [len(s) for s in seqs], runner.device)
    attn = AttentionMetadata(
        slot_mapping=torch.tensor(slots), block_tables=torch.tensor(tables, dtype=torch.int32),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor([len(s) for s in seqs], dtype=torch.int32), backend=backend)
    with torch.inference_mode():
        logits = runner.model.compute_logits(
            runner.model(torch.tensor(ids), torch.tensor(pos), runner.kv_caches, attn))
    for s, (seq, name) in enumerate(zip(seqs, adapters)):
        with torch.no_grad():
            expected = peft_run(peft, name, lambda m: m(torch.tensor([seq])).logits[0].float())
            base = peft_run(peft, None, lambda m: m(torch.tensor([seq])).logits[0].float())
        got = logits[starts[s]:starts[s + 1]]
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
        if name is not None:
            assert (expected - base).abs().max() > 0.1, f"adapter {name} barely changes the logits"


@pytest.fixture(scope="module")
def mixed(prompts):
    """Every prompt in one engine, prompt i under ADAPTERS[i % 3]: (adapters, tokens, engine)."""
    adapters = [ADAPTERS[i % 3] for i in range(len(prompts))]
    engine = lora_engine()
    return adapters, run(engine, prompts, adapters), engine


def test_greedy_tokens_match_peft_in_mixed_batches_with_chunking_and_preemption(peft, prompts, mixed):
    adapters, ours, engine = mixed
    differs = 0
    for ids, name, mine in zip(prompts, adapters, ours):
        theirs, _ = peft_run(peft, name, lambda m: hf_greedy(m, ids, MAX_TOKENS, stop_at_eos=False))
        assert mine == theirs, f"adapter {name}, prompt {ids}"
        if name is not None:
            base, _ = peft_run(peft, None, lambda m: hf_greedy(m, ids, MAX_TOKENS, stop_at_eos=False))
            differs += base != theirs
    assert differs >= 2, "the adapters should change some greedy continuations"
    steps = list(engine.history)
    assert any(s.is_prefill and not s.samples for r in steps for s in r.scheduler_output.scheduled)
    assert any(r.scheduler_output.preempted_request_ids for r in steps), "no preemption happened"
    mixed_steps = [r for r in steps if len(r.scheduler_output.lora_names) == 2
                   and any(s.lora_name is None for s in r.scheduler_output.scheduled)]
    assert mixed_steps, "no step mixed both adapters and the base model"


def test_max_loras_one_gives_the_same_tokens_one_adapter_per_step(prompts, mixed):
    adapters, two, _ = mixed
    engine = lora_engine(max_loras=1, max_cpu_loras=1)  # evicts from host memory too
    assert run(engine, prompts, adapters) == two
    assert all(len(r.scheduler_output.lora_names) <= 1 for r in engine.history)
    assert any(r.scheduler_output.lora_skipped_request_ids for r in engine.history)


@pytest.mark.parametrize("name", EMBEDDED_LORAS)
def test_a_peft_merged_checkpoint_gives_the_adapters_tokens(tmp_path, prompts, mixed, name):
    from peft import PeftModel

    merged = PeftModel.from_pretrained(base_model(), LORAS[name].lora_path).merge_and_unload()
    merged.save_pretrained(tmp_path)
    copy_tokenizer(tmp_path)
    adapters, served, _ = mixed
    mine = [i for i, a in enumerate(adapters) if a == name]
    plain = run(LLMEngine(model=str(tmp_path), dtype="float32", device="cpu", block_size=4,
                          num_kv_blocks=24, max_num_batched_tokens=24),
                [prompts[i] for i in mine], [None] * len(mine))
    assert plain == [served[i] for i in mine]
