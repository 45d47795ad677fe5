"""Batch-1 greedy decode with speculation off, n-gram (k=4) and the draft model (k=3), on a
prompt that quotes a passage: output tokens/s (best of R interleaved runs), steps, acceptance.

    python tools/bench_spec_decode.py [N new tokens, default 96] [R runs, default 3]

Run from the repository root (the draft model is data/tiny-shakespeare-draft). The greedy
tokens are checked equal across the three; the step counts do not depend on the machine.
"""
import sys, time, torch
torch.set_num_threads(1)
from workbench import LLM, SamplingParams
from workbench.metrics.spec_stats import spec_decode_summary
PASSAGE = ("ROMEO:\nBut soft, what light through yonder window breaks?\nIt is the east, and Juliet is the sun.\n"
           "Arise, fair sun, and kill the envious moon,\nWho is already sick and pale with grief,\n"
           "That thou her maid art far more fair than she.\n\n")
PROMPT = PASSAGE + "JULIET:\nSay it again, Romeo.\n\n" + PASSAGE[:60]
N = int(sys.argv[1]) if len(sys.argv) > 1 else 96
configs = {"off": None,
           "ngram k=4": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2},
           "draft k=3": {"method": "draft_model", "model": "data/tiny-shakespeare-draft", "num_speculative_tokens": 3}}
llms = {name: LLM(device="cpu", dtype="float32", speculative_config=c) for name, c in configs.items()}
sp = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)
best = {name: float("inf") for name in llms}
outs = {}
for rep in range(int(sys.argv[2]) if len(sys.argv) > 2 else 3):
    for name, llm in llms.items():
        start = len(llm.engine.history)
        t0 = time.perf_counter()
        o = llm.generate([PROMPT], sp, use_tqdm=False)[0].outputs[0]
        best[name] = min(best[name], time.perf_counter() - t0)
        outs[name] = (o.token_ids, list(llm.engine.history)[start:])
ref = outs["off"][0]
for name in llms:
    toks, recs = outs[name]
    s = spec_decode_summary(recs)
    print(f"{name:10s} {N / best[name]:7.1f} tok/s  steps {len(recs):4d}  same tokens as off: {toks == ref}"
          f"  acceptance {s['spec_acceptance_rate']:.3f}  mean acceptance length {s['spec_mean_acceptance_length']:.2f}")
print("speedup ngram:", round(best["off"] / best["ngram k=4"], 2), " draft:", round(best["off"] / best["draft k=3"], 2))
import collections
for name in llms:
    toks, recs = outs[name]
    tot = collections.Counter()
    for r in recs:
        for k, v in r.timings.items():
            tot[k] += v * 1000 / len(recs)
    print(name, {k: round(v, 2) for k, v in tot.items()})
