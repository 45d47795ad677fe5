"""Offline throughput: the workbench engine beside transformers' ``generate``, same prompts, same process.

``workbench bench throughput [--num-prompts 16 --max-tokens 64 --model DIR]`` prints a table of
generated tokens per second. Both sides decode greedily for exactly ``max_tokens`` tokens.
"""

from __future__ import annotations

import argparse
import time


def _prompts(tokenizer, num_prompts: int, prompt_len: int) -> list[list[int]]:
    speakers = ["ROMEO:", "JULIET:", "KING HENRY:", "HAMLET:", "OTHELLO:", "PORTIA:", "LEAR:", "PUCK:"]
    seeds = [tokenizer(f"{speakers[i % len(speakers)]}\n").input_ids for i in range(num_prompts)]
    filler = tokenizer("Now is the winter of our discontent made glorious summer. " * 64).input_ids
    return [(s + filler)[:prompt_len] for s in seeds]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="workbench bench throughput", description=__doc__)
    parser.add_argument("--model", default=None)
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--device", default=None)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads for both systems (default: torch's choice)")
    args = parser.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM

    from workbench import LLM, SamplingParams

    if args.threads:
        torch.set_num_threads(args.threads)
    llm = LLM(model=args.model, device=args.device)
    engine = llm.engine
    prompts = _prompts(engine.tokenizer, args.num_prompts, args.prompt_len)
    total = args.num_prompts * args.max_tokens

    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    warm = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in prompts], warm, use_tqdm=False)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    ours = time.perf_counter() - t0
    assert sum(len(o.outputs[0].token_ids) for o in outs) == total

    hf = AutoModelForCausalLM.from_pretrained(str(engine.model_config.path), dtype=torch.float32)
    hf.to(engine.device).eval()
    ids = torch.tensor(prompts, device=engine.device)  # equal lengths: no padding needed
    gen_kwargs = dict(
        do_sample=False, max_new_tokens=args.max_tokens, min_new_tokens=args.max_tokens,
        pad_token_id=engine.tokenizer.pad_token_id or 0,
    )
    with torch.inference_mode():
        hf.generate(ids, **{**gen_kwargs, "max_new_tokens": 4, "min_new_tokens": 4})
        t0 = time.perf_counter()
        hf.generate(ids, **gen_kwargs)
        theirs = time.perf_counter() - t0

    print(f"model: {engine.model_config.architecture} ({engine.model_config.path.name}), "
          f"device: {engine.device}, prompts: {args.num_prompts} x {args.prompt_len} tokens, "
          f"{args.max_tokens} new tokens each, greedy, {torch.get_num_threads()} threads")
    print(f"{'system':<34}{'seconds':>10}{'tokens/s':>12}{'ratio':>8}")
    for name, secs in (("workbench LLM.generate", ours), ("transformers generate (batched)", theirs)):
        print(f"{name:<34}{secs:>10.2f}{total / secs:>12.1f}{theirs / secs:>8.2f}")
    return 0
