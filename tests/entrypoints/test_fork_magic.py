"""%llm fork: branch the last %llm replay at a step, in a real IPython shell."""

import pytest

IPython = pytest.importorskip("IPython")

from IPython.core.error import UsageError  # noqa: E402

from workbench import first_divergence  # noqa: E402


@pytest.fixture(scope="module")
def shell(ipython):
    from workbench import SamplingParams, Workload, WorkloadRequest

    ip = ipython
    ip.run_line_magic("llm", "load --as eng --num-kv-blocks 12")
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    ip.user_ns["wl"] = Workload([WorkloadRequest(f"r{i}", tuple(range(20 + 9 * i, 32 + 9 * i)), params, arrival_step=i)
                                 for i in range(4)])
    return ip


def test_fork_the_last_replay_at_a_preemption(shell, capsys):
    eng = shell.user_ns["eng"]
    eng.add_request("warm", [5, 6, 7], shell.user_ns["wl"].requests[0].params)  # the engine stepped before
    while eng.has_unfinished_requests():
        eng.step()
    start = eng.scheduler.step_count
    run = shell.run_line_magic("llm", "replay wl")
    k = next(r.step for r in run.history if r.scheduler_output.preempted_request_ids)
    assert k > start  # step numbers are the engine's, not the run's
    view = shell.run_line_magic("llm", f"fork {k} --policy spf --max-num-seqs 2")
    branch = shell.user_ns["branch"]
    assert capsys.readouterr().out.strip() == f"branch: from step {k}: policy=spf, max_num_seqs=2"
    assert view.comparison.fork_step == k and list(view.comparison.results) == ["original", "branch"]
    found = first_divergence(run, branch)
    assert found is not None and found.step >= k
    assert [r.scheduler_output for r in branch.history if r.step < k] == \
           [r.scheduler_output for r in run.history if r.step < k]
    same = shell.run_line_magic("llm", f"fork {k} --as same")
    assert first_divergence(run, shell.user_ns["same"]) is None and same.comparison.fork_step == k
    aborted = shell.run_line_magic("llm", f"fork {k} --abort r3 --run branch --as b2")
    assert shell.user_ns["b2"].requests.set_index("request_id").loc["r3", "finish_reason"] == "abort"
    assert aborted.comparison.fork_step == k
    for view in (view, same, aborted):
        view.close()


def test_fork_refuses_what_it_cannot_branch(shell):
    shell.user_ns["n"] = 3
    with pytest.raises(UsageError, match="is a int, not a RunResult"):
        shell.run_line_magic("llm", "fork 2 --run n")
    with pytest.raises(UsageError, match=r"%llm fork: fork_at: step must be an integer in \["):
        shell.run_line_magic("llm", "fork 100000")
