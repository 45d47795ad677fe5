"""RouterPlayer: scrub through a cluster run's routing decisions; at decision k see every
candidate replica as the router saw it -- its queue (waiting, running), KV use, the prompt's
prefix it holds, the router's scores -- the choice, and, on request, the regret of the choice
(each alternative's fork: the latency the request would have had there).

The states come from :func:`~workbench.cluster.candidates.candidate_states` (a replay of the
run, made once). One source of truth, as the StepPlayer: the slider's value is the decision
shown; ``show(k)``, the play button and the buttons move it and only its observer draws.
``rows`` holds what decision k shows (one dict per replica), ``regret_rows`` the regret
asked for it (empty until asked). The figure is the widget's own (never pyplot).
"""

from __future__ import annotations

import html

import ipywidgets as widgets
import traitlets

from workbench.cluster.candidates import candidate_states
from workbench.viz.colors import STATE_COLORS, assign_colors, request_color
from workbench.viz.figures import figure_png, new_figure, png_img

PANELS = (("queue", "requests (waiting | running)"), ("kv_usage", "KV use"), ("prefix_match", "prefix held"),
          ("score", "router score"))


class RouterPlayer(widgets.VBox):
    """The routing decisions of ``result`` (a ClusterResult), one at a time."""

    index = traitlets.Int(0)
    rows = traitlets.List()
    regret_rows = traitlets.List()

    def __init__(self, result, candidates=None) -> None:
        self.result = result
        self.candidates = candidate_states(result) if candidates is None else candidates
        self.num_replicas = len(result.replicas)
        self.score_columns = [c for c in self.candidates.columns if c.startswith("score_")]
        #: The score drawn: the router's combined one if it has it, else its first.
        self.score = next((c for c in ("score_total", "score_match", "score_prefix") if c in self.score_columns),
                          self.score_columns[0] if self.score_columns else None)
        assign_colors(d["request_id"] for d in result.decision_rows)
        n = len(result.decision_rows)
        self.slider = widgets.IntSlider(value=0, min=0, max=max(n - 1, 0), description="decision",
                                        continuous_update=False, layout=widgets.Layout(width="420px"))
        self.play = widgets.Play(interval=700, min=0, max=max(n - 1, 0))
        widgets.link((self.play, "value"), (self.slider, "value"))  # in the kernel: one value
        self.back = widgets.Button(description="previous", layout=widgets.Layout(width="90px"))
        self.forward = widgets.Button(description="next", layout=widgets.Layout(width="90px"))
        self.regret_button = widgets.Button(description="regret of this choice",
                                            tooltip="run every alternative's fork (simulated or step clock)",
                                            layout=widgets.Layout(width="170px"))
        self.back.on_click(lambda _: self.show(self.slider.value - 1))
        self.forward.on_click(lambda _: self.show(self.slider.value + 1))
        self.regret_button.on_click(lambda _: self.ask_regret())
        self.heading = widgets.HTML()
        self.table = widgets.HTML()
        self.regret_view = widgets.HTML()
        self.figure = new_figure(10, 2.4)
        self.image = widgets.Image(format="png")
        self.slider.observe(lambda change: self._draw(change["new"]), names="value")
        super().__init__([widgets.HBox([self.play, self.slider, self.back, self.forward, self.regret_button]),
                          self.heading, self.image, self.table, self.regret_view])
        self._draw(0)

    def show(self, k: int) -> None:
        """Show decision ``k`` (clamped to the run's decisions)."""
        self.slider.value = min(max(int(k), 0), self.slider.max)

    # ------------------------------------------------------------ drawing
    def _draw(self, k: int) -> None:
        if not self.result.decision_rows:
            self.heading.value = "<i>no decisions: the run routed no request</i>"
            return
        self.index = k
        decision = self.result.decision_rows[k]
        frame = self.candidates[self.candidates["decision"] == k]
        self.rows = frame.to_dict("records")
        self.regret_rows = []
        self.regret_view.value = ""
        rid, chosen = decision["request_id"], decision["replica"]
        forced = "" if decision["router_choice"] == chosen else (
            f" (forced; the router said {decision['router_choice']})")
        unit = "step" if self.result.clock == "steps" else "s"
        self.heading.value = (
            f"<b>decision {k} of {len(self.result.decision_rows)}</b>: "
            f"<span style='color:{request_color(rid)}'>&#9632;</span> {html.escape(rid)} arrives at "
            f"{decision['arrival']:.4g} {unit}, {self.rows[0]['prompt_tokens']} prompt tokens; "
            f"{html.escape(self.result.router)} sends it to <b>replica {chosen}</b>{forced}")
        self._plot(chosen)
        self.table.value = self._table(chosen)

    def _plot(self, chosen: int) -> None:
        fig = self.figure
        fig.clear()
        axes = fig.subplots(1, len(PANELS))
        replicas = [r["replica"] for r in self.rows]
        edge = ["black" if r == chosen else "none" for r in replicas]
        for ax, (key, title) in zip(axes, PANELS):
            if key == "queue":
                waiting = [r["num_waiting"] for r in self.rows]
                running = [r["num_running"] for r in self.rows]
                ax.bar(replicas, running, color="0.35", edgecolor=edge, label="running")
                ax.bar(replicas, waiting, bottom=running, color=STATE_COLORS["waiting"], edgecolor=edge,
                       label="waiting")
                ax.legend(fontsize="x-small", loc="upper right")
            else:
                column = self.score if key == "score" else key
                if column is None:
                    ax.text(0.5, 0.5, "no scores", ha="center", va="center", transform=ax.transAxes)
                else:
                    values = [r[column] if r[column] is not None else 0.0 for r in self.rows]
                    ax.bar(replicas, values, color=["0.35" if r == chosen else "0.75" for r in replicas],
                           edgecolor=edge)
                    if key != "score":
                        ax.set_ylim(0, 1)
                    else:
                        title = f"router: {column.removeprefix('score_')}"
            ax.set_title(title, fontsize="small")
            ax.set_xticks(replicas, [str(r) for r in replicas], fontsize="x-small")
            ax.set_xlabel("replica", fontsize="x-small")
        self.image.value = figure_png(fig)

    def _table(self, chosen: int) -> str:
        heads = ["replica", "waiting", "running", "KV use", "prefix held", *[c.removeprefix("score_")
                                                                          for c in self.score_columns]]
        lines = ["<table><tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in heads) + "</tr>"]
        for r in self.rows:
            cells = [r["replica"], r["num_waiting"], r["num_running"], f"{r['kv_usage']:.2f}",
                     f"{r['prefix_match']:.2f} ({r['cached_tokens']} tok)",
                     *[("" if r[c] is None else f"{r[c]:.3g}") for c in self.score_columns]]
            style = " style='font-weight:bold'" if r["replica"] == chosen else ""
            lines.append(f"<tr{style}>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
        return "".join(lines) + "</table>"

    # ------------------------------------------------------------ regret
    def ask_regret(self) -> None:
        """Fork the run once per alternative replica for the decision shown; show the deltas."""
        decision = self.result.decision_rows[self.slider.value]
        try:
            frame = self.result.regret(request_ids=[decision["request_id"]])
        except ValueError as error:  # a real cluster on the wall clock does not repeat
            self.regret_view.value = f"<i>{html.escape(str(error))}</i>"
            return
        self.regret_rows = frame.to_dict("records")
        unit = "steps" if self.result.clock == "steps" else "s"
        cells = "".join(
            f"<tr><td>{r['alternative']}</td><td>{r['ttft_delta']:+.4g}</td><td>{r['e2e_delta']:+.4g}</td>"
            f"<td>{r['mean_e2e_delta']:+.4g}</td></tr>" for r in self.regret_rows)
        best = min(self.regret_rows, key=lambda r: r["e2e_delta"], default=None)
        verdict = ("" if best is None else
                   f"regret {max(0.0, -best['e2e_delta']):.4g} {unit} (best alternative: replica {best['alternative']})")
        self.regret_view.value = (f"<b>{verdict}</b><table><tr><th>sent to</th><th>TTFT &Delta; {unit}</th>"
                                  f"<th>E2E &Delta; {unit}</th><th>mean E2E &Delta; (all)</th></tr>{cells}</table>")

    def _repr_html_(self) -> str:
        return f"<div>{self.heading.value}{png_img(self.image.value)}{self.table.value}</div>"
