"""The %llm / %%llm magics in a real IPython shell, on the embedded model."""

import pytest

IPython = pytest.importorskip("IPython")

from IPython.core.error import UsageError  # noqa: E402


@pytest.fixture(scope="module")
def shell(ipython):
    ip = ipython  # the package is the extension: the fixture ran %load_ext workbench
    ip.run_line_magic("llm", "load --as eng --num-kv-blocks 40")
    return ip


def test_load_binds_the_teaching_engine_under_the_name_given(shell):
    from workbench.config import TEACHING_DEFAULTS

    engine = shell.user_ns["eng"]
    assert engine.kv_cache.num_blocks == 40  # the option given
    assert engine.kv_cache.block_size == TEACHING_DEFAULTS["block_size"]  # the teaching default
    assert engine.max_num_batched_tokens == TEACHING_DEFAULTS["max_num_batched_tokens"]


def test_help_is_a_short_grouped_command_list_and_help_load_has_the_flags(shell, capsys):
    from workbench.config import EngineConfig
    from workbench.entrypoints.magics import build_parser

    shell.run_line_magic("llm", "")
    out = capsys.readouterr().out
    commands = next(a for a in build_parser()._actions if hasattr(a, "choices") and a.choices).choices
    lines = out.splitlines()
    for name in commands:  # every command on exactly one line, under a group heading
        assert len([line for line in lines if line.strip().startswith(f"%llm {name} ") or line.strip() == f"%llm {name}"]) == 1
    assert {"engine:", "requests:", "views:", "serving:"} <= {line.strip() for line in lines}
    assert len(lines) <= len(commands) + 8  # one line each, a heading per group, %%llm, the intro
    assert "%llm add PROMPT [--id ID]" in out  # as typed: the prompt first (docs/magics.md says so too)
    assert "--block-size" not in out and "%%llm" in out
    shell.run_line_magic("llm", "help load")
    flags = capsys.readouterr().out
    for field in ("block_size", "num_kv_blocks", "policy", "enable_prefix_caching"):
        assert "--" + field.replace("_", "-") in flags
    assert len([f for f in EngineConfig.__dataclass_fields__ if "--" + f.replace("_", "-") in flags]) >= 15


@pytest.mark.parametrize("line, message", [
    ("frobnicate", "invalid choice: 'frobnicate'"),
    ("step many", "invalid int value: 'many'"),
    ("show everything", "invalid choice: 'everything'"),
    ("load --block-size big", "argument --block-size: invalid int value"),
    ("add", "the following arguments are required: PROMPT"),
    ("replay nothing_here", "no variable 'nothing_here'"),
    ("add " + "word " * 300, "num_blocks=40"),  # refused by the engine: too long for the pool
])
def test_bad_arguments_are_a_usage_line(shell, line, message):
    with pytest.raises(UsageError, match=message) as error:
        shell.run_line_magic("llm", line)
    assert "Traceback" not in str(error.value)


def test_line_and_cell_generate_print_the_prompt_and_continuation(shell, capsys):
    shell.run_line_magic("llm", "generate --max-tokens 6 ROMEO:")
    line_out = capsys.readouterr().out
    shell.run_cell_magic("llm", "--max-tokens 6", "ROMEO:\n")
    cell_out = capsys.readouterr().out
    assert line_out.startswith("ROMEO:") and line_out == cell_out


def test_add_step_run_show(shell, capsys):
    engine = shell.user_ns["eng"]
    with pytest.raises(UsageError, match=r"Got priority 2 but Priority scheduling is not enabled\.$"):
        shell.run_line_magic("llm", "add JULIET: --id q1 --priority 2")  # as vLLM: fcfs has no priorities
    assert not engine.has_unfinished_requests()
    shell.run_line_magic("llm", "add JULIET: --id q1 --max-tokens 5 --temperature 0.7")
    shell.run_line_magic("llm", "add ROMEO: --max-tokens 3")
    request = engine.scheduler.requests["q1"]
    assert (request.sampling_params.max_tokens, request.sampling_params.temperature) == (5, 0.7)
    made_up = [rid for rid in engine.scheduler.requests if rid != "q1"]
    assert len(made_up) == 1
    record = shell.run_line_magic("llm", "step")
    assert {c.request_id for c in record.scheduler_output.scheduled} == {"q1", made_up[0]}
    shell.run_line_magic("llm", "run")
    assert not engine.has_unfinished_requests()
    frame = shell.run_line_magic("llm", "show requests")
    assert frame.set_index("request_id").loc["q1", "num_output_tokens"] <= 5
    blocks = shell.run_line_magic("llm", "show blocks")
    assert sum(blocks.summary.values()) == 40
    timeline = shell.run_line_magic("llm", "show timeline")
    assert set(timeline.rows) >= {"q1", made_up[0]}
    stats = shell.run_line_magic("llm", "show stats")
    assert len(stats) == len(engine.history)
    player = shell.run_line_magic("llm", "player")
    assert player.step == engine.history[-1].step
    player.close()
    capsys.readouterr()


def test_replay_a_workload_variable(shell):
    from workbench import Workload

    shell.user_ns["wl"] = Workload.poisson(num_requests=3, rate=2.0, input_len=(4, 8), output_len=3, seed=3)
    result = shell.run_line_magic("llm", "replay wl")
    assert sorted(result.requests["request_id"]) == sorted(shell.user_ns["wl"].request_ids)
    assert (result.requests["num_output_tokens"] == 3).all()
    with pytest.raises(UsageError, match="is a int, not a Workload"):
        shell.user_ns["n"] = 3
        shell.run_line_magic("llm", "replay n")


def test_serve_from_a_notebook_then_stop(shell, capsys):
    import socket
    import time

    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = shell.run_line_magic("llm", f"serve --port {port}")
    try:
        assert url == f"http://127.0.0.1:{port}/v1"
        with pytest.raises(UsageError, match="being served"):
            shell.run_line_magic("llm", "step")
        dashboard = shell.run_line_magic("llm", "dashboard")  # read-only: the server steps
        assert [b.description for b in dashboard.buttons] == ["Refresh"]
        history = shell.user_ns["eng"].history
        last = history[-1].step if len(history) else -1
        reply = httpx.post(f"{url}/completions", timeout=60,
                           json={"model": "tiny-shakespeare", "prompt": "ROMEO:", "max_tokens": 4})
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] <= 4
        deadline = time.monotonic() + 10  # the dashboard follows the server's steps by itself
        while dashboard.updater.num_redraws == 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert dashboard.updater.num_redraws >= 1 and dashboard.player.step > last
        dashboard.close()
    finally:
        shell.run_line_magic("llm", "stop")
    capsys.readouterr()
    shell.run_line_magic("llm", "generate --max-tokens 3 ROMEO:")  # the engine is ours again
    assert capsys.readouterr().out.startswith("ROMEO:")


def test_profile_n_steps_writes_a_trace_and_prints_the_top_operators(shell, tmp_path, capsys):
    import json

    engine = shell.user_ns["eng"]
    shell.run_line_magic("llm", "add ROMEO: --max-tokens 4")
    first = engine.scheduler.step_count
    path = shell.run_line_magic("llm", f"profile 2 --dir {tmp_path}")
    assert "Self CPU" in capsys.readouterr().out
    names = {e.get("name") for e in json.loads(path.read_text())["traceEvents"]}
    assert {f"step {first}", f"step {first + 1}", "forward"} <= names and f"step {first + 2}" not in names
    with pytest.raises(UsageError, match="N must be >= 1"):
        shell.run_line_magic("llm", "profile 0")
    shell.run_line_magic("llm", "run")


def test_docs_magics_shows_what_the_help_prints(shell, capsys):
    import pathlib

    readme = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "magics.md").read_text()
    block = readme.split("then `%llm` prints its commands", 1)[1].split("```", 2)[1]
    shell.run_line_magic("llm", "")
    printed = [line.strip() for line in capsys.readouterr().out.splitlines()]
    shown = [line.strip() for line in block.splitlines() if line.strip()]
    for line in shown:  # each README line is a printed line, less its description
        assert any(p == line or p.startswith(line + "  ") for p in printed), line
    assert len(shown) == len(printed) - 1  # every printed line but the intro


def test_load_with_loras_and_add_under_one(shell, capsys):
    """``load --lora`` (a shipped adapter by name, or NAME=PATH) enables LoRA; ``add --lora``
    runs a request under it; the step's batch names the adapter."""
    from workbench.model.loader import embedded_lora_path

    shell.run_line_magic("llm", f"load --lora errors timon={embedded_lora_path('timon')}")
    engine = shell.user_ns["engine"]
    assert engine.config.enable_lora and engine.config.max_loras == 2 and engine.list_loras() == {1, 2}
    shell.run_line_magic("llm", "add ADRIANA: --id a --lora errors --max-tokens 2")
    shell.run_line_magic("llm", "add TIMON: --id t --lora timon --max-tokens 2")
    record = shell.run_line_magic("llm", "step")
    assert record.scheduler_output.lora_names == ("errors", "timon")
    with pytest.raises(UsageError, match=r"--lora nope: no such adapter.*\['errors', 'timon'\]"):
        shell.run_line_magic("llm", "add x --lora nope")
    with pytest.raises(UsageError, match="No embedded LoRA adapter 'nope'"):
        shell.run_line_magic("llm", "load --lora nope")
