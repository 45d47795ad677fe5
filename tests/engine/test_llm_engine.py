"""LLMEngine and LLM behaviour on the embedded model: validation, aborts, history, n > 1, CLI."""

import logging

import pytest

from workbench import LLM, LLMEngine, SamplingParams
from workbench.entrypoints.cli import main as cli_main
from workbench.metrics.stats import LoggingStatLogger

GREEDY = SamplingParams(temperature=0, max_tokens=8)


@pytest.fixture(scope="module")
def llm():  # stat logging on: LLM() turns it off unless told (vLLM's rule)
    return LLM(device="cpu", block_size=8, num_kv_blocks=64, max_num_batched_tokens=64, log_stats=True)


def drain(engine):
    outs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs[out.request_id] = out
        engine.scheduler.check_invariants()
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks
    return outs


def test_generate_returns_readable_text_in_input_order(llm):
    prompts = ["ROMEO:", "JULIET:", {"prompt_token_ids": llm.get_tokenizer()("HAMLET:").input_ids}]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.prompt for o in outs] == ["ROMEO:", "JULIET:", None]
    alone = [llm.generate([p], GREEDY, use_tqdm=False)[0] for p in prompts]
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in alone]
    for out in outs:
        assert out.finished and out.outputs[0].finish_reason in ("stop", "length")
        assert out.outputs[0].text.strip()


def test_context_length_errors_use_vllm_wording_and_lose_nothing(llm):
    engine = llm.engine
    limit = engine.model_config.max_model_len
    engine.add_request("keep", "ROMEO:", SamplingParams(temperature=0, max_tokens=4))
    too_long = list(range(5, 5 + limit))  # vLLM V1: the prompt must leave room for one token
    with pytest.raises(ValueError, match=rf"The decoder prompt \(length {limit}\) plus the number of "
                                         rf"requested output tokens \(at least 1\) is longer than the "
                                         rf"maximum model length of {limit}\."):
        engine.add_request("long", {"prompt_token_ids": too_long}, GREEDY)
    with pytest.raises(ValueError, match=rf"The decoder prompt \(length {limit + 1}\) is longer than "
                                         rf"the maximum model length of {limit}\. Make sure that "
                                         r"`max_model_len` is no smaller than the number of text tokens\."):
        engine.add_request("long", {"prompt_token_ids": too_long + [5]}, GREEDY)
    with pytest.raises(ValueError, match="already in flight"):
        engine.add_request("keep", "JULIET:", GREEDY)
    outs = drain(engine)
    assert set(outs) == {"keep"} and len(outs["keep"].outputs[0].token_ids) <= 4


def test_bad_prompts_are_rejected_with_the_field_named(llm):
    vocab = llm.engine.model_config.vocab_size
    with pytest.raises(ValueError, match=f"Token id {vocab} is out of vocabulary"):  # vLLM's
        llm.generate([{"prompt_token_ids": [1, vocab]}], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match=rf"prompt_token_ids must be integers in \[0, {vocab}\)"):
        llm.generate([{"prompt_token_ids": [1, -2]}], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        llm.generate([{"prompt_token_ids": []}], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="sampling_params has 2 entries but there are 1 prompts"):
        llm.generate(["a"], [GREEDY, GREEDY], use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_abort_any_time_frees_blocks_and_gives_no_output(llm):
    engine = llm.engine
    engine.add_request("a", "KING HENRY:\nOnce more unto the breach", SamplingParams(max_tokens=50))
    engine.add_request("b", "ROMEO:", SamplingParams(temperature=0, max_tokens=3))
    engine.step()
    engine.abort_request("a")
    assert engine.get_unfinished_request_ids() == ["b"] and engine.has_unrecorded_aborts()
    outs = drain(engine)
    assert "a" not in outs  # vLLM's rule: an aborted request produces no output
    assert outs["b"].outputs[0].finish_reason in ("stop", "length")
    assert not engine.has_unrecorded_aborts()  # the next step recorded it
    assert [e.reason for e in engine.history.request_log("a") if type(e).__name__ == "RequestFinished"] == ["abort"]


def test_parallel_samples_share_prompt_blocks(llm):
    engine = llm.engine
    engine.add_request("p", "JULIET:\nO Romeo, Romeo! wherefore art thou Romeo?",
                       SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=6))
    prompt_len = engine.scheduler.requests["0_p"].num_prompt_tokens
    engine.step()  # child 0 computes the prompt; its siblings are queued after this step
    assert set(engine.scheduler.requests) == {"0_p", "1_p", "2_p"}
    engine.step()
    full_prompt_blocks = (prompt_len - 1) // engine.kv_cache.block_size
    tables = [engine.kv_cache.block_table(f"{i}_p") for i in range(3)]
    assert full_prompt_blocks >= 1
    assert tables[0][:full_prompt_blocks] == tables[1][:full_prompt_blocks] == tables[2][:full_prompt_blocks]
    assert engine.kv_cache.blocks[tables[0][0]].ref_count == 3
    outs = drain(engine)
    assert [c.index for c in outs["p"].outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in outs["p"].outputs}) > 1, "seeds i + 7 should differ"


def test_same_seed_same_tokens_whatever_the_batch(llm):
    params = SamplingParams(temperature=1.0, seed=1234, max_tokens=10)
    alone = llm.generate(["ROMEO:"], params, use_tqdm=False)[0].outputs[0].token_ids
    crowd = llm.generate(["JULIET:", "ROMEO:", "LEAR:"],
                         [SamplingParams(temperature=1.0, max_tokens=10), params, GREEDY],
                         use_tqdm=False)
    assert crowd[1].outputs[0].token_ids == alone


def test_history_dataframe_and_stats_line(llm, caplog):
    engine = llm.engine
    engine.history.clear()
    assert isinstance(engine.stat_loggers["logging"], LoggingStatLogger)  # log_stats=True's
    llm.generate(["ROMEO:", "ROMEO:"], GREEDY, use_tqdm=False)
    frame = engine.history.to_dataframe()
    assert len(frame) == len(engine.history) > 0
    assert frame["num_tokens"].sum() == sum(r.num_scheduled_tokens for r in engine.history)
    assert frame["kv_usage"].iloc[-1] == 0.0 and frame["running"].iloc[-1] == 0
    with caplog.at_level(logging.INFO, logger="workbench"):
        engine.do_log_stats()
    line = engine.stat_loggers["logging"].last_line
    assert "Avg prompt throughput" in line and "Running: 0 reqs" in line and line in caplog.text
    assert "0x" not in repr(engine.history[-1])


def test_chat_uses_the_chat_template(llm):
    out = llm.chat([{"role": "user", "content": "Good morrow."}], GREEDY, use_tqdm=False)[0]
    assert out.prompt.startswith(
        llm.get_tokenizer().apply_chat_template(
            [{"role": "user", "content": "Good morrow."}], tokenize=False, add_generation_prompt=True
        )
    )
    assert out.outputs[0].token_ids


def test_cli_generate_prints_text(capsys):
    assert cli_main(["generate", "ROMEO:", "--max-tokens", "8"]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("ROMEO:") and len(printed.strip()) > len("ROMEO:")


def test_unknown_model_fails_fast_with_its_name():
    with pytest.raises(Exception, match="no-such-org/no-such-model"):
        LLMEngine(model="no-such-org/no-such-model")


def test_reset_prefix_cache_forgets_cached_blocks(llm):
    engine = llm.engine
    prompt = "KING HENRY:\nOnce more unto the breach, dear friends, once more;"
    llm.generate([prompt], GREEDY, use_tqdm=False)
    engine.add_request("again", prompt, GREEDY)
    assert engine.get_num_unfinished_requests() == 1
    engine.step()
    assert engine.history[-1].scheduler_output.num_prefix_cache_hit_tokens > 0
    drain(engine)
    assert engine.reset_prefix_cache()
    engine.add_request("fresh", prompt, GREEDY)
    engine.step()
    assert engine.history[-1].scheduler_output.num_prefix_cache_hit_tokens == 0
    drain(engine)


def test_child_id_clash_is_rejected_before_anything_is_queued(llm):
    engine = llm.engine
    engine.add_request("1_p", "ROMEO:", SamplingParams(temperature=0, max_tokens=3))
    with pytest.raises(ValueError, match="'1_p' is already in flight"):
        engine.add_request("p", "JULIET:", SamplingParams(n=2, max_tokens=3))
    assert set(engine.scheduler.requests) == {"1_p"}
    assert set(drain(engine)) == {"1_p"}


def test_blocks_freed_counts_blocks_released(llm):
    engine = llm.engine  # block_size 8
    prompt = {"prompt_token_ids": list(range(10, 27))}  # 17 tokens: 2 full blocks + 1
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    # 17 prompt tokens + 1 output -> 3 blocks held, all released when it finishes in one step.
    assert engine.history[-1].num_blocks_freed == 3
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    # The rerun hits the 2 cached full blocks (ref 0 -> 1), allocates 1, later frees all 3.
    records = engine.history[-3:]
    assert [r.num_blocks_freed for r in records] == [0, 0, 3]
    assert records[0].scheduler_output.num_prefix_cache_hit_tokens == 16


def test_logged_prefix_hit_rate_stays_a_rate_under_preemption():
    engine = LLMEngine(device="cpu", block_size=4, num_kv_blocks=12, max_num_batched_tokens=16,
                       log_stats=True, log_stats_interval=1e9)
    engine.do_log_stats()
    prompts = ["KING HENRY:\nOnce more unto the breach", "HAMLET:\nTo be, or not to be"]
    for i, prompt in enumerate(prompts * 2):
        engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    drain(engine)
    assert engine.history.to_dataframe()["preempted"].sum() > 0
    stats = engine.kv_cache.prefix_cache_stats
    engine.do_log_stats()
    line = engine.stat_loggers["logging"].last_line
    expected = f"Prefix cache hit rate: {stats.hits / stats.queries:.1%}"
    assert expected in line and stats.hits <= stats.queries


def test_html_reprs_describe_the_live_engine(llm):
    engine = llm.engine
    llm.generate(["ROMEO:"], GREEDY, use_tqdm=False)
    page = llm._repr_html_()
    assert f"{engine.kv_cache.num_blocks} blocks x 8 tokens" in page and "0 running, 0 waiting" in page
    table = engine.history._repr_html_()
    assert f"{len(engine.history)} steps" in table and "<table" in table and "t_forward" not in table


def test_cli_generate_rejects_bad_input_with_the_field_named(capsys):
    assert cli_main(["generate", "ROMEO:", "--temperature", "-1"]) == 2
    assert "temperature must be non-negative" in capsys.readouterr().err


def test_cli_streams_one_prompt_and_batches_several(capsys):
    assert cli_main(["generate", "ROMEO:", "--max-tokens", "8", "--temperature", "0"]) == 0
    streamed = capsys.readouterr().out
    assert cli_main(["generate", "ROMEO:", "JULIET:", "--max-tokens", "8", "--temperature", "0"]) == 0
    batched = capsys.readouterr().out
    assert batched.startswith(streamed) and batched.count("-" * 40) == 2
