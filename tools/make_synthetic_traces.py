"""Write the two SYNTHETIC trace files of data/traces/ (no real excerpt could be obtained offline).

* ``burstgpt_synthetic.csv`` -- BurstGPT's CSV columns (Timestamp, Model, Request tokens,
  Response tokens, Total tokens, Log Type); arrivals of a Gamma renewal process (shape 0.5:
  burstier than Poisson, as BurstGPT reports), lengths lognormal. Not BurstGPT's data.
* ``sharegpt_synthetic.json`` -- ShareGPT's conversation JSON (id, conversations of
  human / gpt turns); turns are consecutive speeches of the project's Shakespeare corpus.
  Not ShareGPT's data.

Run from the repository root: ``python tools/make_synthetic_traces.py`` (deterministic).
"""

from __future__ import annotations

import csv
import gzip
import json
import pathlib
import re

import numpy as np

OUT = pathlib.Path("data/traces")


def burstgpt(rows: int = 1500, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(0.5, 2.0, size=rows)  # mean 1 s, coefficient of variation sqrt(2)
    times = np.floor(np.cumsum(gaps)).astype(int) + 5
    with open(OUT / "burstgpt_synthetic.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["Timestamp", "Model", "Request tokens", "Response tokens", "Total tokens", "Log Type"])
        for t in times:
            model = "GPT-4" if rng.random() < 0.2 else "ChatGPT"
            req = int(np.clip(rng.lognormal(5.8, 1.0), 1, 8000))
            res = int(np.clip(rng.lognormal(4.6, 0.9), 1, 2000))
            log = "API log" if rng.random() < 0.3 else "Conversation log"
            w.writerow([int(t), model, req, res, req + res, log])


def sharegpt(conversations: int = 200, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    with gzip.open("data/shakespeare/corpus/romeo_and_juliet.txt.gz", "rt", encoding="utf-8") as f:
        text = f.read()
    speeches = [s.strip() for s in re.split(r"\n\s*\n", text[text.find("ACT I"):]) if len(s.strip()) > 20]
    out = []
    for i in range(conversations):
        start = int(rng.integers(0, len(speeches) - 8))
        turns = int(rng.integers(1, 4)) * 2
        out.append({"id": f"synthetic_{i:04d}", "conversations": [
            {"from": "human" if k % 2 == 0 else "gpt", "value": speeches[start + k]} for k in range(turns)]})
    (OUT / "sharegpt_synthetic.json").write_text("[\n" + ",\n".join(json.dumps(c) for c in out) + "\n]\n")


if __name__ == "__main__":
    burstgpt()
    sharegpt()
