"""The %llm / %%llm magics in a real IPython shell, on the embedded model."""

import pytest

IPython = pytest.importorskip("IPython")


@pytest.fixture(scope="module")
def shell():
    from IPython.testing.globalipapp import start_ipython

    ip = start_ipython()
    ip.run_line_magic("load_ext", "workbench.magics")
    ip.run_line_magic("llm", "load --device cpu --num-kv-blocks 64 --block-size 8")
    return ip


def test_line_and_cell_generate_print_the_prompt_and_continuation(shell, capsys):
    shell.run_line_magic("llm", "generate --max-tokens 6 ROMEO:")
    line_out = capsys.readouterr().out
    shell.run_cell_magic("llm", "--max-tokens 6", "ROMEO:\n")
    cell_out = capsys.readouterr().out
    assert line_out.startswith("ROMEO:") and line_out == cell_out


def test_add_step_history(shell):
    shell.run_line_magic("llm", "add q1 JULIET:")
    record = shell.run_line_magic("llm", "step")
    assert record.scheduler_output.scheduled[0].request_id == "q1"
    shell.run_line_magic("llm", "step 100")
    frame = shell.run_line_magic("llm", "history")
    assert frame["running"].iloc[-1] == 0


def test_unknown_command_names_the_choices(shell):
    with pytest.raises(ValueError, match="unknown %llm command 'frobnicate'"):
        shell.run_line_magic("llm", "frobnicate")


def test_serve_from_a_notebook_then_stop(shell, capsys):
    import socket

    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = shell.run_line_magic("llm", f"serve --port {port}")
    try:
        assert url == f"http://127.0.0.1:{port}/v1"
        with pytest.raises(RuntimeError, match="being served"):
            shell.run_line_magic("llm", "step")
        reply = httpx.post(f"{url}/completions", timeout=60,
                           json={"model": "tiny-shakespeare", "prompt": "ROMEO:", "max_tokens": 4})
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] <= 4
    finally:
        shell.run_line_magic("llm", "stop")
    capsys.readouterr()
    shell.run_line_magic("llm", "generate --max-tokens 3 ROMEO:")  # the engine is ours again
    assert capsys.readouterr().out.startswith("ROMEO:")
