"""The engine's request checks, stat loggers, sleep mode and aborts against vLLM's rules (the
seed's LLMEngine, or vLLM V1 where V1 now does otherwise; each test names which): issue 30,
part 3, items 1-7. Each expectation is the rule as vLLM states it, not this code's output."""

from __future__ import annotations

import asyncio
import logging

import pytest

from serving_support import MODEL, client
from workbench import LLM, LLMEngine, SamplingParams
from workbench.config import EngineArgs
from workbench.core.request_events import RequestFinished
from workbench.engine.async_llm import AsyncLLM
from workbench.entrypoints.openai.api_server import build_app
from workbench.metrics.stats import LoggingStatLogger, StatLoggerBase

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
ENGINE = dict(device="cpu", block_size=8, num_kv_blocks=32, max_model_len=32)


@pytest.fixture(scope="module")
def engine():
    return LLMEngine(**ENGINE)


class Quiet(StatLoggerBase):
    def record(self, scheduler_stats, iteration_stats):
        pass

    def log(self):
        pass


# ------------------------------------------------------------------ 1. request_id's type
@pytest.mark.parametrize("request_id", [7, None, b"r", ("r",)])
def test_a_request_id_that_is_no_string_is_a_type_error(engine, request_id):
    # vLLM's LLMEngine.add_request (seed and V1): TypeError("request_id must be a string, got <type>")
    with pytest.raises(TypeError) as err:
        engine.add_request(request_id, "ROMEO:", GREEDY)
    assert str(err.value) == f"request_id must be a string, got {type(request_id)}"
    with pytest.raises(TypeError, match="request_id must be a string"):  # the server's path too
        engine.input_processor.process_inputs(request_id, "ROMEO:", GREEDY)
    assert not engine.has_unfinished_requests()


# ------------------------------------------------------------------ 2. the prompt's length
def test_prompt_length_rule_offline_is_vllms_engine_rule(engine):
    limit = engine.model_config.max_model_len
    assert limit == 32
    # longer than max_model_len: the seed's (and V1's) wording
    with pytest.raises(ValueError) as err:
        engine.add_request("long", {"prompt_token_ids": [5] * (limit + 1)}, GREEDY)
    assert str(err.value) == (f"The decoder prompt (length {limit + 1}) is longer than the maximum model "
                              f"length of {limit}. Make sure that `max_model_len` is no smaller than the "
                              "number of text tokens.")
    # exactly max_model_len: the seed accepted it, vLLM V1 refuses it (no room for one output token)
    with pytest.raises(ValueError) as err:
        engine.add_request("full", {"prompt_token_ids": [5] * limit}, GREEDY)
    assert str(err.value) == (f"The decoder prompt (length {limit}) plus the number of requested output "
                              f"tokens (at least 1) is longer than the maximum model length of {limit}. "
                              "Make sure that `max_model_len` is no smaller than the number of text "
                              "tokens (prompt + requested output tokens).")
    # one token less: served, and it may generate the one token the context still holds
    engine.add_request("fits", {"prompt_token_ids": [5] * (limit - 1)}, SamplingParams(temperature=0, ignore_eos=True))
    outs = {}
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o for o in engine.step() if o.finished})
    assert len(outs["fits"].outputs[0].token_ids) == 1 and outs["fits"].outputs[0].finish_reason == "length"


def test_the_server_keeps_its_own_prompt_length_rule_and_wording(engine):
    limit = engine.model_config.max_model_len
    # OpenAIServing._validate_input: >= max_model_len, "This model's maximum context length is ..."
    for n in (limit, limit + 1):
        with pytest.raises(ValueError) as err:
            engine.input_processor.process_inputs("s", {"prompt_token_ids": [5] * n}, GREEDY, serving=True)
        assert str(err.value) == (f"This model's maximum context length is {limit} tokens. However, your "
                                  f"request has {n} input tokens. Please reduce the length of the input "
                                  "messages.")
    request = engine.input_processor.process_inputs("s", {"prompt_token_ids": [5] * (limit - 1)}, GREEDY,
                                                    serving=True)
    assert len(request.prompt_token_ids) == limit - 1


# ------------------------------------------------------------------ 3. priority without a policy
@pytest.mark.parametrize("priority", [1, -3])
def test_priority_without_a_priority_policy_is_refused_in_vllms_words(engine, priority):
    with pytest.raises(ValueError) as err:
        engine.add_request("p", "ROMEO:", GREEDY, priority=priority)
    assert str(err.value) == f"Got priority {priority} but Priority scheduling is not enabled."
    assert not engine.has_unfinished_requests()


# ------------------------------------------------------------------ 7. params are required
@pytest.mark.parametrize("params", [None, {"max_tokens": 4}, "greedy"])
def test_add_request_requires_sampling_params(engine, params):
    # seed: "Either SamplingParams or PoolingParams must be provided."; vLLM V1's
    # InputProcessor._validate_params raises TypeError naming the type it got
    with pytest.raises(TypeError) as err:
        engine.add_request("q", "ROMEO:", params)
    assert "params must be a SamplingParams" in str(err.value) and type(params).__name__ in str(err.value)
    with pytest.raises(TypeError, match="params must be a SamplingParams"):
        engine.add_request("q", "ROMEO:")
    assert not engine.has_unfinished_requests()


# ------------------------------------------------------------------ 4. stat loggers
def test_stat_logging_defaults_as_vllm_engine_on_llm_off():
    # vLLM's EngineArgs.disable_log_stats=False: an engine logs stats (a LoggingStatLogger)
    assert EngineArgs().log_stats is True
    on = LLMEngine(**ENGINE)
    assert isinstance(on.stat_loggers.get("logging"), LoggingStatLogger)
    # vLLM's LLM sets disable_log_stats=True unless told
    llm = LLM(**ENGINE)
    assert llm.engine.config.log_stats is False and llm.engine.stat_loggers == {}
    assert LLM(**ENGINE, log_stats=True).engine.config.log_stats is True


def test_add_and_remove_logger_raise_when_stat_logging_is_disabled():
    off = LLMEngine(**ENGINE, log_stats=False)
    assert off.stat_loggers == {}
    message = r"^Stat logging is disabled\. Set `log_stats=True` \(vLLM's `disable_log_stats=False`\)"
    with pytest.raises(RuntimeError, match=message):
        off.add_logger("mine", Quiet())
    with pytest.raises(RuntimeError, match=message):
        off.remove_logger("mine")
    with pytest.raises(RuntimeError, match=message):  # from_engine_args adds its loggers the same way
        LLMEngine.from_engine_args(EngineArgs(**ENGINE, log_stats=False), stat_loggers={"mine": Quiet()})
    off.add_request("r", "ROMEO:", GREEDY)  # and the engine itself runs as before
    while off.has_unfinished_requests():
        off.step()
    on = LLMEngine(**ENGINE)
    on.add_logger("mine", Quiet())
    with pytest.raises(KeyError, match="Logger with name mine already exists."):
        on.add_logger("mine", Quiet())
    on.remove_logger("mine")
    with pytest.raises(KeyError, match="Logger with name mine does not exist."):
        on.remove_logger("mine")


def test_default_stats_line_is_periodic_not_per_step(caplog):
    # vLLM's LoggingStatLogger: one line per log_stats_interval (5 s), never one per step
    engine = LLMEngine(**ENGINE)
    assert engine.config.log_stats_interval == 5.0
    with caplog.at_level(logging.INFO, logger="workbench"):
        for i in range(3):
            engine.add_request(f"r{i}", "ROMEO:", GREEDY)
        steps = 0
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
    lines = [r for r in caplog.records if "Avg prompt throughput" in r.getMessage()]
    assert steps >= 4 and len(lines) <= 1


def test_server_without_stat_logging_serves_no_vllm_series():
    llm = AsyncLLM(LLMEngine(**ENGINE, log_stats=False))

    async def go():
        async with client(build_app(llm, model_name=MODEL)) as c:
            done = await c.post("/v1/completions", json={"model": MODEL, "prompt": "ROMEO:", "max_tokens": 2})
            metrics = await c.get("/metrics")
        await llm.shutdown()
        return done, metrics

    done, metrics = asyncio.run(go())
    assert done.status_code == 200 and metrics.status_code == 200 and "vllm:" not in metrics.text


# ------------------------------------------------------------------ 5. sleep mode
def test_sleep_and_wake_up_assert_sleep_mode_as_vllm(monkeypatch):
    plain = LLMEngine(**ENGINE)
    for call in (lambda: plain.sleep(1), lambda: plain.wake_up(), lambda: plain.wake_up(["weights"])):
        with pytest.raises(AssertionError) as err:
            call()
        assert str(err.value) == "Sleep mode is not enabled in the model config"
    assert not plain.is_sleeping()
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")  # the dev endpoints answer 400 with those words
    llm = AsyncLLM(plain)

    async def go():
        async with client(build_app(llm, model_name=MODEL)) as c:
            answers = [await c.post("/sleep"), await c.post("/wake_up")]
        await llm.shutdown()
        return answers

    for answer in asyncio.run(go()):
        assert answer.status_code == 400
        assert answer.json()["error"]["message"] == "Sleep mode is not enabled in the model config"


# ------------------------------------------------------------------ 6. aborts
def finished_events(engine, request_id):
    return [e for e in engine.history.request_log(request_id) if isinstance(e, RequestFinished)]


def test_an_abort_gives_no_output_and_the_request_is_gone_at_once():
    engine = LLMEngine(**ENGINE)
    engine.add_request("gone", "ROMEO:", SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    engine.add_request("pair", "JULIET:", SamplingParams(n=2, temperature=0.8, seed=1, max_tokens=20))
    engine.add_request("kept", "HAMLET:", GREEDY)
    engine.step()
    engine.abort_request(["gone", "pair", "never-added"])
    # vLLM: has_unfinished_requests() is False for them at once, and no output ever comes
    assert engine.get_unfinished_request_ids() == ["kept"] and engine.get_num_unfinished_requests() == 1
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert {o.request_id for o in outs} == {"kept"}
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks
    # the history still records each abort, in the step that followed it
    assert [e.reason for e in finished_events(engine, "gone")] == ["abort"]
    assert {e.request_id for rec in engine.history for e in rec.request_events
            if isinstance(e, RequestFinished) and e.reason == "abort"} >= {"gone", "0_pair", "1_pair"}
    assert engine.requests_dataframe().set_index("request_id").loc["gone", "finish_reason"] == "abort"


def test_aborting_the_last_request_leaves_nothing_unfinished_and_one_step_records_it():
    engine = LLMEngine(**ENGINE)
    engine.add_request("only", "ROMEO:", SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    engine.step()
    steps = len(engine.history)
    engine.abort_request("only")
    assert not engine.has_unfinished_requests() and engine.has_unrecorded_aborts()
    assert finished_events(engine, "only") == []  # not recorded yet: no step ran
    assert engine.step() == []  # a step with nothing to run: no output, the abort recorded
    assert len(engine.history) == steps + 1 and not engine.has_unrecorded_aborts()
    assert [e.reason for e in finished_events(engine, "only")] == ["abort"]
    engine.abort_request("only")  # finished already: ignored
    assert not engine.has_unrecorded_aborts()


def test_served_aborts_end_the_stream_and_are_recorded():
    # vLLM V1's AsyncLLM: the stream's last output is a final one with finish_reason "abort"
    llm = AsyncLLM(LLMEngine(**ENGINE))
    params = SamplingParams(temperature=0, max_tokens=25, ignore_eos=True)

    async def go():
        stream = await llm.add_request("ROMEO:", params, "served")
        await stream.__anext__()
        llm.abort("served")
        outs = [out async for out in stream]
        recorded = await llm.call(lambda: (llm.engine.has_unfinished_requests(),
                                           finished_events(llm.engine, "served")))
        await llm.shutdown()
        return outs, recorded

    outs, (busy, finished) = asyncio.run(asyncio.wait_for(go(), 60))
    assert outs and outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
    assert not busy and [e.reason for e in finished] == ["abort"]
