"""The step as vLLM V1's ``EngineCore.step`` reads: one screen, and one owner per piece.

Checked on the code itself: ``LLMEngine.step`` stays within 25 lines of code; the engine
never calls the grammar manager (the scheduler owns it, as in vLLM V1), observed at run time
on a constrained request through its whole life; and the engine room reaches the runner only
through the ``Runner`` protocol (which both runners implement: tests/worker/test_runner_protocol.py).
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import sys
from pathlib import Path

import pytest

from workbench import LLMEngine, SamplingParams
from workbench.config import teaching_config
from workbench.engine import llm_engine
from workbench.worker.runner_protocol import Runner
from workbench.sampling_params import StructuredOutputsParams


def code_lines(function) -> int:
    """Lines of a function's body that hold code (no docstring, comment or blank line)."""
    source = inspect.getsource(function)
    lines = source.splitlines()
    node = ast.parse("\n".join(line[len(lines[0]) - len(lines[0].lstrip()):] for line in lines)).body[0]
    has_docstring = isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)
    first = (node.body[1] if has_docstring else node.body[0]).lineno - node.lineno
    return sum(1 for line in lines[first:] if line.strip() and not line.strip().startswith("#"))


def test_the_step_is_one_screen():
    assert code_lines(LLMEngine.step) <= 25


def test_the_step_with_a_batch_queue_is_one_screen():
    """Async scheduling's step (vLLM's ``step_with_batch_queue``) is held to the same length."""
    assert code_lines(LLMEngine.step_with_batch_queue) <= 25


def test_the_engine_calls_no_grammar_manager_method():
    """Every public method of the manager is watched while a constrained request is added,
    compiled, masked, advanced and finished, next to a free one: only the scheduler (and the
    manager itself) call them."""
    engine = LLMEngine(teaching_config())
    manager = engine.scheduler.structured_output_manager
    callers: dict[str, set[str]] = {}
    for name, method in inspect.getmembers(manager, inspect.ismethod):
        if name.startswith("_"):
            continue

        def watched(*args, _name=name, _method=method, **kwargs):
            callers.setdefault(_name, set()).add(Path(sys._getframe(1).f_code.co_filename).name)
            return _method(*args, **kwargs)

        setattr(manager, name, watched)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    engine.add_request("json", "ROMEO:", SamplingParams(
        temperature=0, max_tokens=30, structured_outputs=StructuredOutputsParams(json=schema)))
    engine.add_request("free", "JULIET:", SamplingParams(temperature=0, max_tokens=4))
    while engine.has_unfinished_requests():
        engine.step()
    assert {"add_request", "update_waiting", "grammar_bitmask", "accept_tokens",
            "take_step", "remove"} <= set(callers)
    assert all(files == {"scheduler.py"} for files in callers.values()), callers
    assert Path(llm_engine.__file__).name not in set().union(*callers.values())


def test_the_engine_reaches_the_runner_only_through_its_protocol():
    """No module of the engine room reads a runner attribute the protocol does not declare,
    nor probes a runner with getattr / hasattr."""
    declared = {name for name in dir(Runner) if not name.startswith("_")} | {"batch_invariant"}
    engine_room = Path(llm_engine.__file__).parent
    offences = []
    for path in sorted(engine_room.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) \
                    and node.value.attr == "runner" and node.attr not in declared:
                offences.append(f"{path.name}:{node.lineno} .runner.{node.attr}")
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("getattr", "hasattr") \
                    and node.args and "runner" in ast.unparse(node.args[0]):
                offences.append(f"{path.name}:{node.lineno} {ast.unparse(node)}")
    assert not offences, offences



def test_a_record_is_complete_and_immutable_when_its_observers_see_it():
    engine = LLMEngine(teaching_config())
    seen = []
    engine.on_step.append(seen.append)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    engine.add_request("json", "ROMEO:", SamplingParams(
        temperature=0, max_tokens=8, structured_outputs=StructuredOutputsParams(json=schema)))
    while engine.has_unfinished_requests():
        engine.step()
    assert seen == list(engine.history)
    for record in seen:
        assert {"schedule", "output", "propose", "record"} <= set(record.timings)
        for mapping in (record.timings, record.sampled_token_ids, record.spec_decode,
                        record.structured_output.rows, record.structured_output.compiled):
            with pytest.raises(TypeError, match="read-only"):
                mapping["x"] = 1
        with pytest.raises(dataclasses.FrozenInstanceError):
            record.structured_output.cache_hits = ()
    assert any(record.structured_output.rows for record in seen)
