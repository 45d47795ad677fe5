"""IdleWaiter: an idle engine keeps a CPU's worker threads awake, for keep_warm_s, and no longer."""

import asyncio
import time

import pytest
import torch

from workbench.config import EngineConfig
from workbench.engine.llm_engine import LLMEngine
from workbench.engine.idle import TICK_S, IdleWaiter
from workbench.sampling_params import SamplingParams
from workbench.engine.async_llm import AsyncLLM
from workbench.lab.replay import replay_workload
from workbench.lab.workload import Workload


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_sleep_pokes_every_tick_while_warm(two_threads):
    waiter = IdleWaiter(torch.device("cpu"), keep_warm_s=10.0)
    start = time.monotonic()
    waiter.sleep(0.05)
    assert time.monotonic() - start >= 0.05
    # one poke per tick: at most 0.05 / TICK_S, fewer when a busy machine is slow to wake us
    assert 2 <= waiter.pokes <= round(0.05 / TICK_S) + 1
    assert waiter.timeout() == TICK_S


def test_the_pool_parks_once_keep_warm_s_has_passed(two_threads):
    waiter = IdleWaiter(torch.device("cpu"), keep_warm_s=0.02)
    time.sleep(0.03)  # longer than keep_warm_s since construction (a mark_busy)
    waiter.sleep(0.03)
    assert waiter.pokes == 0 and waiter.timeout() is None
    waiter.mark_busy()
    waiter.sleep(0.01)
    assert waiter.pokes >= 1


@pytest.mark.parametrize("device, keep_warm_s, threads", [("cpu", 0.0, 2), ("cpu", 5.0, 1), ("meta", 5.0, 2)])
def test_nothing_to_keep_warm(device, keep_warm_s, threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        waiter = IdleWaiter(torch.device(device), keep_warm_s)
        waiter.sleep(0.02)
        assert not waiter.active and waiter.pokes == 0 and waiter.timeout() is None
    finally:
        torch.set_num_threads(before)


def test_a_negative_keep_warm_s_is_refused():
    with pytest.raises(ValueError, match="keep_warm_s must be >= 0"):
        EngineConfig(keep_warm_s=-1.0)
    with pytest.raises(ValueError, match="keep_warm_s must be >= 0"):
        IdleWaiter(torch.device("cpu"), float("nan"))


def test_a_wall_clock_replay_waits_through_the_engine_idle_waiter(two_threads):
    """The engine idle between r0's end and r1's arrival (about 1 s apart): the replay waits
    in the engine's IdleWaiter."""
    engine = LLMEngine(device="cpu", num_kv_blocks=64, keep_warm_s=10.0)
    workload = Workload.poisson(2, rate=1.0, input_len=(8, 12), output_len=2, text=False, seed=0, clock="wall")
    asked = []  # the waits the replay asked for (none if a loaded machine ran past the gap)
    sleep = engine.idle.sleep
    engine.idle.sleep = lambda seconds: (asked.append(seconds), sleep(seconds))[1]
    run = replay_workload(engine, workload, clock="wall")
    assert len(run.outputs) == 2
    assert run.wall_s >= workload[1].arrival_time
    r = run.requests.set_index("request_id")
    idle_s = r.loc["r1", "arrival_s"] - r.loc["r0", "arrival_s"] - r.loc["r0", "e2e_s"]
    assert asked or idle_s < 0.2, idle_s  # idle (not a race with r1's arrival): it waited
    assert engine.idle.pokes >= min(2, int(sum(asked) / TICK_S) // 2)


def test_the_server_loop_pokes_while_idle_and_serves_after(two_threads):
    async def main():
        llm = AsyncLLM(LLMEngine(device="cpu", num_kv_blocks=64, keep_warm_s=10.0))
        try:
            await asyncio.sleep(0.05)
            assert llm.engine.idle.pokes >= 2
            outputs = [o async for o in llm.generate([5, 6, 7], SamplingParams(max_tokens=2), "r0")]
            assert outputs[-1].finished
        finally:
            await llm.shutdown()

    asyncio.run(main())


def test_a_server_left_running_is_stopped_before_the_interpreter_exits():
    """A program that never calls shutdown(): the engine thread is stopped at exit (before the
    interpreter tears torch down under it). atexit runs handlers last-in first-out, so the
    probe registered first sees the state after AsyncLLM's own handler."""
    import subprocess
    import sys

    program = (
        "import atexit\n"
        "state = {}\n"
        "atexit.register(lambda: print('engine thread alive at exit:', state['llm']._thread.is_alive()))\n"
        "import time\n"
        "from workbench.engine.llm_engine import LLMEngine\n"
        "from workbench.engine.async_llm import AsyncLLM\n"
        "state['llm'] = AsyncLLM(LLMEngine(device='cpu', num_kv_blocks=64))\n"
        "time.sleep(0.1)\n"
    )
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "engine thread alive at exit: False" in done.stdout
