"""The runner interface is declared once (worker/runner_protocol.py): the model runner and the
simulated runner both implement it, and both are built from the engine's one set of arguments."""

import inspect
import pickle

from workbench import LLMEngine, teaching_config
from workbench.lab.sim import CostModel, SimClock, SimulatedRunner
from workbench.worker.model_runner import ModelRunner
from workbench.worker.runner_protocol import Runner, RunnerFactory

#: Every method the protocol declares (the engine calls no other; tests/engine/test_step_shape.py).
METHODS = tuple(name for name in vars(Runner) if not name.startswith("_") and callable(getattr(Runner, name)))


def _parameters(fn):
    return [(p.name, p.kind) for p in inspect.signature(fn).parameters.values()]


def test_both_runners_implement_the_protocol_with_its_signatures():
    clock = SimClock()
    real = LLMEngine(teaching_config())
    sim = LLMEngine(teaching_config(), make_runner=SimulatedRunner.factory(CostModel({"step": 0.01}), clock),
                    clock=clock)
    for runner in (real.runner, sim.runner):
        assert isinstance(runner, Runner)
        for name in METHODS:
            assert _parameters(getattr(type(runner), name)) == _parameters(getattr(Runner, name)), (runner, name)
    assert isinstance(real.runner, ModelRunner) and isinstance(sim.runner, SimulatedRunner)
    assert sim.runner.batch_invariant is False and sim.kv_cache.num_blocks == real.kv_cache.num_blocks


def test_both_factories_take_the_engines_runner_arguments():
    expected = _parameters(RunnerFactory.__call__)[1:]  # without self
    assert _parameters(ModelRunner) == expected
    factory = SimulatedRunner.factory(CostModel({"step": 0.01}), SimClock())
    bound = set(factory.keywords)  # the simulation's own arguments, given to factory()
    assert [p for p in _parameters(factory) if p[0] not in bound] == expected
    pickle.dumps(factory)  # a process pool can carry it
