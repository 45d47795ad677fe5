"""What structured outputs cost: the same requests free and constrained, in one run.

``workbench bench throughput --structured-outputs json|json-unique|regex|choice [--num-prompts
32 --repeats 3 ...]`` runs the workload free (exactly its output length, greedy, as the
throughput benchmark) and constrained (the same prompts, greedy, ``max_tokens`` = that
length; a grammar that ends stops its request earlier), alternately ``--repeats`` times on
one engine in a spawned process, and reports per mode the run of median wall time. Constraints:
``json`` one JSON schema for every request (compiled once, then cached), ``json-unique`` a
schema of its own per request (one compile each, as vLLM's ``json-unique`` dataset),
``regex`` an open-ended regex, ``choice`` a three-way choice.

The engine first warms up untimed on the free requests and one unrelated grammar, so no
figure carries the libraries' import or the tokenizer's
vocabulary scan (vLLM pays those once per engine too). Reported per mode: mean and median time
to first token and time per output token (``requests_dataframe()``: arrival -> first token;
(finished - first token) / (outputs - 1)), output tokens/s; for the constrained run, the
grammars compiled and their mean compile time, and the engine thread's mean time on grammars
per step that had constrained rows (filling the bitmask, advancing the matchers).
"""

from __future__ import annotations

import json
import statistics
import time

from workbench.benchmarks.datasets import BenchRequest

SCHEMA = {"type": "object", "properties": {
    "speaker": {"enum": ["ROMEO", "JULIET", "NURSE"]},
    "lines": {"type": "array", "items": {"type": "string", "maxLength": 24}}},
    "required": ["speaker", "lines"]}
CONSTRAINTS = ("json", "json-unique", "regex", "choice")


def constraint(kind: str, index: int):
    """The StructuredOutputsParams of request ``index`` under ``kind``."""
    from workbench.sampling_params import StructuredOutputsParams

    if kind == "json":
        return StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    if kind == "json-unique":
        schema = json.loads(json.dumps(SCHEMA))
        schema["properties"][f"scene_{index}"] = {"type": "integer"}
        schema["required"] = [f"scene_{index}", *schema["required"]]
        return StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    if kind == "regex":
        return StructuredOutputsParams(regex=r"[A-Z][a-z]+(, [a-z]+)*[.!?]( [A-Z][a-z]+"
                                             r"(, [a-z]+)*[.!?])*")
    if kind == "choice":
        return StructuredOutputsParams(choice=["O happy dagger!", "Parting is such sweet sorrow",
                                               "A plague o' both your houses!"])
    raise ValueError(f"structured outputs constraint must be one of {list(CONSTRAINTS)}, "
                     f"got {kind!r}.")


def _timed(llm, prompts, params, label: str) -> dict:
    """One timed ``generate``; its figures from the engine's request rows and StepRecords."""
    engine = llm.engine
    first_step = engine.history[-1].step + 1
    seen = set(engine.requests_dataframe()["request_id"])
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    frame = engine.requests_dataframe()
    frame = frame[~frame["request_id"].isin(seen)]
    grammar = [r.structured_output for r in engine.history if r.step >= first_step]
    compiles = [s for g in grammar for s in g.compile_seconds]
    masked = [g.mask_seconds for g in grammar if g.rows]
    tpot = frame["tpot_s"].dropna()
    return {
        "mode": label, "requests": len(outs),
        "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
        "finished_by_grammar": sum(o.outputs[0].finish_reason == "stop" for o in outs),
        "total_s": elapsed,
        "ttft_mean_s": float(frame["ttft_s"].mean()),
        "ttft_median_s": float(frame["ttft_s"].median()),
        "tpot_mean_s": float(tpot.mean()), "tpot_median_s": float(tpot.median()),
        "grammars_compiled": len(compiles),
        "compile_mean_s": statistics.fmean(compiles) if compiles else 0.0,
        "mask_per_step_mean_s": statistics.fmean(masked) if masked else 0.0,
    }


def run_compare(spec: dict, requests: list[BenchRequest], kind: str, repeats: int = 3) -> list:
    """Free and constrained runs alternated ``repeats`` times on one engine (so a change in
    the machine's load hits both alike); per mode the run with the median total time."""
    import torch

    from workbench import LLM, SamplingParams
    from workbench.sampling_params import StructuredOutputsParams

    if spec["threads"]:
        torch.set_num_threads(spec["threads"])
    llm = LLM(model=spec["model"], load_format=spec["load_format"], dtype=spec["dtype"],
              device=spec["device"], **spec["engine_kwargs"])
    prompts = [{"prompt_token_ids": list(r.prompt_token_ids)} for r in requests]
    free = [SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True)
            for r in requests]
    warm = SamplingParams(temperature=0, max_tokens=4,
                          structured_outputs=StructuredOutputsParams(regex="[a-z]{1,4}"))
    llm.generate(prompts + prompts[:1], free + [warm], use_tqdm=False)  # untimed warm-up
    runs: dict[str, list[dict]] = {"free": [], kind: []}
    for rep in range(repeats):
        constrained = [SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True,
                                      structured_outputs=constraint(kind, rep * len(requests) + i))
                       for i, r in enumerate(requests)]
        runs["free"].append(_timed(llm, prompts, free, "free"))
        runs[kind].append(_timed(llm, prompts, constrained, kind))
    threads = torch.get_num_threads()
    return [dict(sorted(r, key=lambda x: x["total_s"])[len(r) // 2], threads=threads,
                 repeats=repeats) for r in runs.values()]


def format_table(results: list[dict]) -> str:
    """The printed table: one row per mode; ratios against the free run."""
    free = results[0]
    lines = [f"{'mode':<12}{'out tok':>8}{'tok/s':>8}{'TTFT mean':>11}{'TTFT p50':>10}"
             f"{'TPOT mean':>11}{'TPOT p50':>10}{'compiles':>9}{'compile':>10}{'mask/step':>11}"]
    for r in results:
        ms = {k: r[k] * 1e3 for k in r if k.endswith("_s")}
        lines.append(
            f"{r['mode']:<12}{r['output_tokens']:>8}{r['output_tokens'] / r['total_s']:>8.1f}"
            f"{ms['ttft_mean_s']:>9.1f}ms{ms['ttft_median_s']:>8.1f}ms"
            f"{ms['tpot_mean_s']:>9.2f}ms{ms['tpot_median_s']:>8.2f}ms"
            f"{r['grammars_compiled']:>9}{ms['compile_mean_s']:>8.1f}ms"
            f"{ms['mask_per_step_mean_s']:>9.2f}ms")
    for r in results[1:]:
        lines.append(f"{r['mode']} / free: TTFT mean x{r['ttft_mean_s'] / free['ttft_mean_s']:.2f}, "
                     f"TPOT mean x{r['tpot_mean_s'] / free['tpot_mean_s']:.2f}; "
                     f"{r['finished_by_grammar']} of {r['requests']} requests ended with their "
                     "grammar")
    return "\n".join(lines)
