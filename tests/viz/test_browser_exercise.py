"""An exercise in JupyterLab (headless Chromium): a learner's wrong admission loop is checked,
and ``result.show()`` shows the engine's batch beside theirs above the StepPlayer, opened at
the first wrong step (worked by hand in tests/exercises/test_admission.py: step 1)."""

import os
import re

import nbformat
import pytest
from lab_support import start_lab
from test_browser_jupyterlab import CHROMIUM, _readout_is_the_step, _run_all_cells, _text

CELLS = [
    "import workbench.exercises as ex\nfrom workbench.exercises.batching import BatchWorkload",
    '''def schedule(running, waiting, max_num_batched_tokens, max_num_seqs):
    budget, batch = max_num_batched_tokens, []
    for r in running:
        n = min(r.num_tokens - r.num_computed_tokens, budget)
        if n:
            batch.append((r.request_id, n))
            budget -= n
    for r in waiting[: max_num_seqs - len(running)]:
        if r.num_tokens >= budget:  # off by one: a prompt that fits exactly waits
            break
        batch.append((r.request_id, r.num_tokens))
        budget -= r.num_tokens
    return batch''',
    'result = ex.check("admission", schedule, workloads=[BatchWorkload(8, 4, (("r0", 0, 5, 3), ("r1", 1, 7, 2)))])\n'
    "print(result.first_wrong_step)",
    "result.show()",
]

pytestmark = pytest.mark.skipif(
    not os.path.exists(CHROMIUM), reason="chromium is not installed (CI installs it: apt-get install chromium)"
)


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    root = tmp_path_factory.mktemp("exercise")
    notebook = nbformat.v4.new_notebook()
    notebook.cells = [nbformat.v4.new_code_cell(src) for src in CELLS]
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(notebook, root / "exercise.ipynb")
    with start_lab(root) as (url, token):
        yield f"{url}/lab/tree/exercise.ipynb?token={token}"


@pytest.mark.slow  # JupyterLab and Chromium
def test_a_wrong_solution_opens_the_player_at_its_first_wrong_step(lab):
    playwright = pytest.importorskip("playwright.sync_api")
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.set_default_timeout(60_000)
        try:
            page.goto(lab)
            page.wait_for_selector(".jp-Notebook .jp-Cell")
            _run_all_cells(page)
            cells = page.locator(".jp-Notebook .jp-Cell")
            view = cells.nth(3).locator(".jp-OutputArea-output")
            table = view.locator(".widget-html", has_text="engine (reference)").first
            table.wait_for(timeout=120_000)
            assert _text(cells.nth(2).locator(".jp-OutputArea-output")).strip() == "1"
            rows = _text(table)
            assert "step 1: tokens per request" in rows
            assert re.search(r"r1 \(waiting, 0/7 computed\)\s+7\s+-", rows), rows  # the engine 7, yours nothing
            assert _readout_is_the_step(view) == 1
        finally:
            browser.close()
