"""What a newcomer types works from the repository root, in a fresh shell.

``python -m ...`` and ``python -c ...`` put the working directory first on ``sys.path``, so
from the root every package folder of the checkout is importable under its bare name. None
may shadow an installed library there: transformers (>= 5.25) imports the ``kernels``
library, and the checkout has a ``kernels/`` folder (``workbench.kernels``). The README's
command blocks run here as written: the install-and-run blocks' last command (the installs
themselves are ``.ci/run``'s, checked equal below, and CI runs them on a fresh virtualenv),
the server block whole, and the tour's Python blocks.
"""

from __future__ import annotations

import os
import pathlib
import re
import shlex
import signal
import socket
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
BLOCKS = re.findall(r"```(\w*)\n(.*?)```", README, re.S)
#: The README's bash blocks that install the project: ``a && b && ... && <the command run>``.
INSTALL_BLOCKS = [body.strip() for lang, body in BLOCKS if lang == "bash" and "pip install" in body]
SERVER_BLOCKS = [body for lang, body in BLOCKS if lang == "bash" and "workbench serve" in body]
PYTHON_BLOCKS = [body for lang, body in BLOCKS if lang == "python"]


def fresh_env() -> dict[str, str]:
    """A new shell's environment with this virtualenv activated: nothing the test session set
    (PYTHONPATH, TRITON_INTERPRET, ...) leaks in."""
    env = {"HOME": os.environ.get("HOME", "/tmp"), "LANG": "C.UTF-8",
           "PATH": f"{pathlib.Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin"}
    for name in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE"):  # the machine's, see the env notes
        if name in os.environ:
            env[name] = os.environ[name]
    return env


def sh(script: str, *, timeout: float, cwd: pathlib.Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", script], cwd=cwd, env=fresh_env(), capture_output=True,
                          text=True, timeout=timeout)


def checkout_package_folders() -> list[str]:
    """Top-level folders of the checkout that are regular packages, ``workbench`` aside."""
    return sorted(p.parent.name for p in ROOT.glob("*/__init__.py") if p.parent.name != "workbench")


# ----------------------------------------------------------------------------- shadowing


def test_the_checkout_has_package_folders_to_guard():
    assert "kernels" in checkout_package_folders()  # the case the guard exists for


@pytest.mark.parametrize("name", checkout_package_folders())
def test_from_the_root_a_folder_never_stands_for_a_top_level_package(name):
    """``import NAME`` from the root gives what it gives elsewhere: an installed library, or
    ModuleNotFoundError; never the checkout's folder."""
    probe = (f"import sys\ntry:\n    import {name}\nexcept ModuleNotFoundError:\n    print('absent')\n"
             f"else:\n    print({name}.__file__ or list({name}.__path__))")
    here = sh(f"python -c {shlex.quote(probe)}", timeout=60)
    assert here.returncode == 0, here.stderr
    assert str(ROOT / name) not in here.stdout, f"from the root, import {name} loads the checkout's folder"
    elsewhere = sh(f"python -c {shlex.quote(probe)}", timeout=60, cwd=pathlib.Path("/"))
    assert here.stdout == elsewhere.stdout


@pytest.mark.parametrize("name", checkout_package_folders())
def test_from_the_root_an_installed_library_of_the_same_name_wins(name, tmp_path):
    """A library of the folder's name on PYTHONPATH (after the root on sys.path) is the one
    imported, submodules included, and the workbench's own subpackage is unchanged."""
    library = tmp_path / name
    (library / "sub").mkdir(parents=True)
    (library / "__init__.py").write_text("MARK = 'the library'\n")
    (library / "sub" / "__init__.py").write_text("MARK = 'its submodule'\n")
    probe = (f"import {name}, {name}.sub, workbench.{name}\n"
             f"print({name}.MARK, {name}.sub.MARK, workbench.{name}.__name__, sep='|')")
    got = sh(f"PYTHONPATH={shlex.quote(str(tmp_path))} python -c {shlex.quote(probe)}", timeout=60)
    assert got.returncode == 0, got.stderr
    assert got.stdout.strip() == f"the library|its submodule|workbench.{name}"


def test_transformers_llama_imports_from_the_root():
    got = sh("python -c 'from transformers import LlamaForCausalLM; print(LlamaForCausalLM.__name__)'",
             timeout=120)
    assert got.returncode == 0, got.stderr
    assert got.stdout.strip() == "LlamaForCausalLM"


def test_python_m_workbench_help_from_the_root():
    got = sh("python -m workbench --help", timeout=60)
    assert got.returncode == 0, got.stderr
    assert "serve" in got.stdout and "generate" in got.stdout


# ----------------------------------------------------------------------------- the README's blocks


def pip_installs(commands: str) -> list[list[str]]:
    """The requirement arguments of each ``pip install`` in a shell text, flags left out."""
    installs = []
    for line in re.split(r"&&|\n", commands):
        if "pip install" not in line:
            continue
        words = shlex.split(line, comments=True)
        if "pip" in words and words[words.index("pip") + 1:][:1] == ["install"]:
            args = words[words.index("pip") + 2:]
            if args != ["--upgrade", "pip"] and "--upgrade" not in args[:2]:
                installs.append([a for a in args if a not in ("--quiet", "-q")])
    return installs


def test_the_readme_has_its_two_commands_and_the_server_block():
    assert len(INSTALL_BLOCKS) == 2 and len(SERVER_BLOCKS) == 1


def test_ci_installs_what_the_readme_test_command_installs():
    tests_block = next(b for b in INSTALL_BLOCKS if "pytest" in b)
    ci = (ROOT / ".ci" / "run").read_text()
    assert pip_installs(tests_block) == pip_installs(ci)
    assert tests_block.split("&&")[-1].strip() in ci


def test_the_readme_generate_command_runs_from_the_root():
    command = next(b for b in INSTALL_BLOCKS if "workbench generate" in b).split("&&")[-1]
    got = sh(command, timeout=300)
    assert got.returncode == 0, got.stderr
    assert len(got.stdout.split()) >= 10, got.stdout  # 64 tokens of text


def test_the_readme_test_command_collects_from_the_root():
    """The README's test command (``python -m pytest -q``), collecting only: running it whole
    is what CI does with this very test inside."""
    command = next(b for b in INSTALL_BLOCKS if "pytest" in b).split("&&")[-1].strip()
    assert command == "python -m pytest -q"
    got = sh(f"{command} --collect-only -p no:cacheprovider", timeout=300)
    assert got.returncode == 0, got.stdout[-3000:] + got.stderr[-3000:]
    assert re.search(r"\d+ tests collected", got.stdout), got.stdout[-3000:]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_readme_server_block_runs_as_written(tmp_path):
    """The block, in its own session, on a free port in place of 8000 (the only change): the
    server must be up when the second curl runs, and the stream must end with [DONE]. Output
    goes to files: the backgrounded server keeps its copy of a pipe open."""
    block = SERVER_BLOCKS[0].replace("8000", str(free_port()))
    stdout, stderr = tmp_path / "stdout", tmp_path / "stderr"
    with stdout.open("w") as o, stderr.open("w") as e:
        proc = subprocess.Popen(["bash", "-c", block], cwd=ROOT, env=fresh_env(), stdout=o, stderr=e,
                                start_new_session=True)
        try:
            proc.wait(timeout=180)
        finally:
            os.killpg(proc.pid, signal.SIGTERM)  # the backgrounded server
    out = stdout.read_text()
    assert proc.returncode == 0, stderr.read_text()[-3000:]
    events = [line[len("data: "):] for line in out.splitlines() if line.startswith("data: ")]
    assert events and events[-1] == "[DONE]", out
    assert any('"content"' in e for e in events[:-1]), out


@pytest.mark.parametrize("index", range(len(PYTHON_BLOCKS)))
def test_the_readme_python_blocks_run_as_written(index, tmp_path):
    """Each block of the tour as a script, in a scratch folder (the files it writes land there)."""
    script = tmp_path / "block.py"
    script.write_text(PYTHON_BLOCKS[index])
    got = sh(f"python {script}", timeout=600, cwd=tmp_path)
    assert got.returncode == 0, got.stderr[-3000:]
