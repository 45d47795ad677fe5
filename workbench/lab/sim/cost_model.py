"""CostModel: a step's duration predicted from its batch, fitted by least squares to real steps.

``duration = sum(coefficients[f] * feature f)`` over :data:`~workbench.lab.sim.features.FEATURES`
for a step that runs a batch, ``empty_step_s`` for a step that schedules nothing. Durations
are those of :mod:`workbench.lab.sim.measurements` (engine stages + the driver's share).
Coefficients are non-negative (a cost never pays back). The JSON a model is saved as names
the hardware and model it describes.

The fit is least squares on relative errors (a 1 ms decode step counts as much as a 20 ms
prefill), in two passes: steps far from the first pass's fit (a stall of the machine) are
left out of the second. It describes a typical step: on a shared machine about one step in
ten runs 20-30% long, which adds a few percent to a run's real time (reported by
``fit_stats["total_measured_over_predicted"]``). Fitting the mean instead (least squares
weighted by the predictions) was tried: it carried the calibration period's noise into every
prediction and was further off on fresh workloads.
"""

from __future__ import annotations

import dataclasses
import html
import importlib.resources
import json
import math
import pathlib
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from workbench.core.sched.output import SchedulerOutput
from workbench.engine.history import StepRecord
from workbench.lab.sim.features import FEATURES, step_features
from workbench.lab.sim.lora_slots import LoRASlots
from workbench.lab.sim.measurements import measured_steps, records_of

FORMAT = "workbench-cost-model/1"
#: The shipped calibration: the embedded model on CPU (``workbench calibrate`` made it).
DEFAULT_CALIBRATION = "calibration/tiny-shakespeare-cpu.json"
#: The same machine calibrated with n-gram speculation on (k=4: ``spec_tokens``, ``spec_seqs``).
NGRAM_CALIBRATION = "calibration/tiny-shakespeare-cpu-ngram.json"
#: A fitted step further than this many MADs of the residuals from the first fit is noise
#: (another process took the CPU): it is left out of the second fit (and counted).
OUTLIER_MADS = 6.0
#: The features a prefill costs by (its own step's, and the step after it's):
#: :meth:`CostModel.rescaled_to` fits one factor for them and one for the rest.
PREFILL_FEATURES = ("prefill_step", "prefill_tokens", "prefill_chunks", "prefill_attention", "after_prefill")
UNITS = {"step": "s per step", "prefill_step": "s per step with a prefill", "prefill_tokens": "s per token",
         "prefill_chunks": "s per chunk", "decode_seqs": "s per sequence", "decode_seqs_sqrt": "s per sqrt(sequences)",
         "decode_context": "s per KV token", "prefill_attention": "s per q x k pair",
         "spec_tokens": "s per draft token", "spec_seqs": "s per speculating sequence",
         "lora_tokens": "s per token under an adapter", "lora_adapters": "s per adapter in the batch",
         "lora_loads": "s per adapter loaded into a device slot",
         "after_prefill": "s per step after a step with a prefill"}


@dataclass(frozen=True)
class CostModel:
    """Seconds per unit of each feature (``coefficients``), the cost of an empty step, the
    wake-up cost (``wake_s``: what the first step after the engine sat idle costs on top of its
    batch -- a sleeping driver waking up, cold caches), the input processing of text prompts
    (``input_s``), the hardware and model it was measured on, and the fit's residuals
    (``fit_stats``: steps fitted, outliers left out, R^2, measured / predicted time in total,
    median and p90 absolute relative error per step)."""

    coefficients: Mapping[str, float]
    empty_step_s: float = 0.0
    wake_s: float = 0.0
    #: Input processing of a text prompt (tokenization, validation, block hashes), done by the
    #: driver before the next step: (seconds per request, seconds per prompt token).
    input_s: tuple[float, float] = (0.0, 0.0)
    hardware: Mapping[str, object] = field(default_factory=dict)
    model: Mapping[str, object] = field(default_factory=dict)
    fit_stats: Mapping[str, float] = field(default_factory=dict)
    note: str = ""
    #: Calibrated with async scheduling: its steps' durations are those a driver sees with the
    #: host work of each step hidden under the forward before it (see measurements).
    async_scheduling: bool = False

    def __post_init__(self) -> None:
        unknown = sorted(set(self.coefficients) - set(FEATURES))
        if unknown:
            raise ValueError(f"coefficients: unknown feature(s) {unknown}; known: {list(FEATURES)}.")
        for name, value in self.coefficients.items():
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"coefficients[{name!r}] must be a finite number >= 0, got {value!r}.")
        for name in ("empty_step_s", "wake_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}.")
        input_s = tuple(float(v) for v in self.input_s)
        if len(input_s) != 2 or not all(math.isfinite(v) and v >= 0 for v in input_s):
            raise ValueError(f"input_s must be (seconds per request, seconds per token) >= 0, got {self.input_s!r}.")
        object.__setattr__(self, "input_s", input_s)
        object.__setattr__(self, "coefficients", {f: float(self.coefficients.get(f, 0.0)) for f in FEATURES})
        object.__setattr__(self, "_vector", tuple(self.coefficients[f] for f in FEATURES))

    # ------------------------------------------------------------------ predict
    def predict(self, features) -> float:
        """Seconds for one step: ``features`` is a SchedulerOutput, a StepRecord, a mapping
        feature -> value (missing ones 0) or a sequence in FEATURES order."""
        if isinstance(features, StepRecord):
            features = features.scheduler_output
        if isinstance(features, SchedulerOutput):
            features = step_features(features)
        elif isinstance(features, Mapping):
            unknown = sorted(set(features) - set(FEATURES))
            if unknown:
                raise ValueError(f"unknown feature(s) {unknown}; known: {list(FEATURES)}.")
            features = tuple(float(features.get(f, 0.0)) for f in FEATURES)
        elif len(features) != len(FEATURES):
            raise ValueError(f"features: expected {len(FEATURES)} values ({list(FEATURES)}), got {len(features)}.")
        if not features[0]:
            return self.empty_step_s
        return sum(c * x for c, x in zip(self._vector, features))

    def input_cost(self, prompt_tokens) -> float:
        """Seconds to process text prompts of ``prompt_tokens`` tokens (a list, one per prompt)."""
        per_request, per_token = self.input_s
        return per_request * len(prompt_tokens) + per_token * sum(prompt_tokens)

    def scaled(self, factor: float, note: str = "") -> CostModel:
        """The same model with every time (coefficients, empty step, wake-up, input) times
        ``factor``: the machine running uniformly ``factor`` x slower."""
        if not (factor > 0 and math.isfinite(factor)):
            raise ValueError(f"factor must be a finite number > 0, got {factor!r}.")
        return dataclasses.replace(
            self, coefficients={f: c * factor for f, c in self.coefficients.items()},
            empty_step_s=self.empty_step_s * factor, wake_s=self.wake_s * factor,
            input_s=tuple(v * factor for v in self.input_s),
            note=note or f"{self.note} (times x{factor:.4g})".strip())

    def rescaled_to(self, history) -> CostModel:
        """The model with two factors fitted to the measured steps of ``history`` (real runs,
        as :meth:`fit` takes): one for the :data:`PREFILL_FEATURES`, one for the rest (fixed
        cost, decode, speculation, LoRA; the empty step, wake-up and input times with it). It
        keeps the model's shape and measures this machine's pace now, a prefill's and a
        decode's apart: another CPU, another thread count or other load moves the two by
        different amounts. Fitted as :meth:`fit` fits (relative least squares, factors >= 0,
        stalls left out); history without a prefill step gives both parts the one factor.
        ``fit_stats`` gains ``rescale_prefill`` and ``rescale_other``."""
        x, y, empty = measured_steps(records_of(history))
        x, y = x[~empty], y[~empty]
        if not len(y):
            raise ValueError("history: no measured step ran a batch; nothing to rescale to.")
        prefill = np.array([f in PREFILL_FEATURES for f in FEATURES])
        coef = np.array(self._vector)
        parts = np.stack([x @ np.where(prefill, coef, 0.0), x @ np.where(prefill, 0.0, coef)], axis=1)
        if not parts[:, 0].any():
            parts = parts.sum(axis=1, keepdims=True)
        factors, _ = robust_relative_fit(parts, y)
        f_prefill, f_other = (float(factors[0]), float(factors[-1]))
        return dataclasses.replace(
            self, coefficients={f: c * (f_prefill if f in PREFILL_FEATURES else f_other)
                                for f, c in self.coefficients.items()},
            empty_step_s=self.empty_step_s * f_other, wake_s=self.wake_s * f_other,
            input_s=tuple(v * f_other for v in self.input_s),
            fit_stats={**self.fit_stats, "rescale_prefill": f_prefill, "rescale_other": f_other},
            note=f"{self.note} (rescaled to measured steps: prefill x{f_prefill:.4g}, the rest x{f_other:.4g})".strip())

    def predict_many(self, features: np.ndarray) -> np.ndarray:
        """Seconds per row of a ``[n, len(FEATURES)]`` feature matrix."""
        out = np.asarray(features, dtype=np.float64) @ np.array(self._vector)
        return np.where(features[:, 0] > 0, out, self.empty_step_s)

    # ------------------------------------------------------------------ fit
    @classmethod
    def fit(cls, history, *, hardware: Mapping | None = None, model: Mapping | None = None,
            note: str = "", max_loras: int | None = None) -> CostModel:
        """Least squares (non-negative, on relative errors) of measured step durations on the
        batch features.

        ``history``: a StepHistory, a RunResult, or a list of them, of real runs (see
        :mod:`workbench.lab.sim.measurements`). Steps far from the first fit (noise) are left out
        of the second; ``fit_stats`` reports the residuals over every non-empty step.
        ``hardware`` defaults to this machine's description (CPU). ``max_loras``: the engine's,
        to count adapter loads (one engine's steps in order, nothing pinned; None: no loads).
        """
        records = records_of(history)
        if any("simulated" in r.timings for r in records):
            raise ValueError("history: these steps were simulated, not measured; fit a real run's history.")
        x, y, empty = measured_steps(records, LoRASlots(max_loras) if max_loras else None)
        return cls.fit_measured(x[~empty], y[~empty], y[empty], hardware=hardware, model=model, note=note)

    @classmethod
    def fit_measured(cls, x: np.ndarray, y: np.ndarray, empty_y: np.ndarray = (), *,
                     hardware: Mapping | None = None, model: Mapping | None = None, note: str = "") -> CostModel:
        """:meth:`fit` on measurements: features ``x [n, F]`` and seconds ``y [n]`` of steps
        that ran a batch, seconds of empty steps ``empty_y``."""
        x, y, empty_y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64), np.asarray(empty_y)
        if len(y) < len(FEATURES):
            raise ValueError(f"history: {len(y)} non-empty measured steps; at least {len(FEATURES)} are needed "
                             "(and batches that vary: see `workbench calibrate`).")
        if (y <= 0).any():
            raise ValueError("history: a step with a duration <= 0 s cannot be fitted.")
        coef, keep = robust_relative_fit(x, y)
        stats = _residual_stats(y, x @ coef)
        stats["num_outliers"] = int((~keep).sum())
        return cls(
            coefficients=dict(zip(FEATURES, (float(c) for c in coef))),
            empty_step_s=float(np.median(empty_y)) if len(empty_y) else 0.0,
            hardware=dict(hardware) if hardware is not None else describe_hardware(),
            model=dict(model or {}),
            fit_stats=stats,
            note=note,
        )

    # ------------------------------------------------------------------ files
    def to_json(self) -> dict:
        return {
            "format": FORMAT,
            "coefficients": dict(self.coefficients),
            "units": {f: UNITS[f] for f in FEATURES},
            "empty_step_s": self.empty_step_s,
            "wake_s": self.wake_s,
            "input_s": list(self.input_s),
            "hardware": dict(self.hardware),
            "model": dict(self.model),
            "fit_stats": dict(self.fit_stats),
            "note": self.note,
            "async_scheduling": self.async_scheduling,
        }

    def save(self, path) -> pathlib.Path:
        path = pathlib.Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=2) + "\n")
        return path

    @classmethod
    def load(cls, path) -> CostModel:
        """A model saved by :meth:`save`. FileNotFoundError / ValueError name the file."""
        path = pathlib.Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"cost model file {str(path)!r} not found (make one with `workbench calibrate --output`).")
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"cost model file {str(path)!r} is not JSON: {e}") from None
        return cls.from_json(data, source=str(path))

    @classmethod
    def from_json(cls, data: Mapping, source: str = "cost model") -> CostModel:
        if not isinstance(data, Mapping) or data.get("format") != FORMAT:
            raise ValueError(f"{source}: not a cost model (expected \"format\": {FORMAT!r}).")
        if not isinstance(data.get("coefficients"), Mapping):
            raise ValueError(f"{source}: \"coefficients\" must be an object of feature -> seconds.")
        try:
            return cls(coefficients=data["coefficients"], empty_step_s=float(data.get("empty_step_s", 0.0)),
                       wake_s=float(data.get("wake_s", 0.0)),
                       input_s=tuple(data.get("input_s", (0.0, 0.0))),
                       hardware=data.get("hardware", {}), model=data.get("model", {}),
                       fit_stats=data.get("fit_stats", {}), note=data.get("note", ""),
                       async_scheduling=bool(data.get("async_scheduling", False)))
        except (ValueError, TypeError) as e:
            raise ValueError(f"{source}: {e}") from None

    @classmethod
    def default(cls, calibration: str = DEFAULT_CALIBRATION) -> CostModel:
        """A shipped calibration of the embedded model on CPU (``NGRAM_CALIBRATION``: with
        speculation on)."""
        resource = importlib.resources.files("workbench.data").joinpath(calibration)
        with importlib.resources.as_file(resource) as path:
            return cls.load(path)

    # ------------------------------------------------------------------ reprs
    def _describe(self) -> tuple[str, str]:
        model = self.model.get("name", "?")
        hw = self.hardware.get("gpu") or self.hardware.get("cpu", "?")
        return str(model), str(hw)

    def __repr__(self) -> str:
        model, hw = self._describe()
        coefs = ", ".join(f"{f}={self.coefficients[f]:.3g}" for f in FEATURES)
        fit = ", ".join(f"{k}={v:.3g}" for k, v in self.fit_stats.items())
        return f"CostModel(model={model}, hardware={hw}, {coefs}, empty_step_s={self.empty_step_s:.3g}, " \
            f"wake_s={self.wake_s:.3g}, input_s=({self.input_s[0]:.3g}, {self.input_s[1]:.3g})" + \
            (f", fit: {fit}" if fit else "") + ")"

    def _repr_html_(self) -> str:
        model, hw = self._describe()
        rows = "".join(f"<tr><td>{f}</td><td>{self.coefficients[f]:.4g}</td><td>{UNITS[f]}</td></tr>"
                       for f in FEATURES)
        rows += f"<tr><td>empty step</td><td>{self.empty_step_s:.4g}</td><td>s</td></tr>"
        rows += f"<tr><td>wake-up after idle</td><td>{self.wake_s:.4g}</td><td>s</td></tr>"
        rows += (f"<tr><td>text prompt input</td><td>{self.input_s[0]:.4g} + {self.input_s[1]:.4g} x tokens</td>"
                 "<td>s</td></tr>")
        fit = "".join(f"<tr><th>{html.escape(k)}</th><td>{v:.4g}</td></tr>" for k, v in self.fit_stats.items())
        return (f"<b>CostModel</b> of {html.escape(model)} on {html.escape(hw)}"
                f"<table><tr><th>feature</th><th>coefficient</th><th>unit</th></tr>{rows}</table>"
                + (f"<b>fit</b><table>{fit}</table>" if fit else "")
                + (f"<i>{html.escape(self.note)}</i>" if self.note else ""))


def robust_relative_fit(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Coefficients >= 0 of ``y ~ x @ coef`` by least squares on relative errors, in two passes:
    rows further than OUTLIER_MADS from the first fit (a stall of the machine) are left out of
    the second (unless too few would be left). Returns ``(coef, keep)``."""
    # Relative least squares (each row divided by its duration): a 1 ms decode step counts
    # as much as a 20 ms prefill, as in the per-request errors the simulation is judged by.
    rows = x / y[:, None]
    coef = nonnegative_lstsq(rows, np.ones_like(y))
    residuals = (x @ coef - y) / y
    mad = float(np.median(np.abs(residuals - np.median(residuals)))) or 1e-12
    keep = np.abs(residuals) <= OUTLIER_MADS * mad * 1.4826
    if keep.sum() >= x.shape[1]:
        coef = nonnegative_lstsq(rows[keep], np.ones(int(keep.sum())))
    return coef, keep


def nonnegative_lstsq(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with coefficients >= 0: features whose coefficient comes out negative
    are fixed at 0 one at a time (the most negative first) and the rest refitted."""
    active = list(range(x.shape[1]))
    coef = np.zeros(x.shape[1])
    while active:
        # Scale columns so that seconds-per-token and seconds-per-pair are fitted alike.
        scale = np.abs(x[:, active]).max(axis=0)
        scale[scale == 0] = 1.0
        sol, *_ = np.linalg.lstsq(x[:, active] / scale, y, rcond=None)
        sol = sol / scale
        if (sol >= 0).all():
            coef[active] = sol
            break
        active.pop(int(np.argmin(sol)))
    return coef


def _residual_stats(actual: np.ndarray, predicted: np.ndarray) -> dict[str, float]:
    ss_res = float(((actual - predicted) ** 2).sum())
    ss_tot = float(((actual - actual.mean()) ** 2).sum())
    rel = np.abs(predicted - actual) / actual
    ratio = actual / np.maximum(predicted, 1e-12)
    return {
        "num_steps": int(len(actual)),
        "r2": 1.0 - ss_res / ss_tot if ss_tot > 0 else math.nan,
        "total_measured_over_predicted": float(actual.sum() / predicted.sum()) if predicted.sum() > 0 else math.nan,
        "median_abs_rel_err": float(np.median(rel)),
        "p90_abs_rel_err": float(np.quantile(rel, 0.9)),
        "ratio_p10": float(np.quantile(ratio, 0.1)),  # measured / predicted: the prediction band
        "ratio_p90": float(np.quantile(ratio, 0.9)),
    }


def describe_hardware(device=None) -> dict[str, object]:
    """The CPU (model name, threads torch uses), the GPU when ``device`` is CUDA, torch's version."""
    import platform

    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    out: dict[str, object] = {"cpu": cpu, "threads": torch.get_num_threads(), "torch": torch.__version__}
    device = torch.device(device or "cpu")
    if device.type == "cuda":
        out["gpu"] = torch.cuda.get_device_name(device)
    out["device"] = device.type
    return out


def describe_model(model_config, *, block_size: int, attention_backend: str) -> dict[str, object]:
    """Name, architecture, dtype and the shapes that set a step's cost."""
    mc = model_config
    return {
        "name": mc.path.name, "architecture": mc.architecture, "dtype": str(mc.dtype).removeprefix("torch."),
        "num_layers": mc.num_layers, "hidden_size": mc.hidden_size, "num_heads": mc.num_heads,
        "num_kv_heads": mc.num_kv_heads, "head_dim": mc.head_dim, "intermediate_size": mc.intermediate_size,
        "vocab_size": mc.vocab_size,
        "block_size": block_size, "attention_backend": attention_backend,
    }


def as_cost_model(cost_model: CostModel | str | pathlib.Path | None) -> CostModel:
    """A CostModel from one, a JSON path, or None (the shipped default)."""
    if cost_model is None:
        return CostModel.default()
    if isinstance(cost_model, CostModel):
        return cost_model
    if isinstance(cost_model, (str, pathlib.Path)):
        return CostModel.load(cost_model)
    raise ValueError(f"cost_model must be a CostModel, a path to its JSON or None, got {type(cost_model).__name__}.")

