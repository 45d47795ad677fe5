"""The Perfetto export: checked against the Chrome trace-event format and read back (with a
decoder written here from the format, not the exporter) to the runs' own request frames."""

import json
import math
from collections import defaultdict

import pytest

from workbench.entrypoints.cli import main as cli_main
from workbench.lab.compare import run_workload
from workbench.lab.sim import CostModel, simulate
from workbench.lab.workload import Workload, WorkloadRequest
from workbench.sampling_params import SamplingParams

TEN_MS = CostModel({"step": 0.010})
#: Preemption, chunked prefill and prefix hits all happen in this one (test_simulate checks it).
WORKLOAD = dict(num_requests=10, rate=2.0, input_len=(36, 90), output_len=(4, 16), seed=3,
                num_prefix_groups=2, prefix_len=32)
CONFIG = {"max_num_seqs": 6, "num_kv_blocks": 16, "max_num_batched_tokens": 48}
PHASES = set("BEXiCMsf")


def check_trace_format(trace: dict) -> None:
    """The trace-event format's rules (the JSON Object Format): every event has ph, pid, tid and
    name, every timed one a numeric ts; X a dur >= 0; per thread, B/E/X/i in file order have
    non-decreasing ts, B and E pair up by name like brackets and X nest inside their parents;
    C args are numbers; each flow id has one s and one f, the f not before the s."""
    assert trace["displayTimeUnit"] in ("ms", "ns")
    stacks, last_ts, flows = defaultdict(list), {}, defaultdict(dict)
    for e in trace["traceEvents"]:
        assert e["ph"] in PHASES and {"pid", "tid", "name"} <= set(e), e
        if e["ph"] == "M":
            assert e["name"] in ("process_name", "thread_name", "thread_sort_index") and "args" in e
            continue
        assert isinstance(e["ts"], (int, float)) and e["ts"] >= 0, e
        track = (e["pid"], e["tid"])
        if e["ph"] == "C":
            assert e["args"] and all(isinstance(v, (int, float)) for v in e["args"].values()), e
            continue
        if e["ph"] in "sf":
            assert e["ph"] not in flows[e["id"]], e
            flows[e["id"]][e["ph"]] = e
            continue
        assert e["ts"] >= last_ts.get(track, 0), (e, last_ts.get(track))
        last_ts[track] = e["ts"]
        stack = stacks[track]
        while stack and stack[-1][0] == "X" and stack[-1][2] <= e["ts"] + 1e-6:  # slices that ended
            stack.pop()
        if e["ph"] == "B":
            stack.append(("B", e["name"], math.inf))
        elif e["ph"] == "E":
            assert stack and stack[-1][:2] == ("B", e["name"]), (e, stack)
            stack.pop()
        elif e["ph"] == "X":
            assert e["dur"] >= 0, e
            end = e["ts"] + e["dur"]
            assert not stack or end <= stack[-1][2] + 2e-3, (e, stack[-1])
            stack.append(("X", e["name"], end))
    assert all(not [s for s in stack if s[0] == "B"] for stack in stacks.values()), "a B without its E"
    for flow_id, ends in flows.items():
        assert set(ends) == {"s", "f"}, (flow_id, ends)
        assert ends["s"]["ts"] <= ends["f"]["ts"] and ends["s"]["pid"] == ends["f"]["pid"]


def read_requests(trace: dict) -> dict[str, dict[str, dict]]:
    """process name -> request id -> what its track says, in seconds: arrival, queue_s (to the
    end of its first ``waiting``), ttft_s, e2e_s, tpot_s, preemptions, recomputed tokens, reason."""
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    tracks = defaultdict(list)
    for e in trace["traceEvents"]:
        if e["ph"] != "M" and e["tid"] != 0:
            tracks[(e["pid"], e["tid"])].append(e)
    out = defaultdict(dict)
    for (pid, _), events in tracks.items():
        begin = next(e for e in events if e["ph"] == "B")
        end = next(e for e in events if e["ph"] == "E")
        waiting = next(e for e in events if e["name"] == "waiting")
        first = next(e for e in events if e["name"] == "first token")
        finished = next(e for e in events if e["name"].startswith("finished: "))
        n = finished["args"]["num_output_tokens"]
        out[names[pid]][begin["args"]["request_id"]] = {
            "arrival": begin["ts"] / 1e6,
            "queue_s": (waiting["ts"] + waiting["dur"] - begin["ts"]) / 1e6,
            "ttft_s": (first["ts"] - begin["ts"]) / 1e6,
            "e2e_s": (end["ts"] - begin["ts"]) / 1e6,
            "tpot_s": (finished["ts"] - first["ts"]) / 1e6 / (n - 1) if n > 1 else math.nan,
            "num_output_tokens": n,
            "num_preemptions": sum(e["name"] == "preempted" for e in events),
            "num_recomputed_tokens": sum(e.get("args", {}).get("num_recomputed_tokens", 0) for e in events),
            "finish_reason": finished["name"].removeprefix("finished: "),
        }
    return out


def test_real_and_simulated_runs_side_by_side_follow_the_format_and_read_back_to_the_microsecond(tmp_path):
    wl = Workload.poisson(**WORKLOAD)
    real = run_workload(wl, CONFIG)
    sim = simulate(wl, CONFIG, TEN_MS)
    trace = json.loads(real.to_perfetto(tmp_path / "trace.json", sim).read_text())
    check_trace_format(trace)
    spans = read_requests(trace)
    assert sorted(spans) == ["real run (fcfs)", "simulated run (fcfs)"]
    for run, name in ((real, "real run (fcfs)"), (sim, "simulated run (fcfs)")):
        frame = run.requests.set_index("request_id")
        got = spans[name]
        assert sorted(got) == sorted(frame.index)
        origin = min(frame["arrival_s"])
        first_arrival = min(r["arrival"] for r in got.values())
        for rid, row in frame.iterrows():
            g = got[rid]
            assert g["arrival"] - first_arrival == pytest.approx(row["arrival_s"] - origin, abs=1e-6)
            for col in ("queue_s", "ttft_s", "e2e_s", "tpot_s"):
                assert g[col] == pytest.approx(row[col], abs=1e-6, nan_ok=True), (rid, col)
            for col in ("num_output_tokens", "num_preemptions", "num_recomputed_tokens", "finish_reason"):
                assert g[col] == row[col], (rid, col)
    assert real.summary()["num_preemptions"] > 0  # the preempted tracks were read back too


def _req(rid, n_prompt, max_tokens, time):
    return WorkloadRequest(rid, tuple(range(5, 5 + n_prompt)),
                           SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                           arrival_time=time)


def test_a_hand_worked_simulated_timeline_its_counters_and_the_preemption_arrow(tmp_path):
    """block_size 16, 4 blocks. a and b (20-token prompts, 2 blocks each) are admitted at 0.
    Every step costs 10 ms, so step k runs [10k, 10k + 10) ms. After 12 decode steps (steps
    1..12) each holds 32 tokens; in step 13 a needs a third block: FCFS preempts b (the last
    running) to make room for a -- the arrow goes from b to a, at 130 ms."""
    wl = Workload([_req("a", 20, 16, 0.0), _req("b", 20, 16, 0.0)], clock="wall")
    sim = simulate(wl, {"block_size": 16, "num_kv_blocks": 4, "max_num_seqs": 4}, TEN_MS)
    trace = json.loads(sim.history.to_perfetto(tmp_path / "sim.json", name="sim").read_text())
    check_trace_format(trace)
    events = trace["traceEvents"]
    steps = [e for e in events if e.get("cat") == "step"]
    assert [(e["ts"], e["dur"]) for e in steps] == [(10_000.0 * k, 10_000.0) for k in range(len(steps))]
    stages = [e for e in events if e.get("cat") == "stage"]
    assert {e["name"] for e in stages} == {"simulated"} and len(stages) == len(steps)
    preempting = [r.step for r in sim.history if r.scheduler_output.preempted_request_ids]
    assert preempting[0] == 13 and sim.history.record(13).scheduler_output.preempted_request_ids == ("b",)
    threads = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    flow = [e for e in events if e["ph"] in "sf" and e["ts"] == 130_000.0]
    assert sorted((e["ph"], threads[e["tid"]]) for e in flow) == [("f", "request a"), ("s", "request b")]
    counters = defaultdict(list)
    for e in events:
        if e["ph"] == "C":
            counters[e["name"]].append((e["ts"], e["args"]))
    records = list(sim.history)
    assert counters["running"] == [(10_000.0 * (r.step + 1), {"running": r.num_running}) for r in records]
    assert counters["tokens"][0] == (10_000.0, {"prefill": 40, "decode": 0})
    assert counters["tokens"][1] == (20_000.0, {"prefill": 0, "decode": 2})
    assert counters["kv usage (%)"][0][1] == {"kv usage (%)": 100.0}  # 4 of 4 blocks


def test_trace_export_command_writes_both_runs_of_a_saved_workload(tmp_path, capsys):
    wl = Workload([_req("a", 8, 3, 0.0), _req("b", 8, 2, 0.05)], clock="wall")
    wl.save(tmp_path / "wl.json")
    TEN_MS.save(tmp_path / "cost.json")
    out = tmp_path / "trace.json"
    code = cli_main(["trace", "export", str(tmp_path / "wl.json"), "--output", str(out), "--run", "both",
                     "--cost-model", str(tmp_path / "cost.json"), "--device", "cpu"])
    assert code == 0 and str(out) in capsys.readouterr().out
    trace = json.loads(out.read_text())
    check_trace_format(trace)
    assert sorted(read_requests(trace)) == ["real run (fcfs)", "simulated run (fcfs)"]
    assert cli_main(["trace", "export", str(tmp_path / "missing.json")]) == 2
    assert "missing.json" in capsys.readouterr().err


def test_a_live_engine_history_nests_the_real_stages_and_ends_an_unfinished_request_with_the_run(tmp_path):
    from workbench import LLMEngine
    from workbench.engine.history import TIMING_STAGES

    engine = LLMEngine(device="cpu", block_size=8, num_kv_blocks=16)
    engine.add_request("r", "ROMEO:", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    engine.step()
    engine.step()
    trace = json.loads(engine.history.to_perfetto(tmp_path / "live.json").read_text())
    check_trace_format(trace)
    events = trace["traceEvents"]
    for record in engine.history:
        step = next(e for e in events if e["name"] == f"step {record.step}")
        stages = [e for e in events if e.get("cat") == "stage" and step["ts"] <= e["ts"] < step["ts"] + step["dur"]]
        assert [e["name"] for e in stages] == list(TIMING_STAGES)
        assert [e["dur"] for e in stages] == pytest.approx([record.timings[s] * 1e6 for s in TIMING_STAGES],
                                                           abs=2e-3)
    end = next(e for e in events if e["ph"] == "E")
    last = next(e for e in events if e["name"] == "step 1")
    assert end["args"] == {"finished": False} and end["ts"] == pytest.approx(last["ts"] + last["dur"], abs=1e-3)
