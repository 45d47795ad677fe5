"""``%llm exercise NAME`` puts the stub into the next cell; ``--check VAR`` grades a variable."""

from __future__ import annotations

import pytest
from IPython.core.error import UsageError

import workbench.exercises as ex


def test_exercise_puts_the_stub_in_the_next_cell(ipython, capsys, monkeypatch):
    staged = []
    monkeypatch.setattr(ipython, "set_next_input", staged.append)
    ipython.run_line_magic("llm", "exercise admission")
    assert "Exercise 1:" in capsys.readouterr().out
    assert staged == [ex.stub("admission")]


def test_exercise_check_grades_a_notebook_variable(ipython):
    ipython.user_ns["stub_schedule"] = lambda running, waiting, budget, seqs: []
    result = ipython.run_line_magic("llm", "exercise admission --check stub_schedule")
    assert not result.passed and result.first_wrong_step == 0
    with pytest.raises(UsageError, match="no exercise 'routing'"):
        ipython.run_line_magic("llm", "exercise routing")
