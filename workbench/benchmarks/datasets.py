"""The synthetic workloads the benchmarks share: prompts with exact lengths.

``--num-prompts N --input-len-range A:B --output-len-range A:B --seed S`` draw N requests whose
prompt lengths are uniform in [A, B] (inclusive) and whose output lengths are uniform in their
range; every request must generate exactly its output length (``ignore_eos``), so every system
does the same work. Datasets (``DATASETS``):

* ``random``: prompt ids uniform over the vocabulary minus the special tokens.
* ``quote``: a passage of the embedded Shakespeare corpus (cut at a line start) followed by
  its first ``QUOTE_TOKENS`` tokens again, as a prompt that quotes a passage and starts
  asking for it again: prompt lookup (n-gram speculation) finds the passage, and the play's
  own recurring text (speaker names, stage directions) in the output.
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass

import numpy as np

DATASETS = ("random", "quote")
#: Tokens of a ``quote`` prompt's passage repeated at its end (fewer in a short prompt).
QUOTE_TOKENS = 16


@dataclass(frozen=True)
class BenchRequest:
    """One request: its prompt token ids and the exact number of tokens it must generate."""

    prompt_token_ids: tuple[int, ...]
    output_len: int

    def __repr__(self) -> str:
        return f"BenchRequest(prompt_len={len(self.prompt_token_ids)}, output_len={self.output_len})"


def parse_range(text: str) -> tuple[int, int]:
    """``"32:192"`` -> (32, 192); ``"64"`` -> (64, 64). Bounds must satisfy 1 <= A <= B."""
    parts = text.split(":")
    try:
        lo, hi = (int(parts[0]), int(parts[-1])) if len(parts) in (1, 2) else (0, -1)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected A:B with integers A <= B, got {text!r}") from None
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"expected A:B with integers 1 <= A <= B, got {text!r}")
    return lo, hi


def add_workload_args(parser: argparse.ArgumentParser, *, num_prompts: int = 96) -> None:
    """The options every benchmark shares (model and workload)."""
    parser.add_argument("--model", default=None, help="HF directory or hub id (default: embedded model)")
    parser.add_argument("--num-prompts", type=int, default=num_prompts)
    parser.add_argument("--input-len-range", type=parse_range, default=(32, 192), metavar="A:B",
                        help="prompt lengths, uniform in [A, B] (default 32:192)")
    parser.add_argument("--output-len-range", type=parse_range, default=(32, 128), metavar="A:B",
                        help="exact output lengths, uniform in [A, B] (default 32:128)")
    parser.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")


def sample_requests(
    num_prompts: int,
    input_len_range: tuple[int, int],
    output_len_range: tuple[int, int],
    vocab_size: int,
    special_ids: set[int] = frozenset(),
    seed: int = 0,
    *,
    dataset: str = "random",
    tokenizer=None,
) -> list[BenchRequest]:
    """``num_prompts`` requests drawn from one seeded generator (same arguments, same list);
    ``tokenizer`` (a path; None: the embedded model's) cuts the ``quote`` passages."""
    if num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {num_prompts}.")
    if dataset not in DATASETS:
        raise ValueError(f"dataset must be one of {list(DATASETS)}, got {dataset!r}.")
    if dataset == "quote":
        return _quote_requests(num_prompts, input_len_range, output_len_range, seed, tokenizer)
    rng = random.Random(seed)
    pool = [t for t in range(vocab_size) if t not in special_ids]
    requests = []
    for _ in range(num_prompts):
        prompt_len = rng.randint(*input_len_range)
        output_len = rng.randint(*output_len_range)
        requests.append(BenchRequest(tuple(rng.choices(pool, k=prompt_len)), output_len))
    return requests


def _quote_requests(num_prompts, input_len_range, output_len_range, seed, tokenizer) -> list[BenchRequest]:
    from workbench.lab.corpus_prompts import PromptCutter

    if input_len_range[0] < 8:
        raise ValueError(f"quote prompts need input lengths >= 8, got {input_len_range[0]}.")
    rng = random.Random(seed)
    cutter = PromptCutter(tokenizer, np.random.default_rng(seed), text=False)
    head = len(cutter.bos)  # the tokens the tokenizer puts in front (bos)
    requests = []
    for _ in range(num_prompts):
        prompt_len = rng.randint(*input_len_range)
        output_len = rng.randint(*output_len_range)
        quote = min(QUOTE_TOKENS, (prompt_len - head) // 4)
        passage = cutter.prompt(prompt_len - quote)
        requests.append(BenchRequest(passage + passage[head:head + quote], output_len))
    return requests
