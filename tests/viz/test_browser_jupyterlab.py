"""The views in a real browser: JupyterLab on loopback, a notebook run in headless Chromium.

Widget callbacks then arrive over the real comm (on a second kernel thread with JupyterLab's
default "Kernel Comms over subshells"), which kernel-level tests never exercise. The test runs
the notebook, clicks Step in the dashboard, moves the player's slider with the keyboard,
checks that the views changed and that no cell or widget shows an error, and saves the
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
    "from workbench import Workload\n"
    "workload = Workload.burst(num_requests=5, input_len=(12, 32), output_len=(4, 8), seed=4)\n"
    "result = engine.replay(workload)\nresult",
    "from workbench.viz import BlockMap, RequestTimeline, StepPlayer\n"
    "busiest = max(result.history, key=lambda r: r.kv_usage).step\n"
    "block_map = BlockMap(result, step=busiest)\n"
    "block_map.select_request(block_map.cells[0]['owners'][0])\n"
    "block_map",
    "RequestTimeline(result)",
    "player = StepPlayer(result)\n"
    "player.slider.value = next(r.step for r in result.history if r.scheduler_output.preempted_request_ids)\n"
    "player",
    "%llm compare workload --policies fcfs spf",
    "%llm add ROMEO: --max-tokens 12\n%llm add 'JULIET:\\nO Romeo, Romeo!' --max-tokens 12\n%llm dashboard",
    f"print({DONE!r})",
]
SHOTS = {2: "block_map.png", 3: "timeline.png", 4: "player.png", 5: "comparison.png", 6: "dashboard.png"}

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
            dashboard.locator("button", has_text=re.compile(r"^Step$")).click()
            page.wait_for_function(
                "([el, old]) => el.innerText !== old", arg=[header.element_handle(), before], timeout=30_000)
            after = _text(header)
            steps = [int(m) for m in re.findall(r"last step (\d+)", before + " " + after)]
            assert len(steps) == 2 and steps[1] == steps[0] + 1, (before, after)
            assert "ready" in _text(dashboard.locator(".widget-html", has_text="ready").first)

            player = cells.nth(4).locator(".jp-OutputArea-output")
            position = player.locator(".widget-html", has_text="of ").first
            shown = _text(position)
            player.locator(".noUi-handle").first.focus()
            page.keyboard.press("ArrowLeft")
            page.wait_for_function(
                "([el, old]) => el.innerText !== old", arg=[position.element_handle(), shown], timeout=30_000)
            old_step = int(re.search(r"step (\d+)", shown).group(1))
            new_step = int(re.search(r"step (\d+)", _text(position)).group(1))
            assert new_step == old_step - 1

            player.locator(".noUi-handle").first.focus()
            page.keyboard.press("ArrowRight")  # back to the preemption step for the screenshot
            page.wait_for_function(
                "([el]) => el.innerText.includes('lost blocks')",
                arg=[player.locator(".widget-html", has_text="preempted").first.element_handle()], timeout=30_000)

            errors = page.locator(
                ".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr'], "
                ".jp-OutputArea-output:has-text('Traceback'), :text('Error displaying widget'), "
                ":text('Failed to load model class')")
            assert errors.count() == 0, [errors.nth(i).inner_text() for i in range(errors.count())]
            assert page.locator(".widget-html:has-text('✗')").count() == 0
            assert page.locator(".jp-Notebook .widget-image").count() >= 4
            shots = DOCS if os.environ.get("WORKBENCH_SCREENSHOTS") == "1" else tmp_path
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
