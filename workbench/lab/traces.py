"""Production traces read into request rows: arrivals, lengths, shared prefix blocks.

:meth:`Workload.from_trace <workbench.lab.workload.Workload.from_trace>` builds a workload from
these rows. Formats (``format=``, or detected from the file):

* ``"azure"`` -- Azure LLM inference traces (CSV ``TIMESTAMP,ContextTokens,GeneratedTokens``;
  absolute timestamps);
* ``"burstgpt"`` -- BurstGPT (CSV ``Timestamp,[Session ID,Elapsed time,]Model,Request tokens,
  Response tokens,Total tokens,Log Type``; seconds); rows with 0 response tokens (failures) are
  left out;
* ``"mooncake"`` -- Mooncake (JSONL ``timestamp`` in ms, ``input_length``, ``output_length``,
  ``hash_ids``: one id per 512-token prompt block; requests with the same id share that block);
* ``"sharegpt"`` -- ShareGPT-style conversations (JSON list of ``{"conversations": [{"from":
  "human"|"gpt", "value": text}, ...]}``): the first human turn is the prompt (its real text),
  the gpt turn after it gives the output length in tokens. There are no arrival times.

Every arrival is in seconds from the first request kept. Lengths are fitted to the model's
context (:func:`fit_lengths`) and the change is stated in the workload's ``info["fit"]``.
"""

from __future__ import annotations

import csv
import dataclasses
import datetime
import importlib.resources
import json
import math
import pathlib
from collections.abc import Sequence
from dataclasses import dataclass

FORMATS = ("azure", "burstgpt", "mooncake", "sharegpt")
#: How lengths are fitted to the context: one factor for all, per-request clipping, leaving out.
FITS = ("scale", "clip", "drop")
#: Tokens per Mooncake ``hash_ids`` block (Mooncake's FAST'25 trace README).
MOONCAKE_BLOCK_TOKENS = 512
#: The excerpts shipped in ``workbench.data/traces`` (see its README: sources, licences, which are synthetic).
SHIPPED = {
    "azure_conv": "azure_llm_2023_conv.csv",
    "azure_code": "azure_llm_2023_code.csv",
    "mooncake_conversation": "mooncake_conversation.jsonl",
    "burstgpt_synthetic": "burstgpt_synthetic.csv",
    "sharegpt_synthetic": "sharegpt_synthetic.json",
}


@dataclass(frozen=True)
class TraceRow:
    """One request of a trace: arrival (seconds, None when the format has none), prompt and
    output lengths in tokens, the prompt's shared block ids (Mooncake) or its text (ShareGPT)."""

    arrival_s: float | None
    input_len: int
    output_len: int
    hash_ids: tuple[int, ...] = ()
    text: str | None = None


def trace_path(path) -> pathlib.Path:
    """``path`` as a file, or the shipped excerpt of that name (:data:`SHIPPED`)."""
    if str(path) in SHIPPED:
        resource = importlib.resources.files("workbench.data") / "traces" / SHIPPED[str(path)]
        return pathlib.Path(str(resource))
    p = pathlib.Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"trace {str(path)!r} not found (a file, or one of the shipped {sorted(SHIPPED)}).")
    return p


def detect_format(path: pathlib.Path) -> str:
    """The format of a trace file from its first line (see the module docstring)."""
    with open(path, encoding="utf-8") as f:
        head = f.readline().strip()
    if head.startswith("TIMESTAMP") and "ContextTokens" in head:
        return "azure"
    if head.startswith("Timestamp") and "Request tokens" in head:
        return "burstgpt"
    if head.startswith("{") and "input_length" in head:
        return "mooncake"
    if head.startswith("["):
        return "sharegpt"
    raise ValueError(f"trace {path.name!r}: cannot tell its format from its first line {head[:80]!r}; "
                     f"give format= one of {FORMATS}.")


def read_trace(path, format: str | None = None, *, tokenizer=None) -> list[TraceRow]:
    """Every usable row of the trace, arrivals from its first row. ``tokenizer``: measures
    ShareGPT texts (a tokenizers/transformers tokenizer with the engine's special tokens)."""
    path = trace_path(path)
    format = format or detect_format(path)
    if format not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {format!r}.")
    rows = {"azure": _azure, "burstgpt": _burstgpt, "mooncake": _mooncake}[format](path) \
        if format != "sharegpt" else _sharegpt(path, tokenizer)
    if not rows:
        raise ValueError(f"trace {path.name!r}: no usable request in it.")
    if rows[0].arrival_s is not None:
        t0 = min(r.arrival_s for r in rows)
        rows = sorted((dataclasses.replace(r, arrival_s=r.arrival_s - t0) for r in rows), key=lambda r: r.arrival_s)
    return rows


def select(rows: list[TraceRow], window: tuple[float, float] | None = None,
           max_requests: int | None = None) -> list[TraceRow]:
    """The rows arriving in ``[start, end)`` seconds (from the trace's first request), at most
    ``max_requests`` of them, with arrivals re-based to the first one kept."""
    if window is not None:
        if rows[0].arrival_s is None:
            raise ValueError("window: this trace has no arrival times.")
        start, end = window
        if not (0 <= start < end):
            raise ValueError(f"window must be (start, end) seconds with 0 <= start < end, got {window!r}.")
        rows = [r for r in rows if start <= r.arrival_s < end]
    if max_requests is not None:
        if not (isinstance(max_requests, int) and max_requests >= 1):
            raise ValueError(f"max_requests must be an integer >= 1, got {max_requests!r}.")
        rows = rows[:max_requests]
    if not rows:
        raise ValueError(f"window {window!r}: no request of the trace arrives in it.")
    if rows[0].arrival_s is not None:
        t0 = rows[0].arrival_s
        rows = [dataclasses.replace(r, arrival_s=r.arrival_s - t0) for r in rows]
    return rows


def fit_lengths(rows: list[TraceRow], max_model_len: int, how: str | None) -> tuple[list[TraceRow], str, float]:
    """Fit every request to ``prompt + output <= max_model_len`` (and a prompt of >= 2 tokens:
    bos and one more). Returns the rows, a sentence saying what changed, and the length factor.

    * ``"scale"``: every prompt and output length times one factor ``s = min(1, max_model_len /
      longest prompt + output)`` (rounded, at least 2 and 1): the trace's shape -- which requests
      are long, the prompt/output balance, shared blocks (their size too) -- is kept, in smaller units;
    * ``"clip"``: each request on its own: output at most ``max_model_len // 2``, then prompt at
      most what is left; the others are unchanged (long prompts lose their tail);
    * ``"drop"``: requests that do not fit are left out;
    * None: a request that does not fit is a ValueError naming it and the limit.
    """
    if how not in (*FITS, None):
        raise ValueError(f"fit must be one of {FITS} or None, got {how!r}.")
    fits = [r.input_len + r.output_len <= max_model_len and r.input_len >= 2 for r in rows]
    if all(fits):
        return rows, f"lengths unchanged (all fit max_model_len {max_model_len})", 1.0
    bad = fits.index(False)
    if how is None:
        r = rows[bad]
        raise ValueError(f"trace request {bad}: prompt {r.input_len} + output {r.output_len} tokens does not fit "
                         f"max_model_len {max_model_len} (or the prompt is under 2 tokens); give fit= one of {FITS}.")
    if how == "drop":
        kept = [r for r, ok in zip(rows, fits) if ok]
        if not kept:
            raise ValueError(f"fit='drop': no request of the trace fits max_model_len {max_model_len}.")
        return kept, f"{len(rows) - len(kept)} of {len(rows)} requests left out (over max_model_len {max_model_len})", 1.0
    if how == "scale":
        s = min(1.0, max_model_len / max(r.input_len + r.output_len for r in rows))
        out = []
        for r in rows:
            o = max(1, math.floor(r.output_len * s))
            i = min(max(2, math.floor(r.input_len * s)), max_model_len - o)
            out.append(dataclasses.replace(r, input_len=i, output_len=o))
        changed = sum(a != b for a, b in zip(rows, out))
        return out, (f"lengths scaled x{s:.4g} to fit max_model_len {max_model_len} ({changed} of {len(rows)} "
                     "requests changed)"), s
    out = []
    for r in rows:
        o = min(r.output_len, max_model_len // 2)
        out.append(dataclasses.replace(r, input_len=max(2, min(r.input_len, max_model_len - o)), output_len=o))
    changed = sum(a != b for a, b in zip(rows, out))
    return out, (f"lengths clipped to max_model_len {max_model_len} (output <= {max_model_len // 2}, prompt <= the rest; "
                 f"{changed} of {len(rows)} requests changed)"), 1.0


def block_prompts(rows: Sequence[TraceRow], block_tokens: int, bos: Sequence[int], piece) -> list[tuple[int, ...]]:
    """Token-id prompts of rows with ``hash_ids``: ``bos``, then each block's tokens in order
    (``piece(n)``: ``n`` fresh corpus tokens, drawn once per block id, so requests sharing an id
    share its tokens), cut at the row's ``input_len``; a row whose blocks run short ends with
    tokens of its own."""
    blocks: dict[int, tuple[int, ...]] = {}
    prompts = []
    for r in rows:
        need = r.input_len - len(bos)
        tokens: list[int] = []
        for h in r.hash_ids:
            if len(tokens) >= need:
                break
            if h not in blocks:
                blocks[h] = tuple(piece(block_tokens))
            tokens.extend(blocks[h])
        if len(tokens) < need:
            tokens.extend(piece(need - len(tokens)))
        prompts.append(tuple(bos) + tuple(tokens[:need]))
    return prompts


def mean_rate(times: Sequence[float]) -> float:
    """Arrivals per second of sorted arrival ``times``: (n - 1) / their span (NaN if it is 0)."""
    span = times[-1] - times[0] if len(times) > 1 else 0.0
    return (len(times) - 1) / span if span > 0 else math.nan


# ------------------------------------------------------------------ readers
def _int(row: dict, key: str, path: pathlib.Path, line: int) -> int:
    try:
        return int(float(row[key]))
    except (KeyError, TypeError, ValueError):
        raise ValueError(f"trace {path.name!r} line {line}: {key!r} must be a number, got {row.get(key)!r}.") from None


def _azure(path: pathlib.Path) -> list[TraceRow]:
    rows = []
    with open(path, newline="", encoding="utf-8") as f:
        for line, row in enumerate(csv.DictReader(f), start=2):
            stamp = (row.get("TIMESTAMP") or "").strip()
            date, _, frac = stamp.partition(".")
            try:  # 100 ns ticks: more digits than datetime reads
                t = datetime.datetime.fromisoformat(date).timestamp() + (float("0." + frac) if frac else 0.0)
            except ValueError:
                raise ValueError(f"trace {path.name!r} line {line}: TIMESTAMP {stamp!r} is not a date and time.") from None
            n_in, n_out = _int(row, "ContextTokens", path, line), _int(row, "GeneratedTokens", path, line)
            if n_in >= 1 and n_out >= 1:
                rows.append(TraceRow(t, n_in, n_out))
    return rows


def _burstgpt(path: pathlib.Path) -> list[TraceRow]:
    rows = []
    with open(path, newline="", encoding="utf-8") as f:
        for line, row in enumerate(csv.DictReader(f), start=2):
            try:
                t = float(row["Timestamp"])
            except (KeyError, TypeError, ValueError):
                raise ValueError(f"trace {path.name!r} line {line}: 'Timestamp' must be seconds, "
                                 f"got {row.get('Timestamp')!r}.") from None
            n_in, n_out = _int(row, "Request tokens", path, line), _int(row, "Response tokens", path, line)
            if n_in >= 1 and n_out >= 1:
                rows.append(TraceRow(t, n_in, n_out))
    return rows


def _mooncake(path: pathlib.Path) -> list[TraceRow]:
    rows = []
    with open(path, encoding="utf-8") as f:
        for line, text in enumerate(f, start=1):
            if not text.strip():
                continue
            try:
                d = json.loads(text)
                row = TraceRow(float(d["timestamp"]) / 1000.0, int(d["input_length"]), int(d["output_length"]),
                               tuple(int(h) for h in d.get("hash_ids", ())))
            except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
                raise ValueError(f"trace {path.name!r} line {line}: not a Mooncake request ({e}).") from None
            if row.input_len >= 1 and row.output_len >= 1:
                rows.append(row)
    return rows


def _sharegpt(path: pathlib.Path, tokenizer) -> list[TraceRow]:
    from workbench.lab.corpus_prompts import encode, resolve_tokenizer

    tokenizer = resolve_tokenizer(tokenizer)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"trace {path.name!r}: not JSON ({e}).") from None
    if not isinstance(data, list):
        raise ValueError(f"trace {path.name!r}: a ShareGPT file is a JSON list of conversations.")
    rows = []
    for conv in data:
        turns = conv.get("conversations") if isinstance(conv, dict) else None
        if not isinstance(turns, list):
            continue
        for a, b in zip(turns, turns[1:]):
            if a.get("from") == "human" and b.get("from") == "gpt" and a.get("value") and b.get("value"):
                prompt = encode(tokenizer, a["value"])
                reply = len(encode(tokenizer, b["value"])) - len(encode(tokenizer, ""))
                if reply >= 1:
                    rows.append(TraceRow(None, len(prompt), reply, text=a["value"]))
                break
    return rows
