"""The plots draw what a real run recorded; the dashboard steps the engine through its API."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from workbench import LLMEngine, SamplingParams  # noqa: E402
from workbench.viz import EngineDashboard, plot_kv_blocks, plot_kv_usage, plot_step_tokens  # noqa: E402


@pytest.fixture(scope="module")
def engine():
    engine = LLMEngine(device="cpu", block_size=8, num_kv_blocks=10, max_num_batched_tokens=16)
    for i, prompt in enumerate(["ROMEO:", "JULIET:\nO Romeo, Romeo!", "HAMLET:\nTo be, or not to be"]):
        engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    for _ in range(4):
        engine.step()
    return engine


def test_plots_draw_what_the_history_says(engine):
    ax = plot_step_tokens(engine.history)
    heights = [p.get_height() for p in ax.patches]
    frame = engine.history.to_dataframe()
    assert heights == list(frame["prefill_tokens"]) + list(frame["decode_tokens"])
    ax = plot_step_tokens(engine.history, last=2)
    assert len(ax.patches) == 4  # prefill and decode bars of the last two steps
    plot_kv_usage(engine.history)
    ax = plot_kv_blocks(engine.kv_cache, columns=5)
    owned = [i for i in range(engine.kv_cache.num_blocks) if engine.kv_cache.blocks[i].owners]
    assert len(ax.patches) == engine.kv_cache.num_blocks and owned
    assert ax.get_title() == f"KV blocks: {engine.kv_cache.num_free_blocks}/10 free"
    ax = plot_kv_blocks(engine.kv_cache, max_blocks=4)
    assert len(ax.patches) == 4 and ax.get_title().endswith("(first 4 drawn)")
    plt.close("all")


def test_dashboard_steps_the_engine(engine):
    dashboard = EngineDashboard(engine)
    before = len(engine.history)
    dashboard.step(2)
    assert len(engine.history) == before + 2
    dashboard.add("LEAR:")
    assert any(r.request_id == "ui-0" for r in engine.scheduler.waiting)
    dashboard.run_to_end()
    assert not engine.has_unfinished_requests()
    assert {o.request_id for o in dashboard.outputs} >= {"ui-0"}
    plt.close("all")
