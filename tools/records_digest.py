"""Time one simulation and print a digest of its records, to show a host-path change left
them unchanged: every step's scheduled chunks, block and request events, sampled tokens,
finishes, scheduler stats and explanation go into one sha256.

    python tools/records_digest.py 3000    # requests (default 3000)

Run it before and after a change to the scheduler, KV cache or output path: the digest must
be the same; the wall and CPU seconds are the change's speed on this workload (Poisson
2,000/s, inputs 32-512, outputs 64-192 token ids, 20,000 blocks of 16, 256 sequences, an
8,192-token budget, the default cost model).
"""

import hashlib
import sys
import time

from workbench import EngineArgs
from workbench.lab.sim.cost_model import as_cost_model
from workbench.lab.sim.simulate import simulate
from workbench.lab.workload import Workload


def records_digest(num_requests: int) -> None:
    config = EngineArgs(num_kv_blocks=20000, block_size=16, max_num_seqs=256,
                        max_num_batched_tokens=8192).create_engine_config()
    workload = Workload.poisson(num_requests, rate=2000, input_len=(32, 512), output_len=(64, 192),
                                seed=0, text=False, clock="wall")
    wall, cpu = time.perf_counter(), time.process_time()
    result = simulate(workload, config, as_cost_model(None))
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    digest = hashlib.sha256()
    for record in result.history[:]:
        so = record.scheduler_output
        chunks = [(c.request_id, c.num_computed_tokens, c.num_new_tokens, c.token_ids, c.block_ids,
                   c.is_prefill, c.samples) for c in so.scheduled]
        digest.update(repr((so.step, chunks, so.preempted_request_ids, record.kv_events,
                            record.request_events, record.sampled_token_ids,
                            record.finished_request_ids, record.scheduler_stats,
                            so.explanation)).encode())
    print(f"requests={num_requests} steps={result.num_steps} wall={wall:.2f}s cpu={cpu:.2f}s "
          f"digest={digest.hexdigest()[:16]}")


if __name__ == "__main__":
    records_digest(int(sys.argv[1]) if len(sys.argv) > 1 else 3000)
