"""LoRA in the cost model: the device-slot model's loads by hand, the adapter terms in a
prediction, max_loras in simulate(), and a fit that recovers a known LoRA term."""

import dataclasses

import numpy as np
import pytest

from workbench.core.sched.output import ScheduledRequest, SchedulerOutput
from workbench.lab.sim import CostModel, simulate
from workbench.lab.sim.features import FEATURES, step_features
from workbench.lab.sim.lora_slots import LoRASlots
from workbench.lab.workload import Workload
from workbench.lora.request import LoRARequest


def _loads(slots: LoRASlots, batches) -> list[int]:
    return [slots.activate(batch) for batch in batches]


def test_one_slot_loads_every_switch():
    assert _loads(LoRASlots(1), [["a"], ["a"], ["b"], [], ["a"], ["a"]]) == [1, 0, 1, 0, 1, 0]


def test_two_slots_evict_the_least_recently_used():
    slots = LoRASlots(2)
    # a, b load; a is used again (b now LRU); c evicts b; b evicts a (used before c).
    assert _loads(slots, [["a"], ["b"], ["a"], ["c"], ["b"]]) == [1, 1, 0, 1, 1]
    assert list(slots.resident) == ["c", "b"]
    # A batch's own adapters are never evicted for each other: c is resident, a evicts b.
    assert _loads(slots, [["c", "a"]]) == [1]
    assert list(slots.resident) == ["c", "a"]


def test_pinned_adapters_stay():
    slots = LoRASlots(2)
    assert slots.pin("a") == 1
    # b loads; c evicts b (a is pinned though least recently used); a is still there; b evicts c.
    assert _loads(slots, [["b"], ["c"], ["a"], ["b"]]) == [1, 1, 0, 1]
    one = LoRASlots(1)
    one.pin("a")
    with pytest.raises(ValueError, match="pinned"):
        one.activate(["b"])
    with pytest.raises(ValueError, match="max_loras=1"):
        LoRASlots(1).activate(["a", "b"])


def _batch(lora_names) -> SchedulerOutput:
    scheduled = tuple(ScheduledRequest(f"r{i}", 10, 1, (5,), (0,), is_prefill=False, samples=True, lora_name=name)
                      for i, name in enumerate(lora_names))
    return SchedulerOutput(step=0, scheduled=scheduled)


def test_features_count_adapted_tokens_and_adapters():
    feats = dict(zip(FEATURES, step_features(_batch(["a", None, "b", "a"]), lora_loads=2)))
    assert (feats["lora_tokens"], feats["lora_adapters"], feats["lora_loads"]) == (3.0, 2.0, 2.0)
    base = dict(zip(FEATURES, step_features(_batch([None] * 4))))
    assert (base["lora_tokens"], base["lora_adapters"], base["lora_loads"]) == (0.0, 0.0, 0.0)


def test_the_shipped_model_prices_no_lora_and_a_positive_coefficient_does():
    shipped = CostModel.default()
    assert all(shipped.coefficients[f] == 0.0 for f in ("lora_tokens", "lora_adapters", "lora_loads"))
    adapted, base = _batch(["a", "b", None, "a"]), _batch([None] * 4)
    assert shipped.predict(adapted) == shipped.predict(base)
    model = dataclasses.replace(shipped, coefficients={**shipped.coefficients, "lora_tokens": 1e-4,
                                                       "lora_adapters": 5e-4, "lora_loads": 2e-3})
    assert model.predict(adapted) == pytest.approx(model.predict(base) + 3 * 1e-4 + 2 * 5e-4)
    assert model.predict(step_features(adapted, lora_loads=1)) == pytest.approx(model.predict(adapted) + 2e-3)


LORAS = [LoRARequest("errors", 1), LoRARequest("timon", 2)]
PRICED = dataclasses.replace(CostModel.default(), coefficients={
    **CostModel.default().coefficients, "lora_tokens": 2e-4, "lora_adapters": 1e-3, "lora_loads": 5e-3})


def test_max_loras_changes_the_simulated_schedule_and_latency():
    wl = Workload.burst(12, input_len=(16, 48), output_len=(8, 24), seed=3, text=False).with_lora_requests(LORAS)
    runs = {k: simulate(wl, {"enable_lora": True, "max_loras": k, "max_num_seqs": 8}, PRICED, clock="steps")
            for k in (1, 2)}
    per_step = {k: [len(r.scheduler_output.lora_names) for r in run.history] for k, run in runs.items()}
    assert max(per_step[1]) == 1 and max(per_step[2]) == 2
    skipped = {k: sum(len(r.scheduler_output.lora_skipped_request_ids) for r in run.history) for k, run in runs.items()}
    assert skipped[1] > 0 and skipped[2] == 0
    # One adapter at a time: more, smaller steps (each pays one adapter, not two).
    assert len(runs[1].history) > len(runs[2].history)
    assert runs[1].requests["e2e_steps"].max() > runs[2].requests["e2e_steps"].max()
    assert not np.allclose(runs[1].requests["e2e_s"], runs[2].requests["e2e_s"])
    # The base-priced model simulates the same schedule at other times: the LoRA terms count.
    plain = simulate(wl, {"enable_lora": True, "max_loras": 2, "max_num_seqs": 8}, CostModel.default(), clock="steps")
    assert [r.step for r in plain.history] == [r.step for r in runs[2].history]
    assert runs[2].requests["e2e_s"].sum() > plain.requests["e2e_s"].sum()


def test_simulated_runner_charges_a_load_per_switch_with_one_slot():
    # Two requests in sequence (max_num_seqs=1), each under its own adapter, one slot: each
    # first step loads; only lora_loads is priced, so the difference is exactly 2 loads.
    wl = Workload.burst(2, input_len=16, output_len=3, seed=0, text=False).with_lora_requests(LORAS)
    cfg = {"enable_lora": True, "max_loras": 1, "max_num_seqs": 1}
    base = CostModel.default()
    loads_only = dataclasses.replace(base, coefficients={**base.coefficients, "lora_loads": 0.25})
    extra = (simulate(wl, cfg, loads_only, clock="steps").requests["e2e_s"].max()
             - simulate(wl, cfg, base, clock="steps").requests["e2e_s"].max())
    assert extra == pytest.approx(2 * 0.25)
    # With the adapters' order a, a: one load.
    same = Workload.burst(2, input_len=16, output_len=3, seed=0, text=False).with_lora_requests([LORAS[0]])
    extra = (simulate(same, cfg, loads_only, clock="steps").requests["e2e_s"].max()
             - simulate(same, cfg, base, clock="steps").requests["e2e_s"].max())
    assert extra == pytest.approx(0.25)


def test_a_fit_recovers_a_known_lora_term():
    rng = np.random.default_rng(0)
    n = 400
    true = dict(CostModel.default().coefficients, lora_tokens=3e-5, lora_adapters=8e-4, lora_loads=4e-3)
    cols = {f: np.zeros(n) for f in FEATURES}
    cols["step"] = np.ones(n)
    decode = rng.integers(0, 64, n).astype(float)
    prefill = np.where(rng.random(n) < 0.3, rng.integers(8, 400, n), 0).astype(float)
    cols.update(decode_seqs=decode, decode_seqs_sqrt=np.sqrt(decode), decode_context=decode * rng.integers(16, 600, n),
                prefill_tokens=prefill, prefill_chunks=(prefill > 0).astype(float),
                prefill_step=(prefill > 0).astype(float), prefill_attention=prefill * (prefill + 1) / 2)
    adapters = rng.integers(0, 3, n).astype(float)
    cols["lora_adapters"] = adapters
    cols["lora_tokens"] = np.where(adapters > 0, np.floor((decode + prefill) * rng.random(n)), 0)
    cols["lora_loads"] = np.floor(adapters * rng.random(n) * 1.5).clip(0, adapters)
    x = np.column_stack([cols[f] for f in FEATURES])
    y = x @ np.array([true[f] for f in FEATURES]) * rng.normal(1.0, 0.01, n)
    fitted = CostModel.fit_measured(x, y, hardware={}).coefficients
    for f in ("lora_tokens", "lora_adapters", "lora_loads"):
        assert fitted[f] == pytest.approx(true[f], rel=0.1), f
    # Without LoRA steps the LoRA terms stay 0 (nothing to fit).
    base = x[:, :]
    base[:, [FEATURES.index(f) for f in ("lora_tokens", "lora_adapters", "lora_loads")]] = 0
    fitted = CostModel.fit_measured(base, base @ np.array([true[f] for f in FEATURES]), hardware={}).coefficients
    assert fitted["lora_tokens"] == fitted["lora_adapters"] == fitted["lora_loads"] == 0.0


def test_calibrate_with_lora_runs_lora_phases_that_load_adapters(monkeypatch):
    from workbench.lab.sim.calibrate import CalibrationGrid, calibrate

    grid = CalibrationGrid.tiny()
    adapters = [LoRARequest(f"a{i}", i + 1) for i in range(4)]
    phases = grid.lora_phases(adapters, vocab_size=100)
    assert len(phases) == 3 * len(grid.lora_batches) + len(grid.lora_prefill_lengths)
    # Each phase's adapters, through two slots in phase order: rotation makes later phases load.
    slots = LoRASlots(2)
    loads = [slots.activate(dict.fromkeys(r.lora_request.lora_name for r in wl if r.lora_request)) for _, wl in phases]
    assert sum(loads[1:]) >= len(phases) - 1
    fitted = []  # the measured feature rows the fit sees (coefficients depend on the machine)
    original = CostModel.fit_measured

    def fit_measured(x, y, *args, **kwargs):
        fitted.append(np.asarray(x))
        return original(x, y, *args, **kwargs)

    monkeypatch.setattr(CostModel, "fit_measured", staticmethod(fit_measured))
    model = calibrate(None, grid, progress=False, lora=True)
    assert "--lora" in model.note and model.fit_stats["num_steps"] > 0
    x = dict(zip(FEATURES, fitted[0].T))
    assert (x["lora_tokens"] > 0).sum() > 10 and x["lora_adapters"].max() == 2
    assert 3 <= x["lora_loads"].sum() <= 2 * len(phases)  # the four adapters each load at least once
