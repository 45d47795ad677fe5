"""Speculative decoding through the engine: config errors at start-up, the records and
metrics of drafts, logprobs of emitted tokens, stop strings inside an accepted run, the draft
model (its logits are transformers' for its checkpoint; greedy outputs equal no speculation).
"""

from pathlib import Path

import pytest
import torch
import transformers
from prometheus_client import generate_latest

from workbench import LLMEngine, SamplingParams
from workbench.benchmarks.checks import generate
from workbench.metrics.spec_stats import spec_decode_summary
from workbench.metrics.prometheus import PrometheusStatLogger
from workbench.model.loader import resolve_model_path

DRAFT = Path(__file__).resolve().parents[2] / "data" / "tiny-shakespeare-draft"
QUOTE = ("ROMEO:\nBut soft, what light through yonder window breaks? It is the east.\n\n"
         "JULIET:\nBut soft, what light through")
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


def make(**kw):
    return LLMEngine(dtype="float32", device="cpu", block_size=4, num_kv_blocks=64, **kw)


@pytest.fixture(scope="module")
def plain():
    return make()


def run(engine, prompts, params):
    ids = [engine.tokenizer(p).input_ids for p in prompts]
    return generate(engine, ids, params)


def test_the_embedded_draft_is_found_by_name():
    assert resolve_model_path("tiny-shakespeare-draft").name == "tiny-shakespeare-draft"


@pytest.mark.parametrize("spec, message", [
    ({"method": "draft_model", "model": "/no/such/draft"}, "speculative_config.model: the draft model '/no/such/draft' cannot be loaded"),
    ({"method": "draft_model", "model": "tiny-random-vocab"}, "the draft's vocabulary has 96 tokens but the target's has 4096"),
])
def test_bad_draft_models_fail_at_start_up(spec, message, tmp_path):
    if spec["model"] == "tiny-random-vocab":
        config = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64,
                                          num_hidden_layers=1, num_attention_heads=2,
                                          max_position_embeddings=1024)
        transformers.LlamaForCausalLM(config).save_pretrained(tmp_path)
        for f in ("tokenizer.json", "tokenizer_config.json"):
            (tmp_path / f).write_bytes((DRAFT / f).read_bytes())
        spec = {**spec, "model": str(tmp_path)}
    with pytest.raises(ValueError, match=message):
        make(speculative_config=spec)


def test_records_and_metrics_count_every_draft(plain):
    engine = make(speculative_config=NGRAM)
    prom = PrometheusStatLogger("tiny")
    engine.add_logger("prom", prom)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    want = run(plain, [QUOTE, "LEAR:"], params)
    got = run(engine, [QUOTE, "LEAR:"], params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    results = [(rec, rid, r) for rec in engine.history for rid, r in rec.spec_decode.items()]
    assert results, "no drafts were verified"
    for rec, rid, r in results:  # the records hold what the scheduler scheduled
        assert rec.scheduler_output.scheduled_spec_decode_tokens[rid] == r.draft_token_ids
        assert 0 <= r.num_accepted <= r.num_draft_tokens <= 3
    summary = spec_decode_summary(engine.history)
    assert 0 < summary["spec_num_accepted_tokens"] < summary["spec_num_draft_tokens"]
    # fewer steps than tokens: accepted drafts are tokens for free
    assert len(engine.history) < len(plain.history)
    text = generate_latest(prom.registry).decode()

    def value(series, **labels):
        lab = ",".join(f'{k}="{v}"' for k, v in {"model_name": "tiny", **labels}.items())
        return float(text.split(f"{series}{{{lab}}} ")[1].split("\n")[0])

    assert value("vllm:spec_decode_num_drafts_total") == summary["spec_num_drafts"]
    assert value("vllm:spec_decode_num_draft_tokens_total") == summary["spec_num_draft_tokens"]
    assert value("vllm:spec_decode_num_accepted_tokens_total") == summary["spec_num_accepted_tokens"]
    per_pos = [sum(1 for _, _, r in results if r.num_accepted > j) for j in range(3)]
    assert [value("vllm:spec_decode_num_accepted_tokens_per_pos_total", position=j)
            for j in range(3)] == per_pos
    stats = [rec.scheduler_stats.spec_decoding_stats for rec in engine.history]
    assert sum(s.num_accepted_tokens for s in stats if s) == summary["spec_num_accepted_tokens"]
    line = logging_line(stats)
    mean = 1 + summary["spec_num_accepted_tokens"] / summary["spec_num_drafts"]
    assert f"Mean acceptance length: {mean:.2f}," in line
    assert f"Accepted: {summary['spec_num_accepted_tokens']} tokens, Drafted: {summary['spec_num_draft_tokens']} tokens" in line
    assert "Per-position acceptance rate: " + ", ".join(
        f"{n / summary['spec_num_drafts']:.3f}" for n in per_pos) in line


def logging_line(stats) -> str:
    from workbench.metrics.stats import IterationStats, LoggingStatLogger, SchedulerStats

    log = LoggingStatLogger()
    for s in stats:
        log.record(SchedulerStats(spec_decoding_stats=s), IterationStats())
    log.log()
    return log.last_spec_line


def emitted_per_step(engine, rid="r0") -> list[int]:
    """How many tokens each step of ``engine`` gave ``rid``: its accepted drafts plus one."""
    return [1 + (rec.spec_decode[rid].num_accepted if rid in rec.spec_decode else 0)
            for rec in engine.history if rid in rec.sampled_token_ids]


def test_logprobs_and_stop_strings_inside_accepted_runs(plain):
    """A stop string completed by an accepted draft, with more accepted tokens after it in
    the same step, ends the output there, as without speculation: the same tokens, text,
    logprobs (those of the emitted tokens)."""
    spec = {**NGRAM, "num_speculative_tokens": 5}
    free_run = make(speculative_config=spec)
    ids = run(free_run, [QUOTE], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0].token_ids
    # the first token of the first step that emitted 3 tokens or more: 2 or more come after it
    counts = emitted_per_step(free_run)
    first = next(i for i, n in enumerate(counts) if n >= 3)
    p = sum(counts[:first])
    text = [free_run.tokenizer.decode(ids[:k], skip_special_tokens=True) for k in (p, p + 1)]
    # the shortest end of the text up to token p that is not in the text before it
    stop = next(text[1][-n:] for n in range(1, len(text[1]) + 1) if text[1][-n:] not in text[0])
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop], logprobs=2)
    want = run(plain, [QUOTE], params)[0]
    engine = make(speculative_config=spec)
    got = run(engine, [QUOTE], params)[0]
    assert (got.token_ids, got.text, got.finish_reason, got.stop_reason) == (
        want.token_ids, want.text, "stop", stop)
    assert len(got.token_ids) == p + 1
    assert sum(emitted_per_step(engine)) >= len(got.token_ids) + 2  # the step went past the stop
    assert len(got.logprobs) == len(got.token_ids)
    for a, b in zip(got.logprobs, want.logprobs):
        assert list(a) == list(b)
        assert [x.logprob for x in a.values()] == pytest.approx([x.logprob for x in b.values()], abs=1e-4)


def test_sampled_requests_speculate_and_seeds_repeat():
    engine = make(speculative_config=NGRAM)
    params = SamplingParams(temperature=0.7, seed=5, max_tokens=24, ignore_eos=True)
    a = run(engine, [QUOTE], params)[0]
    b = run(engine, [QUOTE], params)[0]
    assert a.token_ids == b.token_ids and len(a.token_ids) == 24
    assert spec_decode_summary(engine.history)["spec_num_accepted_tokens"] > 0


def test_draft_model_logits_equal_transformers():
    engine = make(speculative_config={"method": "draft_model", "model": str(DRAFT), "num_speculative_tokens": 2})
    proposer = engine.proposer
    hf = transformers.AutoModelForCausalLM.from_pretrained(DRAFT, dtype=torch.float32).eval()
    ids = engine.tokenizer(QUOTE).input_ids
    with torch.inference_mode():
        want = hf(torch.tensor([ids])).logits[0]
        runner = proposer.runner
        from workbench.model.attention import AttentionMetadata

        n = len(ids)
        blocks = -(-n // 4)
        attn = AttentionMetadata(
            slot_mapping=torch.arange(n), block_tables=torch.arange(blocks, dtype=torch.int32)[None],
            query_start_loc=torch.tensor([0, n], dtype=torch.int32),
            seq_lens=torch.tensor([n], dtype=torch.int32), backend=runner.attention_backend)
        hidden = runner.model(torch.tensor(ids), torch.arange(n), runner.kv_caches, attn)
        got = runner.model.compute_logits(hidden)
    torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("k", [1, 4])
def test_draft_model_greedy_outputs_equal_no_speculation(plain, k):
    engine = LLMEngine(dtype="float32", device="cpu", block_size=4, num_kv_blocks=40,
                       max_num_batched_tokens=24, max_num_seqs=4,
                       speculative_config={"method": "draft_model", "model": str(DRAFT),
                                           "num_speculative_tokens": k})
    prompts = [QUOTE, "HAMLET:\nTo be, or not to be,", QUOTE[:50], "LEAR:"]
    params = SamplingParams(temperature=0, max_tokens=20)
    assert [o.token_ids for o in run(engine, prompts, params)] == [
        o.token_ids for o in run(plain, prompts, params)]
    summary = spec_decode_summary(engine.history)
    assert summary["spec_num_accepted_tokens"] > 0
    assert engine.proposer.kv_cache.num_free_blocks == engine.proposer.kv_cache.num_blocks  # freed
