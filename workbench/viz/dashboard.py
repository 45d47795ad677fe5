"""EngineDashboard: an ipywidgets panel to step a live engine and watch its decisions.

Buttons step the engine; a text box adds requests; the panel redraws the last StepRecord, the
scheduler's queues and the pictures from :mod:`workbench.viz.plots`. It only reads the engine,
except through the engine's own public methods (add_request, step).
"""

from __future__ import annotations

import itertools

import ipywidgets as widgets
import matplotlib.pyplot as plt
from IPython.display import HTML, display

from workbench.sampling_params import SamplingParams
from workbench.viz.plots import plot_kv_blocks, plot_kv_usage, plot_step_tokens


class EngineDashboard:
    """``EngineDashboard(engine).widget`` is the panel; display it in a notebook cell.

    ``read_only=True`` (an engine that a server is stepping) shows only a Refresh button.
    """

    def __init__(
        self, engine, params: SamplingParams | None = None, *, read_only: bool = False
    ) -> None:
        self.engine = engine
        self.params = params or SamplingParams(temperature=0, max_tokens=32)
        self._ids = itertools.count()
        self.outputs: list = []
        self.prompt = widgets.Text(value="ROMEO:", description="prompt")
        add = widgets.Button(description="Add request")
        step = widgets.Button(description="Step")
        run = widgets.Button(description="Run 10 steps")
        finish = widgets.Button(description="Run to the end")
        add.on_click(lambda _: self.add(self.prompt.value))
        step.on_click(lambda _: self.step(1))
        run.on_click(lambda _: self.step(10))
        finish.on_click(lambda _: self.run_to_end())
        self.view = widgets.Output()
        if read_only:
            refresh = widgets.Button(description="Refresh")
            refresh.on_click(lambda _: self.refresh())
            controls = [refresh]
        else:
            controls = [widgets.HBox([self.prompt, add]), widgets.HBox([step, run, finish])]
        self.widget = widgets.VBox([*controls, self.view])
        self.refresh()

    def add(self, prompt: str) -> None:
        self.engine.add_request(f"ui-{next(self._ids)}", prompt, self.params)
        self.refresh()

    def step(self, n: int = 1) -> None:
        for _ in range(n):
            if not self.engine.has_unfinished_requests():
                break
            self.outputs.extend(self.engine.step())
        self.refresh()

    def run_to_end(self, max_steps: int = 10_000) -> None:
        self.step(max_steps)

    def refresh(self) -> None:
        self.view.clear_output(wait=True)
        with self.view:
            if len(self.engine.history):
                display(HTML(self.engine.history[-1]._repr_html_()))
            display(HTML(self.engine.scheduler._repr_html_()))
            fig, axes = plt.subplots(1, 2, figsize=(13, 3), layout="constrained")
            plot_step_tokens(self.engine.history, ax=axes[0])
            plot_kv_usage(self.engine.history, ax=axes[1])
            blocks = plot_kv_blocks(self.engine.kv_cache).figure
            for figure in (fig, blocks):
                display(figure)
                plt.close(figure)  # drawn once, here; not again by the inline backend
            for out in self.outputs[-5:]:
                display(HTML(out._repr_html_()))

    def _ipython_display_(self) -> None:
        display(self.widget)
