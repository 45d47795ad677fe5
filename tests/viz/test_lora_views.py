"""The views name each request's LoRA adapter: the player's batch table and its note on a
request skipped by max_loras, the timeline's row labels, the block map's request picker."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

from matplotlib.figure import Figure  # noqa: E402

from workbench import LLMEngine, LoRARequest, SamplingParams  # noqa: E402
from workbench.config import teaching_config  # noqa: E402
from workbench.model.loader import embedded_lora_path  # noqa: E402
from workbench.viz import BlockMap, StepPlayer  # noqa: E402
from workbench.viz.timeline import draw_timeline, request_spans  # noqa: E402
from workbench.viz.chunks import request_adapters  # noqa: E402


def test_views_label_adapters_and_the_max_loras_skip():
    engine = LLMEngine(teaching_config(enable_lora=True, max_loras=1))
    params = SamplingParams(max_tokens=2, ignore_eos=True, temperature=0)
    errors = LoRARequest("errors", 1, str(embedded_lora_path("errors")))
    timon = LoRARequest("timon", 2, str(embedded_lora_path("timon")))
    engine.add_request("e", "ADRIANA:", params, lora_request=errors)
    engine.add_request("t", "TIMON:", params, lora_request=timon)
    engine.add_request("b", "ROMEO:", params)
    while engine.has_unfinished_requests():
        engine.step()
    player = StepPlayer(engine, live_updates=False)
    player.show(0)
    assert [(r["request_id"], r["lora"]) for r in player.batch_rows] == [("e", "errors"), ("b", None)]
    assert "t (timon) skipped: max_loras caps a batch at 1 adapters (errors)" in " ".join(player.notes)
    assert "<th>adapter</th>" in player.batch.value
    records = list(engine.history)
    rows, spans = request_spans(records)
    ax = Figure().add_subplot()
    draw_timeline(ax, rows, spans, steps=(0, records[-1].step), adapters=request_adapters(records))
    assert {t.get_text() for t in ax.get_yticklabels()} == {"e [errors]", "t [timon]", "b"}
    bm = BlockMap(engine)
    bm.show(0)
    assert ("e [errors]", "e") in bm.request_picker.options
