"""The views show what the engine recorded: each view is checked against an independent record
(the scheduler's per-step batch, the live KV pool, a hand-worked schedule), not its own output."""

import html
import html.parser
import threading
import time

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from workbench import LLMEngine, SamplingParams  # noqa: E402
from workbench.viz import (  # noqa: E402
    BlockMap, EngineDashboard, RequestTimeline, StepPlayer, plot_kv_blocks, plot_kv_usage, plot_step_tokens,
)
from workbench.viz.colors import request_color  # noqa: E402
from workbench.viz.live import LiveUpdater  # noqa: E402
from workbench.viz.timeline import request_spans  # noqa: E402

PROMPTS = ["ROMEO:", "JULIET:\nO Romeo, Romeo!", "HAMLET:\nTo be, or not to be", "KING LEAR:\nBlow, winds"]


def tight_engine(**overrides):
    """12 blocks of 4 tokens for 4 requests growing to 12 output tokens: preemption happens."""
    config = dict(device="cpu", block_size=4, num_kv_blocks=12, max_num_batched_tokens=16, max_num_seqs=4)
    return LLMEngine(**{**config, **overrides})


@pytest.fixture(scope="module")
def run():
    engine = tight_engine()
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    return engine


def test_hand_worked_timeline_of_one_request():
    # Ample pool and budget: step 0 computes the 3-token prompt (prefill) and samples token 1;
    # steps 1 and 2 decode tokens 2 and 3; max_tokens=3 finishes it ("length") in step 2.
    engine = LLMEngine(device="cpu", block_size=4, num_kv_blocks=16)
    prompt = engine.tokenizer("ROMEO:").input_ids
    engine.add_request("solo", prompt, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    rows, spans = request_spans(engine.history[:])
    assert rows == ["solo"]
    assert [(s["kind"], s["start"], s["end"], s["tokens"]) for s in spans] == [
        ("prefill", 0, 1, len(prompt)), ("decode", 1, 3, 2), ("finish", 2, 3, 3)]
    assert spans[-1]["reason"] == "length"


def test_timeline_agrees_with_the_scheduler_batches(run):
    rows, spans = request_spans(run.history[:])
    assert rows == ["r0", "r1", "r2", "r3"]
    for rid in rows:
        ran = {r.step for r in run.history for c in r.scheduler_output.scheduled if c.request_id == rid}
        drawn = {s for span in spans if span["request_id"] == rid and span["kind"] in ("prefill", "recompute", "decode")
                 for s in range(span["start"], span["end"])}
        assert drawn == ran, rid
        preempted = [r.step for r in run.history if rid in r.scheduler_output.preempted_request_ids]
        assert [s["start"] for s in spans if s["request_id"] == rid and s["kind"] == "preempted"] == preempted
        resumed = [r.step for r in run.history if rid in r.scheduler_output.resumed_request_ids]
        recompute = [s["start"] for s in spans if s["request_id"] == rid and s["kind"] == "recompute"]
        assert recompute[:1] == resumed[:1]  # the first chunk after a resume recomputes
    assert any(s["kind"] == "preempted" for s in spans), "the tight pool must preempt"
    timeline = RequestTimeline(run)
    assert timeline.rows == rows and bytes(timeline.image.value).startswith(b"\x89PNG")
    window = RequestTimeline(run, last=5)  # the last 5 steps and the requests active in them
    first = run.history[-5].step
    assert window.rows == [r for r in rows if any(s["request_id"] == r and s["end"] > first for s in spans)]
    assert window.rows != rows and min(s["start"] for s in window.spans) == first
    timeline.select_request("r2")
    text = run.tokenizer.decode([r.sampled_token_ids["r2"] for r in run.history if "r2" in r.sampled_token_ids])
    assert "finished (length)" in timeline.details.value and "ttft_s" in timeline.details.value
    assert html.escape(repr(text)) in timeline.details.value


def test_block_map_cells_follow_the_pool_and_zoom_to_the_used_range():
    engine = LLMEngine(device="cpu", block_size=4, num_kv_blocks=2000)
    scene = "ROMEO:\nBut soft, what light through yonder window breaks?"
    engine.add_request("a", scene, SamplingParams(temperature=0, max_tokens=4))
    engine.step()  # a's full prompt blocks enter the prefix cache
    engine.add_request("b", scene, SamplingParams(temperature=0, max_tokens=4))
    engine.step()  # b shares them
    view = BlockMap(engine)
    live = engine.kv_cache
    for cell in view.cells:
        block = live.blocks[cell["block_id"]]
        assert cell["ref_count"] == block.ref_count and cell["owners"] == list(block.owners)
    shared = [c["block_id"] for c in view.cells if c["state"] == "shared"]
    assert shared and shared == sorted(set(live.block_table("a")) & set(live.block_table("b")))
    used = len(set(live.block_table("a")) | set(live.block_table("b")))
    assert view.summary["never used"] == 2000 - used and sum(view.summary.values()) == 2000
    assert view.grid.value.count('class="wb-block"') == 16  # the used range, padded to a row
    assert "never used" in view.grid.value
    view.select_request("b")
    assert view.block_table("b") == live.block_table("b")
    assert f'data-block="{live.block_table("b")[0]}"' in view.grid.value and "[0]" in view.grid.value
    first = live.block_table("a")[0]
    view.select_block(first)
    assert html.escape(repr(engine.tokenizer.decode(live.blocks[first].token_ids))) in view.details.value
    assert plt.get_fignums() == []  # views never touch pyplot's registry


def test_player_shows_each_step_as_recorded(run):
    player = StepPlayer(run, live_updates=False)
    assert player.slider.min == run.history[0].step and player.slider.max == run.history[-1].step
    for record in run.history:
        player.slider.value = record.step
        assert [r["request_id"] for r in player.batch_rows] == [c.request_id for c in record.scheduler_output.scheduled]
        assert [r["num_new_tokens"] for r in player.batch_rows] == [
            c.num_new_tokens for c in record.scheduler_output.scheduled]
        assert len(player.queues["running"]) == record.num_running
        assert len(player.queues["waiting"]) == record.num_waiting
        assert f"<b>{record.num_scheduled_tokens}</b> / 16 tokens" in player.batch.value
        assert player.block_map.step == record.step
        assert player.block_map.summary["used"] + player.block_map.summary["shared"] == round(
            record.kv_usage * 12)
        why = [n for n in player.notes if "kept waiting" in n]
        assert bool(why) == bool(record.num_waiting)
        if why and "token budget was spent" in why[0]:
            assert record.num_scheduled_tokens == 16
        if why and "preempted" in why[0]:
            assert record.scheduler_output.preempted_request_ids
    preempt = next(r for r in run.history if r.scheduler_output.preempted_request_ids)
    victim = preempt.scheduler_output.preempted_request_ids[0]
    lost = run.history.kv_state(preempt.step - 1).block_table(victim)  # its table a step before
    player.show(preempt.step)
    note = next(n for n in player.notes if n.startswith(f"{victim} preempted"))
    assert f"lost blocks {lost}" in note and "none was free" in note
    assert set(player.block_map.marked) == set(lost)


def test_dashboard_buttons_drive_the_engine_and_report_errors():
    engine = tight_engine()
    dashboard = EngineDashboard(engine)
    buttons = {b.description: b for b in dashboard.buttons}
    assert dashboard.player.buttons == []  # one set of drive buttons: the dashboard's
    dashboard.prompt.value, dashboard.request_id.value = "ROMEO:", "mine"
    dashboard.max_tokens.value, dashboard.temperature.value, dashboard.priority.value = 5, 0.5, 3
    buttons["Add request"].click()  # fcfs refuses priorities (vLLM's rule): an error in the panel
    assert "Got priority 3 but Priority scheduling is not enabled." in dashboard.status.value
    assert not engine.has_unfinished_requests()
    dashboard.priority.value = 0
    buttons["Add request"].click()
    request = engine.scheduler.requests["mine"]
    assert (request.sampling_params.max_tokens, request.sampling_params.temperature) == (5, 0.5)
    dashboard.prompt.value = "word " * 300  # more blocks than the pool has
    buttons["Add request"].click()
    assert "num_blocks=12" in dashboard.status.value and "mine" in engine.scheduler.requests
    assert not any(b.disabled for b in dashboard.buttons)
    buttons["Step"].click()
    assert len(engine.history) == 1 and dashboard.player.step == 0 and "ready" in dashboard.status.value
    buttons["Run to the end"].click()
    assert not engine.has_unfinished_requests() and [o.request_id for o in dashboard.outputs] == ["mine"]
    assert "mine" in dashboard.requests.value and "mine" in dashboard.finished.value
    buttons["Reset"].click()
    assert len(engine.history) == 0 and dashboard.player.step is None
    dashboard.add("JULIET:", max_tokens=3)  # step numbers go on after a reset: the range moves up
    buttons["Run to the end"].click()
    assert "ready" in dashboard.status.value
    assert (dashboard.player.slider.min, dashboard.player.step) == (engine.history[0].step, engine.history[-1].step)
    assert engine.history[0].step > 0
    engine.add_request("elsewhere", "HAMLET:", SamplingParams(max_tokens=2))
    engine.step()  # stepped outside the dashboard: a live redraw touches only the tab on show
    dashboard.refresh(all_tabs=False)
    assert dashboard.player.step == engine.history[-1].step and "elsewhere" not in dashboard.timeline.rows
    dashboard.tabs.selected_index = 1  # picking the timeline redraws it
    assert "elsewhere" in dashboard.timeline.rows
    dashboard.close()
    assert engine.on_step == []
    assert plt.get_fignums() == []


def test_live_updates_are_throttled_and_run_off_the_stepping_thread():
    engine = tight_engine()
    engine.add_request("x", "ROMEO:", SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    threads = []
    updater = LiveUpdater(engine, lambda: threads.append(threading.current_thread()), interval=0.5)
    start = time.monotonic()
    for _ in range(4):
        engine.step()
    elapsed = time.monotonic() - start
    time.sleep(0.8)
    # At most one redraw per interval (plus the trailing one), none on the stepping thread.
    assert 1 <= len(threads) <= 1 + elapsed / 0.5
    assert threading.current_thread() not in threads
    before = len(threads)
    for _ in range(200):  # a burst of steps far faster than the interval: one redraw
        for hook in engine.on_step:
            hook(engine.history[-1])
    time.sleep(0.8)
    assert len(threads) == before + 1
    updater.close()
    assert engine.on_step == []


def test_one_colour_per_request_across_views(run):
    colours = {request_color(f"r{i}") for i in range(150)}
    assert len(colours) == 150
    ax = plot_step_tokens(run.history)
    bar_colours = {matplotlib.colors.to_hex(p.get_facecolor()) for p in ax.patches}
    assert bar_colours == {request_color(f"r{i}") for i in range(4)}
    plt.close("all")


def test_step_plot_scales_to_the_bars_and_keeps_the_budget_as_a_reference(run):
    ax = plot_step_tokens(run.history)
    per_step = {}
    for patch in ax.patches:
        step = round(patch.get_x() + patch.get_width() / 2)
        per_step[step] = per_step.get(step, 0) + patch.get_height()
    assert per_step == {r.step: r.num_scheduled_tokens for r in run.history if r.num_scheduled_tokens}
    assert ax.get_ylim()[1] >= 16 and any(line.get_ydata()[0] == 16 for line in ax.get_lines())
    plt.close("all")
    engine = LLMEngine(device="cpu", block_size=4, num_kv_blocks=16, max_num_batched_tokens=512)
    engine.add_request("d", "ROMEO:", SamplingParams(temperature=0, max_tokens=3))
    while engine.has_unfinished_requests():
        engine.step()
    ax = plot_step_tokens(engine.history)
    tallest = max(r.num_scheduled_tokens for r in engine.history)
    assert ax.get_ylim()[1] < 2 * tallest
    assert any("512 (off scale)" in t.get_text() for t in ax.get_legend().get_texts())
    plot_kv_usage(engine.history)
    ax = plot_kv_blocks(engine.kv_cache, max_blocks=8)
    assert len(ax.patches) == 8 and ax.get_title().endswith("(first 8 drawn)")
    plt.close("all")


def test_comparison_view_shows_each_run_side_by_side():
    from workbench import Workload, compare_runs
    from workbench.config import teaching_config
    from workbench.viz import ComparisonView

    workload = Workload.burst(num_requests=4, input_len=(10, 20), output_len=(3, 5), seed=4)
    comparison = compare_runs(workload, {p: teaching_config(policy=p) for p in ("fcfs", "spf")})
    view = ComparisonView(comparison)
    for name, result in comparison.results.items():
        assert f"<th>{name}</th>" in view.table_html
        frame = result.requests
        assert frame["num_preemptions"].sum() == comparison.table.loc[name, "num_preemptions"]
    assert bytes(view.cdf.value).startswith(b"\x89PNG") and bytes(view.timelines.value).startswith(b"\x89PNG")
    view.metric_picker.value = "e2e_steps"
    assert view.metric == "e2e_steps"
    view.run_picker.value = "spf"
    player = view.player_box.children[0]
    assert ComparisonView(comparison, metric="tpot_steps").metric_picker.value == "tpot_steps"
    view.show_metric("ttft_s")
    assert (view.metric, view.metric_picker.value) == ("ttft_s", "ttft_s")
    assert player.source.run is comparison.results["spf"] and player.step == comparison.results["spf"].history[-1].step
    assert plt.get_fignums() == []


def test_views_have_deterministic_plain_reprs_and_static_html(run):
    views = [BlockMap(run), RequestTimeline(run), StepPlayer(run, live_updates=False)]
    for view in views:
        assert repr(view) == repr(view) and "0x" not in repr(view)
        assert view._repr_html_().strip()
    final = run.history.kv_state()  # every request finished: all blocks free, some still cached
    assert repr(views[0]) == (f"BlockMap(step={run.history[-1].step}, used=0, shared=0, "
                              f"cached={final.num_cached_blocks}, free={12 - final.num_cached_blocks}, never used=0)")
    assert '<img src="data:image/png;base64,' in views[1]._repr_html_()


def _rgb(colour: str) -> tuple[int, int, int]:
    return tuple(int(colour[i:i + 2], 16) for i in (1, 3, 5))


def _distance(a: str, b: str) -> float:
    return sum((x - y) ** 2 for x, y in zip(_rgb(a), _rgb(b))) ** 0.5


def test_thirty_requests_get_distinct_colours_and_none_is_a_state_colour():
    from workbench.viz.colors import PALETTE, STATE_COLORS

    # Ids that share a trailing number (the magics', the dashboard's, a workload's) and
    # hashed names (tutorial 03's) used to collide or nearly so.
    ids = ["req-0", "ui-0", "r0", "second", "third", "first"] + [f"x{i}-{k}" for i in range(8) for k in range(3)]
    assert len(set(ids)) == 30
    colours = {rid: request_color(rid) for rid in ids}
    assert len(set(colours.values())) == 30
    assert not set(colours.values()) & set(STATE_COLORS.values())
    for rid, colour in colours.items():  # no request reads as a state: not grey, not preemption red
        r, g, b = _rgb(colour)
        assert max(r, g, b) - min(r, g, b) > 30, (rid, colour)
        assert _distance(colour, STATE_COLORS["preempted"]) > 60, (rid, colour)
    # The first 20 (a notebook's usual run) are far apart; past them the names tell apart.
    assert min(_distance(a, b) for i, a in enumerate(PALETTE) for b in PALETTE[i + 1:]) > 40
    assert request_color("ui-0") == colours["ui-0"]  # kept for the kernel


def test_every_view_draws_a_request_in_one_colour(run):
    from matplotlib.figure import Figure

    from workbench.viz.timeline import draw_timeline, empty_steps

    rows, spans = request_spans(run.history[:])
    ax = Figure().add_subplot()
    draw_timeline(ax, rows, spans, steps=(run.history[0].step, run.history[-1].step), empty=empty_steps(run.history))
    bars = {matplotlib.colors.to_hex(p.get_facecolor()) for p in ax.patches if abs(p.get_height() - 0.8) < 1e-6}
    block_map = BlockMap(run, step=run.history[2].step)
    owners = {o for c in block_map.cells for o in c["owners"]}
    assert owners and all(f"background:{request_color(o)}" in block_map.grid.value for o in owners)
    assert bars == {request_color(r) for r in rows}


def _figure_agrees(player, step):
    """The player's readout, text, batch and block map all name ``step``."""
    assert player.step == step and player.slider.value == step and player.play.value == step
    assert f"step <b>{step}</b> of" in player.position.value
    assert player.batch.value.startswith(f"<b>Step {step}</b>")
    assert player.block_map.step == step and f"after step {step})" in player.block_map.title.value


def test_the_slider_is_the_players_one_step_whatever_moves_it():
    engine = tight_engine()
    for i, prompt in enumerate(PROMPTS[:2]):
        engine.add_request(f"p{i}", prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    for _ in range(4):
        engine.step()
    player = StepPlayer(engine, live_updates=False)
    _figure_agrees(player, 3)  # opens on the newest
    player.show(1)  # from code: the slider moves too (it used to stay at the far right)
    _figure_agrees(player, 1)
    player.slider.value = 2  # a drag or an arrow key
    _figure_agrees(player, 2)
    player.play.value = 0  # the play button's tick
    _figure_agrees(player, 0)
    player.slider.value = 3
    engine.step()
    player.refresh()  # live following: on the newest, it follows
    _figure_agrees(player, 4)
    player.advance(1)
    _figure_agrees(player, 5)
    with pytest.raises(IndexError, match="not recorded"):
        player.show(99)
    _figure_agrees(player, 5)
    player.close()


def test_block_cells_name_their_owner_in_full_or_elided_with_a_marker():
    import re

    engine = LLMEngine(device="cpu", block_size=4, num_kv_blocks=16)
    names = ["hamlet", "juliet", "the-king-of-denmark"]
    for name, prompt in zip(names, PROMPTS[1:]):
        engine.add_request(name, prompt, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    engine.step()
    block_map = BlockMap(engine)
    cells = re.findall(r'title="block (\d+): used[^"]*owners ([^",]+)[^"]*"[^>]*>\d+<br>([^<]*)</div>',
                       block_map.grid.value)
    assert {owner for _, owner, _ in cells} == set(names)
    for _, owner, label in cells:
        label = html.unescape(label)
        if label != owner:  # shorter than the name only when elided, with the marker
            head, marker, tail = label.partition("…")
            assert marker and owner.startswith(head) and owner.endswith(tail) and head and tail, (owner, label)
    assert any(label == "hamlet" for _, _, label in cells)


def test_every_view_spans_the_kept_steps_and_says_where_they_start():
    engine = tight_engine()
    engine.add_request("warm", "ROMEO:", SamplingParams(temperature=0, max_tokens=3))
    while engine.has_unfinished_requests():
        engine.step()
    engine.history.clear()  # as tutorial 01 does after its warm-up: step numbers go on
    engine.add_request("a", "JULIET:", SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    for _ in range(3):
        engine.step()
    first, last = engine.history.steps[0], engine.history.steps[-1]
    assert first > 0
    player, timeline = StepPlayer(engine, live_updates=False), RequestTimeline(engine)
    assert (player.slider.min, player.slider.max) == (first, last)
    assert timeline.step_range == [first, last]
    assert f"steps before {first} are not kept" in player.position.value
    ax = plot_step_tokens(engine.history)
    low, high = ax.get_xlim()
    assert first - 1 < low < first and last < high < last + 1
    plt.close("all")
    player.close()


def test_a_request_added_since_the_last_step_shows_at_once():
    engine = tight_engine()
    dashboard = EngineDashboard(engine)
    rid = dashboard.add("ROMEO:", max_tokens=3)  # no step yet
    waiting = [r.request_id for r in engine.scheduler.waiting]
    assert waiting == [rid] and rid in dashboard.added.value and dashboard.last_added == rid
    assert dashboard.player.queues["added"] == waiting and rid in dashboard.player.queue_view.value
    assert dashboard.timeline.rows == waiting and dashboard.timeline.pending == waiting
    dashboard.step(2)
    other = dashboard.add("JULIET:", max_tokens=3)
    assert dashboard.player.queues["added"] == [other] and other in dashboard.timeline.rows
    assert f"waiting for step {engine.history[-1].step + 1}" in dashboard.timeline._title(engine.history[:], [other])
    dashboard.close()


def test_an_empty_batch_is_explained_and_marked_in_every_view(run):
    import dataclasses

    from workbench.viz.chunks import empty_batch_reason
    from workbench.viz.timeline import empty_steps

    records = run.history[:]
    victim = records[3].scheduler_output.scheduled[0].request_id
    so = dataclasses.replace(records[3].scheduler_output, scheduled=(), preempted_request_ids=(victim,))
    records[3] = dataclasses.replace(records[3], scheduler_output=so)
    reason = empty_batch_reason(records[3])
    assert reason.startswith("empty batch") and victim in reason and "own victim" in reason
    assert empty_steps(records) == [records[3].step] and all(empty_batch_reason(r) is None for r in run.history)
    ax = plot_step_tokens(records)
    shaded = [p for p in ax.patches if matplotlib.colors.to_hex(p.get_facecolor()) == "#505050"]
    assert len(shaded) == 1 and round(shaded[0].get_x() + shaded[0].get_width() / 2) == records[3].step
    assert any(t.get_text() == "empty batch" for t in ax.get_legend().get_texts())
    plt.close("all")


def test_a_recompute_chunk_is_drawn_as_one_in_every_view_and_finishes_sit_on_their_step(run):
    from matplotlib.figure import Figure

    from workbench.viz.encoding import CHUNK_HATCH
    from workbench.viz.timeline import FINISH_MARKERS, draw_timeline

    rows, spans = request_spans(run.history[:])
    recompute = [s for s in spans if s["kind"] == "recompute"]
    assert recompute  # the tight engine preempts, so some prompt is computed again
    ax = plot_step_tokens(run.history)
    hatched = {(round(p.get_x() + p.get_width() / 2), p.get_hatch()) for p in ax.patches}
    for span in recompute:
        assert (span["start"], CHUNK_HATCH["recompute"]) in hatched
    player = StepPlayer(run, live_updates=False)
    player.show(recompute[0]["start"])
    assert {r["kind"] for r in player.batch_rows if r["request_id"] == recompute[0]["request_id"]} == {"recompute"}
    finished = {e.request_id: e.step for r in run.history for e in r.request_events if e.kind == "finished"}
    figure = Figure()
    ax = figure.add_subplot()
    draw_timeline(ax, rows, spans, steps=(run.history[0].step, run.history[-1].step))
    markers = [line for line in ax.get_lines() if line.get_marker() in FINISH_MARKERS.values()]
    y = {rid: len(rows) - 1 - i for i, rid in enumerate(rows)}
    assert sorted((line.get_xdata()[0], line.get_ydata()[0]) for line in markers) == sorted(
        (step, y[rid]) for rid, step in finished.items())
    plt.close("all")


class _Rows(html.parser.HTMLParser):
    """The cells of each <tr> of an HTML fragment, as text; the styles of its <div>s."""

    def __init__(self):
        super().__init__()
        self.rows, self.div_styles, self._cell = [], [], None

    def handle_starttag(self, tag, attrs):
        if tag == "tr":
            self.rows.append([])
        elif tag in ("td", "th"):
            self._cell = []
        elif tag == "div":
            self.div_styles.append(dict(attrs).get("style", ""))

    def handle_data(self, data):
        if self._cell is not None:
            self._cell.append(data)

    def handle_endtag(self, tag):
        if tag in ("td", "th") and self._cell is not None:
            self.rows[-1].append("".join(self._cell))
            self._cell = None


def test_the_requests_tab_scrolls_visibly_and_outputs_keep_multiline_text_in_their_row():
    engine = tight_engine()
    dashboard = EngineDashboard(engine)
    for rid in ("first", "second"):
        engine.add_request(rid, "ROMEO:", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    dashboard.run_to_end()
    requests = _Rows()
    requests.feed(dashboard.requests.value)
    assert "scroll sideways" in dashboard.requests.value  # the hint
    assert any("overflow-x:scroll" in style for style in requests.div_styles)  # a visible scrollbar
    outputs = _Rows()
    outputs.feed(dashboard.finished.value)
    texts = {out.request_id: out.outputs[0].text for out in dashboard.outputs}
    assert any("\n" in text for text in texts.values())  # the case at stake: multi-line text
    body = outputs.rows[1:]
    assert len(body) == len(texts) and all(len(row) == 5 for row in body)
    for row in body:  # the text sits in the row of the request it belongs to
        assert row[2] == texts[row[0].strip()]
    dashboard.close()
