"""Print a digest of every RequestOutput and IterationStats of a simulated run with text, to
show that a change to the output path (output processor, detokenizer, n > 1, stop strings)
left what users receive unchanged:

    python tools/outputs_digest.py 150    # requests (default 150)

The run mixes the output kinds (CUMULATIVE, DELTA, FINAL_ONLY), n = 1-3, stop strings (with and
without include_stop_str_in_output, min_tokens), detokenize on and off, skip_special_tokens, and
aborts one request every 17 steps; token ids are drawn per request and position, so the text
is varied. Everything is on the simulated clock, so the latencies repeat too. Run it before and
after a change: the digest must be the same.
"""

import hashlib
import random
import sys

from workbench import EngineArgs
from workbench.lab.sim.cost_model import as_cost_model
from workbench.lab.sim.simulate import simulated_engine
from workbench.sampling_params import RequestOutputKind, SamplingParams


def outputs_digest(num_requests: int) -> None:
    config = EngineArgs(num_kv_blocks=400, block_size=16, max_num_seqs=24,
                        max_num_batched_tokens=256).create_engine_config()
    rng = random.Random(0)
    requests = []
    for i in range(num_requests):
        stop = rng.choice([None, None, ["e"], [" a", "th", "ing"], ["ion", "the"]])
        max_tokens = rng.randint(1, 40)
        params = SamplingParams(
            n=rng.choice([1, 1, 1, 2, 3]), max_tokens=max_tokens, stop=stop, seed=i,
            output_kind=rng.choice(list(RequestOutputKind)),
            include_stop_str_in_output=rng.random() < 0.3,
            detokenize=rng.random() < 0.85 or stop is not None,
            min_tokens=min(max_tokens, rng.choice([0, 0, 3])), skip_special_tokens=rng.random() < 0.8)
        requests.append((f"q{i}", params, rng.randint(4, 60)))  # id, params, output length
    engine = simulated_engine(config, as_cost_model(None), {rid: n for rid, _, n in requests})
    vocab, runner = engine.tokenizer.vocab_size, engine.runner
    planned = runner._next_token

    def next_token(request, num_accepted=0):  # eos at the drawn length, else a varied token
        token = planned(request, num_accepted)
        if token == request.eos_token_id or token in request.sampling_params.stop_token_ids:
            return token
        return random.Random(f"{request.request_id}-{len(request.output_token_ids)}").randrange(200, vocab - 200)

    runner._next_token = next_token
    digest, num_outputs, step = hashlib.sha256(), 0, 0
    while requests or engine.has_unfinished_requests():
        for rid, params, _ in requests[:3]:
            prompt = [random.Random(f"{rid}{j}").randrange(200, vocab - 200) for j in range(rng.randint(3, 50))]
            engine.add_request(rid, {"prompt_token_ids": prompt}, params)
        del requests[:3]
        unfinished = engine.get_unfinished_request_ids()
        if step % 17 == 5 and unfinished:
            engine.abort_request(unfinished[len(unfinished) // 2])
        for out in engine.step():
            m = out.metrics
            digest.update(repr((
                out.request_id, out.finished, out.error, out.num_cached_tokens, out.prompt_logprobs,
                out.kv_transfer_params,
                m and (m.arrival_time, m.first_scheduled_time, m.first_token_time, m.finished_time,
                       m.num_preemptions, m.num_cached_tokens),
                [(c.index, c.text, c.token_ids, c.cumulative_logprob, c.logprobs, c.finish_reason,
                  c.stop_reason) for c in out.outputs])).encode())
            num_outputs += 1
        stats = engine.history[-1].iteration_stats
        digest.update(repr((stats.num_prompt_tokens, stats.num_generation_tokens,
                            stats.time_to_first_tokens_iter, stats.inter_token_latencies_iter,
                            stats.finished_requests)).encode())
        step += 1
    print(f"requests={num_requests} steps={step} outputs={num_outputs} digest={digest.hexdigest()[:16]}")


if __name__ == "__main__":
    outputs_digest(int(sys.argv[1]) if len(sys.argv) > 1 else 150)
