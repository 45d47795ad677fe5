"""The views in a real browser: JupyterLab on loopback, a notebook run in headless Chromium.

Widget callbacks then arrive over the real comm (on a second kernel thread with JupyterLab's
default "Kernel Comms over subshells"), which kernel-level tests never exercise. The test runs
the notebook, adds a request and clicks Step in the dashboard, checks a speculating
player's draft marks (accepted, rejected, recovered; the block map's slot strip), moves the player's slider
with the keyboard and by a drag, checks that the views changed and that no cell or widget
shows an error, and checks what a reader would trust: the slider's readout is the step
shown (after ``show(k)`` and after a drag), distinct ids have distinct colours, no label is
shorter than the id it names unless elided with a marker, and no figure is shown below half
its size. It saves the
screenshots (into a temp dir; ``WORKBENCH_SCREENSHOTS=1`` writes them into docs/, where the
README shows them); on a failure the whole page is saved to $TMPDIR/workbench-browser-failure.png.
"""

import os
import pathlib
import re
import shutil

import nbformat
import pytest
from lab_support import start_lab

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
DOCS = pathlib.Path(__file__).resolve().parents[2] / "docs"
DONE = "NOTEBOOK-DONE"
FAILURE_SHOT = pathlib.Path(os.environ.get("TMPDIR", "/tmp")) / "workbench-browser-failure.png"

CELLS = [
    "%load_ext workbench\n%llm load",
    "from workbench import Workload, replay_workload\n"
    "workload = Workload.burst(num_requests=5, input_len=(12, 32), output_len=(4, 8), seed=4)\n"
    "result = replay_workload(engine, workload)\nresult",
    "from workbench.viz import BlockMap, RequestTimeline, StepPlayer\n"
    "busiest = max(result.history, key=lambda r: r.kv_usage).step\n"
    "block_map = BlockMap(result, step=busiest)\n"
    "block_map.select_request(block_map.cells[0]['owners'][0])\n"
    "block_map",
    "RequestTimeline(result)",
    "player = StepPlayer(result)\n"
    "player.show(next(r.step for r in result.history if r.scheduler_output.preempted_request_ids))\n"
    "player",
    "%llm compare workload --policies fcfs spf priority",
    "%llm add ROMEO: --max-tokens 12\n%llm add 'JULIET:\\nO Romeo, Romeo!' --max-tokens 12\n%llm dashboard",
    "from workbench import LLMEngine, SamplingParams\n"
    "from workbench.sampling_params import StructuredOutputsParams\n"
    "constrained = LLMEngine(device='cpu', block_size=8, num_kv_blocks=32)\n"
    "constrained.add_request('ay', 'ROMEO:', SamplingParams(temperature=0, max_tokens=8,\n"
    "    structured_outputs=StructuredOutputsParams(choice=['ay', 'nay'])))\n"
    "while constrained.has_unfinished_requests():\n    constrained.step()\n"
    "StepPlayer(constrained)",
    "spec = LLMEngine(block_size=8, num_kv_blocks=64, max_num_batched_tokens=32, speculative_config={'method': 'ngram', "
    "'num_speculative_tokens': 4, 'prompt_lookup_max': 4, 'prompt_lookup_min': 2})\n"
    "quote = 'ROMEO: But soft, what light through yonder window breaks? It is the east, and Juliet is the sun. '\n"
    "spec.add_request('quote', quote + 'ROMEO: But soft,', SamplingParams(temperature=0, max_tokens=40))\n"
    "spec.add_request('plain', 'JULIET:', SamplingParams(temperature=0, max_tokens=30))\n"
    "while spec.has_unfinished_requests():\n    spec.step()\n"
    "spec_player = StepPlayer(spec, controls=False)\n"
    "spec_player.show(next(r.step for r in spec.history for x in r.spec_decode.values()\n"
    "                      if 0 < x.num_accepted < x.num_draft_tokens))\n"
    "spec_player",
    f"print({DONE!r})",
]
SHOTS = {2: "block_map.png", 3: "timeline.png", 4: "player.png", 5: "comparison.png", 6: "dashboard.png",
         7: "grammar_player.png", 8: "spec_decode_player.png"}

#: In the page: every visible figure's shown width over its drawn width (an <img> of PNG bytes).
FIGURE_SCALES = """() => [...document.querySelectorAll('.jp-Notebook .jp-OutputArea-output img')]
    .filter(img => img.offsetParent !== null && img.naturalWidth > 0)
    .map(img => [img.clientWidth / img.naturalWidth, img.naturalWidth, img.closest('.jp-Cell').innerText.slice(0, 40)])"""
#: In the page: (text, background) of every request chip (a monospace span on a colour; a
#: speculative draft's span is coloured by its fate, not a request).
CHIPS = """root => [...root.querySelectorAll('span[style*="background"][style*="monospace"]:not(.wb-draft)')]
    .map(chip => [chip.innerText, getComputedStyle(chip).backgroundColor])"""
#: In the page: (owner, label, background) of every used block cell.
CELLS_JS = """root => [...root.querySelectorAll('.wb-block')]
    .filter(cell => /^block \\d+: used,/.test(cell.title))
    .map(cell => [cell.title.match(/owners ([^,;]+)/)[1], cell.innerText.split('\\n')[1],
                  getComputedStyle(cell).backgroundColor])"""


def check_colours_and_labels(root) -> None:
    """Distinct ids -> distinct colours (and one colour per id); a cell's name is the id, or
    elided with "…" around the id's head and tail."""
    colour_of: dict[str, set[str]] = {}
    for text, colour in root.evaluate(CHIPS):
        colour_of.setdefault(text, set()).add(colour)
    for owner, label, colour in root.evaluate(CELLS_JS):
        colour_of.setdefault(owner, set()).add(colour)
        head, marker, tail = label.partition("…")
        assert label == owner or (marker and owner.startswith(head) and owner.endswith(tail)), (owner, label)
    assert all(len(colours) == 1 for colours in colour_of.values()), colour_of
    assert len({c for colours in colour_of.values() for c in colours}) == len(colour_of), colour_of


def _readout_is_the_step(player) -> int:
    readout = int(_text(player.locator(".widget-readout").first))
    shown = int(re.search(r"step (\d+) of", _text(player.locator(".widget-html", has_text=" of ").first)).group(1))
    batch = int(re.match(r"Step (\d+)", _text(player.locator(".widget-html", has_text=re.compile(r"^Step \d+")).first)).group(1))
    assert readout == shown == batch, (readout, shown, batch)
    return shown


pytestmark = pytest.mark.skipif(
    not os.path.exists(CHROMIUM), reason="chromium is not installed (CI installs it: apt-get install chromium)"
)


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """A JupyterLab server on 127.0.0.1 over a temp dir holding the notebook; yields its URL."""
    root = tmp_path_factory.mktemp("lab")
    notebook = nbformat.v4.new_notebook()
    notebook.cells = [nbformat.v4.new_code_cell(src) for src in CELLS]
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(notebook, root / "views.ipynb")
    with start_lab(root) as (url, token):
        yield f"{url}/lab/tree/views.ipynb?token={token}"


def _text(locator) -> str:
    return locator.inner_text(timeout=10_000)


def _run_all_cells(page) -> None:
    """Run > Run All Cells once the kernel is idle; again if no cell started (a click that
    lands while the session is still connecting is dropped)."""
    page.wait_for_selector(".jp-StatusBar-TextItem:has-text('Idle')", timeout=60_000)
    first_prompt = page.locator(".jp-Notebook .jp-Cell .jp-InputPrompt").first
    for _ in range(3):
        page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(r"^Run$")).click()
        page.locator(".lm-Menu-itemLabel", has_text=re.compile(r"^Run All Cells$")).click()
        try:
            page.wait_for_function("el => /\\[(\\*|\\d+)\\]/.test(el.innerText)",
                                   arg=first_prompt.element_handle(), timeout=10_000)
            return
        except Exception:
            continue
    raise AssertionError("Run All Cells did not start the notebook")


def test_notebook_runs_and_widgets_answer_clicks(lab, tmp_path):
    playwright = pytest.importorskip("playwright.sync_api")
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1500, "height": 1000})
        try:
            page.set_default_timeout(60_000)
            page.goto(lab)
            page.wait_for_selector(".jp-Notebook .jp-Cell")
            _run_all_cells(page)
            page.wait_for_selector(f".jp-OutputArea-output:has-text('{DONE}')", timeout=90_000)
            cells = page.locator(".jp-Notebook .jp-Cell")
            dashboard = cells.nth(6).locator(".jp-OutputArea-output")
            header = dashboard.locator(".widget-html").first
            header.wait_for()
            before = _text(header)
            assert "no steps yet" not in before and "2 waiting" in before
            dashboard.locator("button", has_text=re.compile(r"^Add request$")).click()  # a made-up id
            added = dashboard.locator(".wb-added", has_text="added ").first
            added.wait_for()
            made_up = re.search(r"added (\S+):", _text(added)).group(1)
            page.wait_for_function("el => el.innerText.includes('3 waiting')", arg=header.element_handle())
            queues = dashboard.locator(".widget-html", has_text="added since").first
            assert made_up in _text(queues)  # the player shows it at once, not "waiting: none"
            before = _text(header)
            dashboard.locator("button", has_text=re.compile(r"^Step$")).click()
            page.wait_for_function(
                "([el, old]) => el.innerText !== old", arg=[header.element_handle(), before], timeout=30_000)
            after = _text(header)
            steps = [int(m) for m in re.findall(r"last step (\d+)", before + " " + after)]
            assert len(steps) == 2 and steps[1] == steps[0] + 1, (before, after)
            assert "ready" in _text(dashboard.locator(".widget-html", has_text="ready").first)
            page.wait_for_function("el => /Step \\d+:/.test(el.innerText)", arg=dashboard.last.element_handle())
            check_colours_and_labels(dashboard.last.element_handle())  # req-0, req-1 and ui-0: three colours
            assert len({t for t, _ in dashboard.last.element_handle().evaluate(CHIPS)}) >= 3

            player = cells.nth(4).locator(".jp-OutputArea-output")
            shown = _readout_is_the_step(player)  # opened with show(k): the slider says k too
            position = player.locator(".widget-html", has_text=" of ").first
            text = _text(position)
            player.locator(".noUi-handle").first.focus()
            page.keyboard.press("ArrowLeft")
            page.wait_for_function(
                "([el, old]) => el.innerText !== old", arg=[position.element_handle(), text], timeout=30_000)
            assert _readout_is_the_step(player) == shown - 1

            player.locator(".noUi-target").first.scroll_into_view_if_needed()
            handle = player.locator(".noUi-handle").first.bounding_box()
            track = player.locator(".noUi-target").first.bounding_box()
            text = _text(position)
            middle = handle["x"] + handle["width"] / 2
            far = 0.9 if middle < track["x"] + track["width"] / 2 else 0.1  # the other end of the track
            page.mouse.move(middle, handle["y"] + handle["height"] / 2)
            page.mouse.down()
            page.mouse.move(track["x"] + track["width"] * far, handle["y"] + handle["height"] / 2, steps=8)
            page.mouse.up()
            page.wait_for_function(
                "([el, old]) => el.innerText !== old", arg=[position.element_handle(), text], timeout=30_000)
            page.wait_for_timeout(500)
            dragged = _readout_is_the_step(player)
            assert dragged != shown - 1

            player.locator(".noUi-handle").first.focus()
            for _ in range(abs(shown - dragged)):  # back to the preemption step for the screenshot
                page.keyboard.press("ArrowRight" if dragged < shown else "ArrowLeft")
            page.wait_for_function("([el, text]) => el.innerText.includes(text)",
                                   arg=[position.element_handle(), f"step {shown} of"], timeout=30_000)
            # the step's preemption is told again (the why notes: who lost which blocks)
            player.locator(".widget-html", has_text="lost blocks").first.wait_for(timeout=30_000)
            assert _readout_is_the_step(player) == shown
            check_colours_and_labels(cells.nth(2).element_handle())
            check_colours_and_labels(player.element_handle())
            spec = cells.nth(8).locator(".jp-OutputArea-output")  # drafts marked in text and colour
            _readout_is_the_step(spec)
            for fate, mark in (("accepted", "✓"), ("rejected", "✕"), ("recovered", "↳")):
                assert _text(spec.locator(f".wb-draft-{fate}").first).startswith(mark), fate
            assert "✓" in _text(spec.locator(".wb-slots").first)
            check_colours_and_labels(spec.element_handle())

            small = [scale for scale in page.evaluate(FIGURE_SCALES) if scale[0] < 0.5]
            assert not small, small  # e.g. the three-config CDF squeezed beside its table
            comparison = cells.nth(5).locator(".jp-Cell-outputArea")
            area = comparison.bounding_box()
            for select in comparison.locator("select:visible").all():  # "CDF of" is not cut off
                box = select.bounding_box()
                assert box["x"] + box["width"] <= area["x"] + area["width"] + 1, (box, area)

            grammar = cells.nth(7).locator(".jp-OutputArea-output")  # the last step: the end forced
            assert re.search(r"grammar mask\s.*\bforced\b", _text(grammar), re.S), _text(grammar)

            errors = page.locator(
                ".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr'], "
                ".jp-OutputArea-output:has-text('Traceback'), :text('Error displaying widget'), "
                ":text('Failed to load model class')")
            assert errors.count() == 0, [errors.nth(i).inner_text() for i in range(errors.count())]
            assert page.locator(".widget-html:has-text('✗')").count() == 0
            assert page.locator(".jp-Notebook .widget-image").count() >= 4
            shots = DOCS if os.environ.get("WORKBENCH_SCREENSHOTS") == "1" else tmp_path
            page.set_viewport_size({"width": 1500, "height": 2600})  # tall: no output is cut at the fold
            for index, name in SHOTS.items():
                output = cells.nth(index).locator(".jp-Cell-outputArea")
                output.scroll_into_view_if_needed()
                output.screenshot(path=str(shots / name))
            comparison = cells.nth(5).locator(".jp-Cell-outputArea")
            comparison.locator(".lm-TabBar-tab", has_text="Timelines").click()
            comparison.locator(".widget-image").nth(1).wait_for(state="visible")
            comparison.screenshot(path=str(shots / "comparison_timelines.png"))
            assert all((shots / name).stat().st_size > 10_000 for name in [*SHOTS.values(), "comparison_timelines.png"])
        except Exception:
            page.screenshot(path=str(FAILURE_SHOT), full_page=True)
            raise
        finally:
            browser.close()
