"""``--speculative-config`` on ``workbench generate`` and ``%llm load``; ``LLM(speculative_config=...)``."""

import pytest

from workbench import LLM, SamplingParams
from workbench.entrypoints.cli import main
from workbench.spec_decode.ngram_proposer import NgramProposer

SPEC = '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2, "prompt_lookup_min": 1}'


def test_generate_takes_the_flag_and_prints_the_greedy_text(capsys):
    args = ["generate", "ROMEO:\nO Romeo, Romeo, O Romeo", "--max-tokens", "12", "--temperature", "0",
            "--device", "cpu", "--num-kv-blocks", "32"]
    assert main(args) == 0
    plain = capsys.readouterr().out
    assert main(args + ["--speculative-config", SPEC]) == 0
    assert capsys.readouterr().out == plain  # greedy: the same text with speculation


def test_generate_names_the_field_of_a_bad_config(capsys):
    assert main(["generate", "x", "--device", "cpu", "--speculative-config",
                 '{"method": "ngram", "num_speculative_tokens": 0}']) == 2
    assert "speculative_config.num_speculative_tokens must be an integer >= 1" in capsys.readouterr().err


def test_llm_takes_a_dict():
    llm = LLM(device="cpu", num_kv_blocks=32, speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    assert isinstance(llm.engine.proposer, NgramProposer) and llm.engine.proposer.k == 3
    out = llm.generate("ROMEO:", SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_llm_load_magic_takes_the_flag():
    IPython = pytest.importorskip("IPython")
    from IPython.testing.globalipapp import start_ipython

    ip = start_ipython() or IPython.get_ipython()
    ip.run_line_magic("load_ext", "workbench")
    ip.run_line_magic("llm", f"load --as speng --speculative-config '{SPEC}'")
    engine = ip.user_ns["speng"]
    assert engine.config.speculative_config.num_speculative_tokens == 2
    assert isinstance(engine.proposer, NgramProposer)
