"""Workload: a reproducible set of requests with arrival schedules, to replay on engines.

A :class:`Workload` is a tuple of :class:`WorkloadRequest` (id, prompt as text or token ids,
SamplingParams, arrival step and/or arrival time, priority) and the clock its arrivals are
counted on, ``workload.clock``:

* ``"steps"`` (the default everywhere): a request arrives before engine step ``arrival_step``;
  a generator's ``rate`` is arrivals per step, its ``interval`` steps;
* ``"wall"``: a request arrives ``arrival_time`` seconds after the start; ``rate`` is
  arrivals per second, ``interval`` seconds.

``run_workload``, ``simulate``, ``compare_runs``, ``sweep`` and ``replay_workload`` run a
workload on its own clock; asking one of them for the other clock is a ValueError (a rate of 6
per step and one of 6 per second are different experiments): build the workload for that
clock (``Workload.poisson(..., clock="wall")``), or say explicitly that its numbers are to be
read in the other unit with :meth:`Workload.on_clock`.

Generators build workloads from a seed, so the same arguments give the same workload on any
machine:

* :meth:`Workload.poisson` -- a Poisson process of ``rate`` arrivals per unit of the clock;
* :meth:`Workload.burst` -- groups of requests arriving together;
* :meth:`Workload.from_trace` -- a production trace's arrivals and lengths (wall clock,
  :mod:`workbench.lab.traces`), prompts of the corpus' token ids.

:meth:`Workload.at_rate` rescales any workload's arrivals to another mean rate.

A generated request carries its draw ``t`` (in the clock's unit) twice: as ``arrival_time``
and as ``arrival_step = floor(t)``; a run reads the field of the workload's clock only.

Prompt lengths, output lengths, priorities and groups sharing a prefix are drawn from the
seed too. Text prompts are cut from the embedded Shakespeare corpus to the exact token length
the engine will see (:mod:`workbench.lab.corpus_prompts`); ``text=False`` gives token ids.
Outputs have exact lengths: ``max_tokens`` with ``ignore_eos``.
"""

from __future__ import annotations

import dataclasses
import enum
import html
import json
import math
import pathlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from workbench.lab.replay import CLOCKS
from workbench.lab import traces
from workbench.lab.corpus_prompts import PromptCutter, encode
from workbench.lab.token_ids import TokenIds
from workbench.lora.request import LoRARequest
from workbench.sampling_params import RequestOutputKind, SamplingParams
from workbench.utils.heap import rare_collections

#: A length spec: an exact length, an inclusive ``(low, high)`` uniform range, one explicit
#: length per request, or a distribution ``fn(rng, n) -> n lengths`` drawn from the workload's
#: numpy Generator (e.g. ``lambda rng, n: np.clip(rng.lognormal(3, 0.5, n), 4, 200).astype(int)``).
LengthSpec = int | tuple[int, int] | Sequence[int] | Callable[[np.random.Generator, int], Sequence[int]]


@dataclass(frozen=True)
class WorkloadRequest:
    """One request of a workload. ``prompt``: text, or token ids (any sequence of integers or
    a 1-D integer array, checked as :class:`~workbench.lab.token_ids.TokenIds` and kept as a
    tuple of Python ints). ``arrival_step`` is read on the step clock and ``arrival_time``
    (seconds from the start) on the wall clock; either may be None (the request then comes at
    0 on that clock, if its workload is on that clock)."""

    request_id: str
    prompt: str | tuple[int, ...]
    params: SamplingParams
    arrival_step: int | None = None
    arrival_time: float | None = None
    priority: int = 0
    #: The LoRA adapter it runs under (None: the base model); the engine needs enable_lora.
    lora_request: LoRARequest | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str) or not self.request_id:
            raise ValueError(f"request_id must be a non-empty string, got {self.request_id!r}.")
        if isinstance(self.prompt, (list, tuple, np.ndarray)):
            try:
                ids = TokenIds(self.prompt)  # a TokenIds is not checked again
            except ValueError as exc:
                raise ValueError(f"request {self.request_id!r}: prompt {exc}") from None
            object.__setattr__(self, "prompt", tuple(ids))  # plain: see workbench.lab.token_ids
        if not isinstance(self.prompt, (str, tuple)) or not self.prompt:
            raise ValueError(f"request {self.request_id!r}: prompt must be non-empty text or token ids.")
        if not isinstance(self.params, SamplingParams):
            raise ValueError(f"request {self.request_id!r}: params must be SamplingParams, got {type(self.params).__name__}.")
        if self.arrival_step is not None and (not isinstance(self.arrival_step, int) or self.arrival_step < 0):
            raise ValueError(f"request {self.request_id!r}: arrival_step must be an integer >= 0, got {self.arrival_step!r}.")
        if self.arrival_time is not None and not (self.arrival_time >= 0 and math.isfinite(self.arrival_time)):
            raise ValueError(f"request {self.request_id!r}: arrival_time must be a finite number >= 0, got {self.arrival_time!r}.")
        if not isinstance(self.priority, int):
            raise ValueError(f"request {self.request_id!r}: priority must be an integer, got {self.priority!r}.")

    def _repr_html_(self) -> str:
        prompt = self.prompt if isinstance(self.prompt, str) else f"{len(self.prompt)} token ids"
        return (
            f"<b>{html.escape(self.request_id)}</b>: arrival step {self.arrival_step}, time "
            f"{self.arrival_time}, priority {self.priority}, max_tokens {self.params.max_tokens}"
            f"<pre>{html.escape(prompt)}</pre>"
        )

    def to_json(self) -> dict:
        return {
            "request_id": self.request_id,
            "prompt": self.prompt if isinstance(self.prompt, str) else list(self.prompt),
            "params": _params_to_json(self.params),
            "arrival_step": self.arrival_step,
            "arrival_time": self.arrival_time,
            "priority": self.priority,
            **({} if self.lora_request is None else {"lora_request": {
                "lora_name": self.lora_request.lora_name, "lora_int_id": self.lora_request.lora_int_id,
                "lora_path": self.lora_request.lora_path}}),
        }

    @classmethod
    def from_json(cls, data: dict) -> WorkloadRequest:
        lora = data.get("lora_request")
        return cls(**{**data, "params": _params_from_json(data["params"]),
                      "lora_request": None if lora is None else LoRARequest(**lora)})


class Workload:
    """An ordered, immutable collection of :class:`WorkloadRequest` with unique ids, whose
    arrivals are on ``clock`` (see the module docstring).

    ``clock=None``: ``"wall"`` if some request has an ``arrival_time`` and no
    ``arrival_step``, else ``"steps"``. Every request with an arrival has the field of the
    workload's clock. ``info`` records how it was made (the generator and its arguments).
    """

    def __init__(self, requests: Sequence[WorkloadRequest], info: dict | None = None, *,
                 clock: str | None = None):
        self.requests = tuple(requests)
        seen = set()
        for r in self.requests:
            if not isinstance(r, WorkloadRequest):
                raise ValueError(f"a Workload holds WorkloadRequest objects, got {type(r).__name__}.")
            if r.request_id in seen:
                raise ValueError(f"request_id {r.request_id!r} appears twice in the workload.")
            seen.add(r.request_id)
        if clock is None:
            timed_only = any(r.arrival_time is not None and r.arrival_step is None for r in self.requests)
            clock = "wall" if timed_only else "steps"
        if clock not in CLOCKS:
            raise ValueError(f"clock must be one of {CLOCKS}, got {clock!r}.")
        field, other = ("arrival_step", "arrival_time") if clock == "steps" else ("arrival_time", "arrival_step")
        for r in self.requests:
            if getattr(r, field) is None and getattr(r, other) is not None:
                raise ValueError(f"request {r.request_id!r} has {other} but no {field}, and this workload's "
                                 f"arrivals are on the {clock} clock: give every request {field}, or build the "
                                 f"workload with clock={'wall' if clock == 'steps' else 'steps'!r}.")
        self.clock = clock
        self.info = dict(info or {})

    def __len__(self) -> int:
        return len(self.requests)

    def __iter__(self) -> Iterator[WorkloadRequest]:
        return iter(self.requests)

    def __getitem__(self, index):
        return self.requests[index]

    def __eq__(self, other) -> bool:
        return isinstance(other, Workload) and self.clock == other.clock and self.requests == other.requests

    @property
    def request_ids(self) -> list[str]:
        return [r.request_id for r in self.requests]

    def on_clock(self, clock: str) -> Workload:
        """The same requests with their arrivals read on ``clock``: a generated workload's
        ``t`` becomes ``t`` seconds or step ``floor(t)``, so a rate per step becomes the same
        rate per second (another experiment, asked for by name). Every request with an
        arrival must have ``clock``'s field."""
        info = {**self.info, "clock": clock} if "clock" in self.info else self.info
        return Workload(self.requests, info, clock=clock)

    @property
    def rate(self) -> float:
        """Mean arrivals per unit of the clock: (n - 1) / (last - first arrival); NaN when
        every request arrives at once."""
        field = "arrival_time" if self.clock == "wall" else "arrival_step"
        times = sorted(getattr(r, field) or 0 for r in self.requests)
        return traces.mean_rate(times)

    def at_rate(self, rate: float) -> Workload:
        """The same requests with every arrival scaled so that the mean rate is ``rate`` per
        unit of the clock (both arrival fields scaled; a step is ``floor`` of the scaled time
        when the request has one). ``info["rate"]`` becomes ``rate``."""
        if not (isinstance(rate, (int, float)) and rate > 0 and math.isfinite(rate)):
            raise ValueError(f"rate must be a finite number > 0, got {rate!r}.")
        now = self.rate
        if not math.isfinite(now):
            raise ValueError("at_rate: every request of this workload arrives at once; there is no rate to scale.")
        f = now / rate
        requests = []
        for r in self.requests:
            t = None if r.arrival_time is None else r.arrival_time * f
            step = None if r.arrival_step is None else (int(math.floor(t)) if t is not None
                                                        else int(math.floor(r.arrival_step * f)))
            requests.append(dataclasses.replace(r, arrival_time=t, arrival_step=step))
        return Workload(requests, {**self.info, "rate": float(rate)}, clock=self.clock)
    def with_lora_requests(self, loras: Sequence[LoRARequest | None]) -> Workload:
        """The same requests, request ``i`` under ``loras[i % len(loras)]`` (None: the base
        model): ``wl.with_lora_requests([None, a, b])`` mixes two adapters and the base."""
        if not loras:
            raise ValueError("loras must name at least one adapter (or None).")
        requests = [dataclasses.replace(r, lora_request=loras[i % len(loras)])
                    for i, r in enumerate(self.requests)]
        names = [None if lora is None else lora.lora_name for lora in loras]
        return Workload(requests, {**self.info, "loras": names}, clock=self.clock)

    # ------------------------------------------------------------ generators
    @classmethod
    def from_trace(
        cls,
        path,
        format: str | None = None,
        *,
        window: tuple[float, float] | None = None,
        max_requests: int | None = None,
        rate_scale: float | None = None,
        rate: float | None = None,
        max_model_len: int | None = None,
        fit: str | None = "scale",
        text: bool = False,
        tokenizer=None,
        seed: int = 0,
        params: SamplingParams | None = None,
        id_prefix: str = "t",
    ) -> Workload:
        """A wall-clock workload from a production trace (a file, or a shipped excerpt's name:
        :data:`workbench.lab.traces.SHIPPED`); formats and their fields: :mod:`workbench.lab.traces`.

        ``window=(start, end)``: the requests arriving in that many seconds from the trace's
        first one; ``max_requests``: the first so many (after the window). Arrivals are seconds
        from the first request kept; ``rate_scale=2`` makes them twice as dense, ``rate`` sets
        the mean rate (requests/s; required for ShareGPT, which has no times: Poisson arrivals
        at ``rate`` from ``seed``). ``max_model_len`` (default: the embedded model's) and
        ``fit`` ("scale", "clip", "drop" or None, see :func:`~workbench.lab.traces.fit_lengths`):
        what is done to requests longer than the context; ``info["fit"]`` says what was
        changed (the workload's repr shows it).

        Prompts are real corpus tokens of the trace's lengths (token ids; ``text=True``: text,
        except for Mooncake blocks): Mooncake ``hash_ids`` blocks become shared token blocks
        (512 tokens, times the scale factor), so requests sharing an id share a real prefix;
        a ShareGPT prompt is its conversation's real text. Each request generates exactly its
        trace's output length (``max_tokens`` with ``ignore_eos``), greedy unless ``params``.
        """
        rows = traces.read_trace(path, format, tokenizer=tokenizer)
        fmt = format or traces.detect_format(traces.trace_path(path))
        rows = traces.select(rows, window, max_requests)
        limit = max_model_len or _embedded_max_model_len()
        rows, fit_note, factor = traces.fit_lengths(rows, limit, fit)
        rng = np.random.default_rng(seed)
        if rate_scale is not None and rate is not None:
            raise ValueError("give rate_scale or rate, not both.")
        if rows[0].arrival_s is None:
            if rate is None:
                raise ValueError(f"a {fmt} trace has no arrival times: give rate= (requests/s, Poisson arrivals).")
            gaps = rng.exponential(1.0 / rate, size=len(rows))
            times = [0.0, *np.cumsum(gaps[1:]).tolist()]
        else:
            times = [r.arrival_s for r in rows]
        if rate_scale is not None:
            if not (rate_scale > 0 and math.isfinite(rate_scale)):
                raise ValueError(f"rate_scale must be a finite number > 0, got {rate_scale!r}.")
            times = [t / rate_scale for t in times]
        cutter = PromptCutter(tokenizer, rng, text)
        if rows[0].hash_ids:
            block = max(1, round(traces.MOONCAKE_BLOCK_TOKENS * factor))
            prompts = traces.block_prompts(rows, block, cutter.bos, cutter.tokens)
            fit_note += f"; {block}-token shared prompt blocks"
        elif rows[0].text is not None:
            ids = [encode(cutter.tokenizer, r.text) for r in rows]
            prompts = [r.text if text and len(i) == r.input_len else tuple(i[: r.input_len]) for r, i in zip(rows, ids)]
        else:
            prompts = [cutter.prompt(r.input_len) for r in rows]
        per_request = exact_length_params(params, [r.output_len for r in rows])
        width = len(str(len(rows) - 1))
        requests = [
            WorkloadRequest(f"{id_prefix}{i:0{width}d}", prompt, p, arrival_step=int(math.floor(t)),
                            arrival_time=float(t))
            for i, (prompt, p, t) in enumerate(zip(prompts, per_request, times))
        ]
        name = str(path) if str(path) in traces.SHIPPED else pathlib.Path(path).name
        info = {"generator": "trace", "trace": name, "format": fmt, "window": window, "max_requests": max_requests,
                "rate_scale": rate_scale, "max_model_len": limit, "fit": fit_note, "seed": seed}
        workload = cls(requests, info, clock="wall")
        return workload.at_rate(rate) if rate is not None and rows[0].arrival_s is not None else workload

    @classmethod
    def poisson(
        cls,
        num_requests: int = 12,
        rate: float = 4.0,
        input_len: LengthSpec = (8, 40),
        output_len: LengthSpec = (4, 16),
        seed: int = 1,
        clock: str = "steps",
        **kwargs,
    ) -> Workload:
        """Arrivals of a Poisson process of ``rate`` per unit of ``clock`` (the first at 0):
        per step (``"steps"``) or per second (``"wall"``). Other keywords: see :meth:`build`."""
        _check_int("num_requests", num_requests, 1)
        if not (rate > 0 and math.isfinite(rate)):
            raise ValueError(f"rate must be a finite number > 0, got {rate!r}.")
        rng = np.random.default_rng(seed)
        gaps = rng.exponential(1.0 / rate, size=num_requests)
        times = np.concatenate([[0.0], np.cumsum(gaps[1:])])
        info = {"generator": "poisson", "num_requests": num_requests, "rate": rate, "input_len": input_len,
                "output_len": output_len, "seed": seed, "clock": clock, **kwargs}
        return cls.build(times.tolist(), input_len, output_len, rng=rng, clock=clock, info=info, **kwargs)

    @classmethod
    def burst(
        cls,
        num_requests: int = 12,
        num_bursts: int = 1,
        interval: float = 16.0,
        input_len: LengthSpec = (8, 40),
        output_len: LengthSpec = (4, 16),
        seed: int = 1,
        clock: str = "steps",
        **kwargs,
    ) -> Workload:
        """``num_requests`` split evenly into ``num_bursts`` groups arriving together, the
        groups ``interval`` units of ``clock`` apart (steps, or seconds for ``"wall"``; the
        first at 0). Other keywords: see :meth:`build`."""
        _check_int("num_requests", num_requests, 1)
        _check_int("num_bursts", num_bursts, 1)
        if num_bursts > num_requests:
            raise ValueError(f"num_bursts={num_bursts} exceeds num_requests={num_requests}.")
        if not (interval >= 0 and math.isfinite(interval)):
            raise ValueError(f"interval must be a finite number >= 0, got {interval!r}.")
        times = [float(interval * (i * num_bursts // num_requests)) for i in range(num_requests)]
        info = {"generator": "burst", "num_requests": num_requests, "num_bursts": num_bursts,
                "interval": interval, "input_len": input_len, "output_len": output_len, "seed": seed,
                "clock": clock, **kwargs}
        rng = np.random.default_rng(seed)
        return cls.build(times, input_len, output_len, rng=rng, clock=clock, info=info, **kwargs)

    @classmethod
    def build(
        cls,
        arrival_times: Sequence[float],
        input_len: LengthSpec,
        output_len: LengthSpec,
        *,
        rng: np.random.Generator,
        clock: str = "steps",
        priorities: Sequence[int] = (0,),
        num_prefix_groups: int = 0,
        prefix_len: int = 16,
        text: bool = True,
        params: SamplingParams | None = None,
        id_prefix: str = "r",
        tokenizer=None,
        info: dict | None = None,
    ) -> Workload:
        """One request per arrival ``t`` (in ``clock``'s unit; the request carries ``t`` as
        ``arrival_time`` and ``floor(t)`` as ``arrival_step``, see the module docstring).

        ``priorities``: drawn uniformly per request. ``num_prefix_groups > 0``: request ``i``
        starts with group ``i % num_prefix_groups``'s ``prefix_len``-token prefix (every input
        length must then exceed ``prefix_len``). ``params``: the template SamplingParams
        (default greedy); each request gets its output length as ``max_tokens`` with
        ``ignore_eos`` (see :func:`exact_length_params`). ``tokenizer``: what measures text
        prompts (default: the embedded model's); prompts must be replayed on a model with the
        same tokenizer.
        """
        n = len(arrival_times)
        inputs = draw_lengths("input_len", input_len, n, rng, low=1)
        outputs = draw_lengths("output_len", output_len, n, rng, low=1)
        if not priorities:
            raise ValueError("priorities must name at least one priority.")
        prios = [int(p) for p in rng.choice(list(priorities), size=n)]
        _check_int("num_prefix_groups", num_prefix_groups, 0)
        if num_prefix_groups:
            _check_int("prefix_len", prefix_len, 1)
            short = [x for x in inputs if x <= prefix_len]
            if short:
                raise ValueError(
                    f"input_len: every prompt must be longer than prefix_len={prefix_len} when requests "
                    f"share a prefix, but {len(short)} are not (shortest {min(short)})."
                )
        cutter = PromptCutter(tokenizer, rng, text)
        prefixes = [cutter.prompt(prefix_len) for _ in range(num_prefix_groups)]
        per_request = exact_length_params(params, outputs)
        width = len(str(n - 1))
        requests = []
        with rare_collections():  # what it makes lives on: the collector's passes would find nothing
            for i, t in enumerate(arrival_times):
                prefix = prefixes[i % num_prefix_groups] if num_prefix_groups else None
                prompt = cutter.prompt(inputs[i], prefix)
                requests.append(
                    WorkloadRequest(
                        request_id=f"{id_prefix}{i:0{width}d}",
                        prompt=prompt,
                        params=per_request[i],
                        arrival_step=int(math.floor(t)),
                        arrival_time=float(t),
                        priority=prios[i],
                    )
                )
        return cls(requests, info, clock=clock)

    # -------------------------------------------------------------- JSON
    def to_json(self) -> dict:
        return {"clock": self.clock, "info": _jsonable(self.info), "requests": [r.to_json() for r in self.requests]}

    @classmethod
    def from_json(cls, data: dict) -> Workload:
        return cls([WorkloadRequest.from_json(r) for r in data["requests"]], data.get("info"), clock=data.get("clock"))

    def save(self, path) -> None:
        """Write the workload as JSON (its clock, prompts, params, arrivals, priorities, info)."""
        pathlib.Path(path).write_text(json.dumps(self.to_json(), indent=1))

    @classmethod
    def load(cls, path) -> Workload:
        return cls.from_json(json.loads(pathlib.Path(path).read_text()))

    # -------------------------------------------------------------- repr
    def _summary(self) -> str:
        if not self.requests:
            return "0 requests"
        steps = [r.arrival_step for r in self.requests if r.arrival_step is not None]
        outs = [r.params.max_tokens for r in self.requests if r.params.max_tokens is not None]
        prios = sorted({r.priority for r in self.requests})
        times = [r.arrival_time for r in self.requests if r.arrival_time is not None]
        parts = [f"{len(self)} requests"]
        if self.clock == "wall" and times:
            parts.append(f"arrivals {min(times):.4g}..{max(times):.4g} s")
        elif steps:
            parts.append(f"arrival steps {min(steps)}..{max(steps)}")
        if outs:
            parts.append(f"max_tokens {min(outs)}..{max(outs)}")
        if len(prios) > 1:
            parts.append(f"priorities {prios}")
        if self.info.get("generator") == "trace":
            parts.append(f"trace {self.info.get('trace')} ({self.info.get('format')}), {self.info.get('fit')}")
        elif "generator" in self.info:
            parts.append(f"{self.info['generator']}(seed={self.info.get('seed')})")
        return ", ".join(parts)

    def __repr__(self) -> str:
        return f"Workload({self._summary()})"

    def _repr_html_(self) -> str:
        rows = "".join(
            "<tr>" + "".join(
                f"<td>{html.escape(str(c))}</td>"
                for c in (
                    r.request_id, r.arrival_step, "" if r.arrival_time is None else f"{r.arrival_time:.3f}",
                    r.priority, r.params.max_tokens,
                    r.prompt[:60] + ("..." if len(r.prompt) > 60 else "") if isinstance(r.prompt, str)
                    else f"{len(r.prompt)} token ids",
                )
            ) + "</tr>"
            for r in self.requests[:50]
        )
        more = f"<i>... {len(self) - 50} more</i>" if len(self) > 50 else ""
        head = "".join(f"<th>{h}</th>" for h in ("request", "step", "time (s)", "priority", "max_tokens", "prompt"))
        return f"<div><b>Workload</b>: {html.escape(self._summary())}<table>{head}{rows}</table>{more}</div>"


# ---------------------------------------------------------------- helpers
def _embedded_max_model_len() -> int:
    """The embedded model's context (``max_position_embeddings`` of its config.json)."""
    import importlib.resources

    config = importlib.resources.files("workbench.data") / "tiny-shakespeare" / "config.json"
    return int(json.loads(config.read_text())["max_position_embeddings"])


def _check_int(name: str, value, low: int) -> None:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}.")


def draw_lengths(name: str, spec: LengthSpec, n: int, rng: np.random.Generator, low: int) -> list[int]:
    """``n`` lengths >= ``low`` from ``spec`` (see :data:`LengthSpec`); ValueError names ``name``."""
    if isinstance(spec, (int, np.integer)) and not isinstance(spec, bool):
        _check_int(name, spec, low)
        return [int(spec)] * n
    if isinstance(spec, tuple) and len(spec) == 2:
        lo, hi = spec
        _check_int(f"{name} low", lo, low)
        _check_int(f"{name} high", hi, lo)
        return rng.integers(lo, hi + 1, size=n).tolist()
    if callable(spec):
        spec = [int(x) for x in spec(rng, n)]
    if isinstance(spec, Sequence) and not isinstance(spec, str):
        if len(spec) != n:
            raise ValueError(f"{name} lists {len(spec)} lengths for {n} requests.")
        for x in spec:
            _check_int(name, x, low)
        return [int(x) for x in spec]
    raise ValueError(
        f"{name} must be an int, a (low, high) tuple, one length per request or fn(rng, n), got {spec!r}."
    )


def exact_length_params(template: SamplingParams | None, lengths: Sequence[int]) -> list[SamplingParams]:
    """Per request, ``template`` (default greedy) with its output length as ``max_tokens`` and
    ``ignore_eos``. Requests of one length share one SamplingParams, made and checked once (as
    the requests of one ``LLM.generate`` call share theirs: nothing changes a request's
    params after it is made); a length the template refuses raises its ValueError, the first
    such length in request order."""
    template = template or SamplingParams(temperature=0.0)
    made = {n: dataclasses.replace(template, max_tokens=n, ignore_eos=True) for n in dict.fromkeys(lengths)}
    return [made[n] for n in lengths]


def _params_to_json(params: SamplingParams) -> dict:
    out = {}
    for f in dataclasses.fields(params):
        if not f.init:
            continue
        value = getattr(params, f.name)
        out[f.name] = value.name if isinstance(value, enum.Enum) else value
    return out


def _params_from_json(data: dict) -> SamplingParams:
    data = dict(data)
    if isinstance(data.get("output_kind"), str):
        data["output_kind"] = RequestOutputKind[data["output_kind"]]
    return SamplingParams(**data)


def _jsonable(value):
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, SamplingParams):
        return _params_to_json(value)
    return repr(value)
