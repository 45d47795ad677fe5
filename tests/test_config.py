"""EngineArgs (also named EngineConfig): one class, and every option's command-line round trip.

The expected values are written out by hand, one non-default value per option, so a new field
without an entry here, or a flag that parses to another type or value, fails.
"""

from __future__ import annotations

import argparse
from dataclasses import fields

import pytest

import workbench
from workbench.pooling.config import PoolerConfig
from workbench.config import (EngineArgs, EngineConfig, SpeculativeConfig, KVTransferConfig, StructuredOutputsConfig,
                              teaching_config)

#: option -> (what a user types after its flag, the value it must parse to); booleans: both ways.
NON_DEFAULT = {
    "model": ("some/model", "some/model"),
    "tokenizer": ("some/tokenizer", "some/tokenizer"),
    "dtype": ("bfloat16", "bfloat16"),
    "device": ("cuda:1", "cuda:1"),
    "load_format": ("dummy", "dummy"),
    "seed": ("7", 7),
    "max_model_len": ("1024", 1024),
    "block_size": ("8", 8),
    "num_kv_blocks": ("33", 33),
    "kv_cache_memory_bytes": ("1048576", 1048576),
    "gpu_memory_utilization": ("0.5", 0.5),
    "max_num_kv_blocks": ("999", 999),
    "max_num_seqs": ("3", 3),
    "max_num_batched_tokens": ("64", 64),
    "policy": ("priority", "priority"),
    "attention_backend": ("cpu", "cpu"),
    "keep_warm_s": ("0.25", 0.25),
    "max_logprobs": ("5", 5),
    "logits_processors": ("my.module:Proc", ["my.module:Proc"]),
    "reasoning_parser": ("qwen3", "qwen3"),
    "max_history": ("12", 12),
    "log_stats_interval": ("1.5", 1.5),
    "otlp_traces_endpoint": ("http://127.0.0.1:4318/v1/traces", "http://127.0.0.1:4318/v1/traces"),
    "torch_profiler_dir": ("/tmp/profiles", "/tmp/profiles"),
    "max_loras": ("2", 2),
    "max_lora_rank": ("8", 8),
    "max_cpu_loras": ("4", 4),
    "structured_outputs_config": ('{"backend": "guidance", "disable_any_whitespace": true}',
                                  StructuredOutputsConfig(backend="guidance",
                                                          disable_any_whitespace=True)),
    "runner": ("pooling", "pooling"),
    "convert": ("embed", "embed"),
    "pooler_config": ('{"pooling_type": "MEAN", "normalize": false}', PoolerConfig("MEAN", False)),
    "speculative_config": ('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}',
                           SpeculativeConfig("ngram", 3, prompt_lookup_max=4, prompt_lookup_min=4)),
    "kv_transfer_config": ('{"kv_role": "kv_producer", "engine_id": "p0"}',
                           KVTransferConfig(kv_role="kv_producer", engine_id="p0")),
}
#: Options valid only with another (here: with otlp_traces_endpoint), parsed all at once.
DEPENDENT = {"collect_detailed_traces": ("all", "all")}
BOOLEANS = ("enable_prefix_caching", "multiprocess_mode", "enable_chunked_prefill", "batch_invariant", "async_scheduling", "log_stats", "enable_sleep_mode",
            "enable_lora")


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def parse(argv: list[str], **kw) -> EngineArgs:
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser(), **kw)
    return EngineArgs.from_cli_args(parser.parse_args(argv))


def test_one_class_under_both_names():
    assert EngineConfig is EngineArgs
    assert workbench.EngineConfig is workbench.EngineArgs is EngineArgs
    assert type(teaching_config()) is EngineArgs


def test_every_option_is_in_this_table():
    assert {f.name for f in fields(EngineArgs)} == set(NON_DEFAULT) | set(DEPENDENT) | set(BOOLEANS)


def test_no_flags_give_the_defaults():
    assert parse([]) == EngineArgs()


@pytest.mark.parametrize("name", sorted(NON_DEFAULT))
def test_each_flag_parses_back_to_its_value(name):
    text, value = NON_DEFAULT[name]
    assert getattr(EngineArgs(), name) != value  # the test says something
    got = parse([flag(name), text])
    assert getattr(got, name) == value and type(getattr(got, name)) is type(value)
    assert got == EngineArgs(**{name: value})


@pytest.mark.parametrize("name", BOOLEANS)
def test_each_boolean_parses_both_ways(name):
    on, off = parse([flag(name)]), parse(["--no-" + flag(name)[2:]])
    assert getattr(on, name) is True and getattr(off, name) is False
    assert on == EngineArgs(**{name: True}) and off == EngineArgs(**{name: False})


def test_all_flags_at_once_round_trip_and_make_the_engine_config():
    argv = [a for name, (text, _) in {**NON_DEFAULT, **DEPENDENT}.items() for a in (flag(name), text)]
    argv += ["--no-enable-prefix-caching", "--batch-invariant"]
    expected = EngineArgs(**{name: value for name, (_, value) in {**NON_DEFAULT, **DEPENDENT}.items()},
                          enable_prefix_caching=False, batch_invariant=True)
    args = parse(argv)
    assert args == expected
    config = args.create_engine_config()
    assert config == expected and config is not args  # the engine's own copy
    assert EngineArgs(**args.to_kwargs()) == expected


def test_keep_defaults_false_parses_only_the_given_flags():
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser(), exclude=("model",),
                                     keep_defaults=False)
    ns = parser.parse_args(["--block-size", "8", "--no-log-stats"])
    assert not hasattr(ns, "model")
    given = {k: v for k, v in vars(ns).items() if v is not None}
    assert given == {"block_size": 8, "log_stats": False}


def test_invalid_values_are_refused_by_the_parser_or_the_class():
    with pytest.raises(SystemExit):
        parse(["--dtype", "float8"])
    with pytest.raises(SystemExit):
        parse(["--block-size", "eight"])
    with pytest.raises(ValueError, match="block_size must be >= 1"):
        parse(["--block-size", "0"])


def test_repr_names_the_engine_config():
    text = repr(EngineArgs(block_size=8))
    assert text.startswith("EngineConfig(model=None, tokenizer=None, dtype='auto',")
    assert ", block_size=8," in text and text.endswith(")")
    assert ("log_stats_interval=5.0, otlp_traces_endpoint=None, collect_detailed_traces=None, "
            "enable_sleep_mode=False, torch_profiler_dir=None") in text
    assert ("structured_outputs_config=StructuredOutputsConfig(backend='auto', disable_fallback=False, "
            "disable_any_whitespace=False, disable_additional_properties=False)") in text
    assert "EngineConfig" in EngineArgs()._repr_html_()


@pytest.mark.parametrize("value, words", [
    ('{"backend": "outlines"}', "backend must be one of"),
    ('{"backend": "auto", "disable_any_whitespace": true}',
     "disable_any_whitespace is only supported for xgrammar and guidance"),
    ('{"backend": "xgrammar", "disable_additional_properties": true}',
     "disable_additional_properties is only supported for the guidance"),
    ('{"backend": "xgrammar", "whitespace": 1}', r"unknown keys \['whitespace'\]"),
    ("{backend: xgrammar}", "structured_outputs_config must be a JSON object"),
])
def test_structured_outputs_config_follows_vllms_rules(value, words):
    with pytest.raises(ValueError, match=words):
        parse(["--structured-outputs-config", value])


@pytest.mark.parametrize("value, message", [
    ({"method": "eagle"}, r"speculative_config.method must be one of \['ngram', 'draft_model'\]"),
    ({"num_speculative_tokens": 0}, "num_speculative_tokens must be an integer >= 1"),
    ({"prompt_lookup_min": 3, "prompt_lookup_max": 2}, r"prompt_lookup_min \(3\) must be <= prompt_lookup_max \(2\)"),
    ({"prompt_lookup_min": 0}, "prompt_lookup_min must be an integer >= 1"),
    ({"method": "draft_model"}, "speculative_config.model is required with method 'draft_model'"),
    ({"method": "ngram", "model": "x"}, "must not be set with method 'ngram'"),
    ({"k": 3}, r"unknown keys \['k'\]"),
    ("{not json", "must be a JSON object"),
])
def test_bad_speculative_configs_name_the_field_and_the_rule(value, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs(speculative_config=value)


def test_speculative_config_from_a_dict_a_json_string_or_itself():
    want = SpeculativeConfig("draft_model", 2, model="tiny-shakespeare-draft")
    as_dict = {"method": "draft_model", "num_speculative_tokens": 2, "model": "tiny-shakespeare-draft"}
    assert EngineArgs(speculative_config=as_dict).speculative_config == want
    assert EngineArgs(speculative_config=str(want)).speculative_config == want
    assert EngineArgs(speculative_config=want).speculative_config is want
    # one bound alone sets both; neither: 5 (vLLM's defaults)
    assert SpeculativeConfig(prompt_lookup_min=2).prompt_lookup_max == 2
    assert (SpeculativeConfig().prompt_lookup_min, SpeculativeConfig().prompt_lookup_max) == (5, 5)
