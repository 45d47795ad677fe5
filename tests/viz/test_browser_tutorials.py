"""The tutorials open cleanly in JupyterLab (headless Chromium), as a reader first sees them.

nbval (``pytest --nbval``) runs every tutorial and compares its outputs; this test opens the
stored notebooks in a real JupyterLab and checks what a reader sees before running anything:
every cell rendered, no error or stderr output, no widget that fails to display from the
widget state stored with the notebook, every stored player naming the step it was left at (a
live widget, whose slider must agree, or -- what JupyterLab shows without a kernel -- its
stored HTML snapshot), distinct colours for distinct request ids, no figure below half its
size. With ``WORKBENCH_SCREENSHOTS=1`` it saves tutorial 01's player and tutorial 03's block
map into docs/. Skips only when chromium is absent (CI installs it).
"""

import json
import os
import pathlib
import re
import shutil

import pytest

from lab_support import start_lab
from test_browser_jupyterlab import CHROMIUM, DOCS, FIGURE_SCALES, check_colours_and_labels

#: (notebook prefix, text of the cell whose output is shot, file in docs/)
SHOTS = [("01", "player = StepPlayer(engine", "tutorial_player.png"),
         ("03", "plot_kv_blocks(engine.kv_cache", "tutorial_block_map.png")]
NOTEBOOKS = sorted((pathlib.Path(__file__).resolve().parents[2] / "notebooks").glob("[0-9][0-9]_*.ipynb"))



def cells_with_players(path: pathlib.Path) -> list[int]:
    """Indices of the cells that build a player (``StepPlayer(`` / ``RouterPlayer(``) whose stored
    output is a widget holding a play button, read from the notebook's stored widget state."""
    nb = json.loads(path.read_text())
    state = nb["metadata"].get("widgets", {}).get("application/vnd.jupyter.widget-state+json", {}).get("state", {})

    def has_play(model_id: str, seen: set) -> bool:
        model = state.get(model_id)
        if model is None or model_id in seen:
            return False
        seen.add(model_id)
        if model.get("model_name") == "PlayModel":
            return True
        refs = re.findall(r"IPY_MODEL_([0-9a-f]+)", json.dumps(model.get("state", {})))
        return any(has_play(ref, seen) for ref in refs)

    return [i for i, cell in enumerate(nb["cells"]) for out in cell.get("outputs", [])
            if "Player(" in "".join(cell["source"]) and has_play(out.get("data", {}).get("application/vnd.jupyter.widget-view+json", {}).get("model_id", ""), set())]


pytestmark = pytest.mark.skipif(
    not os.path.exists(CHROMIUM), reason="chromium is not installed (CI installs it: apt-get install chromium)"
)


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    root = tmp_path_factory.mktemp("tutorials")
    for path in NOTEBOOKS:
        shutil.copy(path, root / path.name)
    with start_lab(root) as (url, token):
        yield url, token


def test_every_tutorial_opens_without_errors(lab, tmp_path):
    playwright = pytest.importorskip("playwright.sync_api")
    url, token = lab
    sources = sorted((NOTEBOOKS[0].parent / "src").glob("[0-9][0-9]_*.py"))
    assert [n.stem for n in NOTEBOOKS] == [s.stem for s in sources]  # every tutorial, built
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.set_default_timeout(60_000)
        try:
            for path in NOTEBOOKS:
                page.goto(f"{url}/lab/tree/{path.name}?reset&token={token}")  # reset: only this one open
                notebook = page.locator(".jp-Notebook:visible")
                notebook.locator(".jp-Cell").first.wait_for()
                page.wait_for_timeout(1500)  # let the stored widget views render
                errors = notebook.locator(
                    ".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr'], "
                    ".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.error']"
                )
                assert errors.count() == 0, f"{path.name}: {errors.first.inner_text()[:500]}"
                text = notebook.inner_text()
                for failure in ("Error displaying widget", "Traceback (most recent call last)"):
                    assert failure not in text, f"{path.name} shows {failure!r}"
                figures = notebook.locator(".jp-OutputArea-output img")
                assert figures.count() > 0 or path.name.startswith("06"), f"{path.name} shows no figure"
                small = [scale for scale in page.evaluate(FIGURE_SCALES) if scale[0] < 0.5]
                assert not small, f"{path.name}: figures shown below half their size: {small}"
                check_colours_and_labels(notebook.element_handle())
                for index in cells_with_players(path):  # each stored player shows the step it was left at
                    output = notebook.locator(".jp-Cell").nth(index).locator(".jp-Cell-outputArea")
                    output.scroll_into_view_if_needed()
                    output.get_by_text(re.compile(r"(?:step|decision) \d+ of")).first.wait_for()
                    shown = re.search(r"(?:step|decision) (\d+) of", output.inner_text()).group(1)
                    live = output.locator(".widget-vbox:has(> .widget-hbox .widget-play)")
                    if live.count():  # a live widget (not its stored snapshot): the slider agrees
                        readout = live.first.locator(".widget-readout").first.inner_text()
                        assert readout == shown, f"{path.name}: the slider reads {readout}, the player shows {shown}"
                for prefix, code, name in SHOTS:
                    if path.name.startswith(prefix):
                        cell = notebook.locator(".jp-Cell", has_text=code).first
                        cell.scroll_into_view_if_needed()
                        shots = DOCS if os.environ.get("WORKBENCH_SCREENSHOTS") == "1" else tmp_path
                        cell.locator(".jp-Cell-outputArea").screenshot(path=str(shots / name))
        finally:
            browser.close()
