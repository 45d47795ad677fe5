"""shared_prefix_workload: requests that open with one of a few long shared prefixes, in random order.

As SGLang's generated-shared-prefix benchmark: ``num_groups`` system prompts of
``prefix_len`` tokens, each request one of them followed by its own question, Poisson
arrivals at ``rate`` per second. The group of each arrival is drawn at random from
``seed`` (so round robin does not keep a group on one replica by accident, as it would if
groups came in turn), and the prompts are corpus token ids.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from workbench.lab.workload import LengthSpec, Workload


def shared_prefix_workload(num_requests: int = 600, rate: float = 200.0, *, num_groups: int = 12,
                           prefix_len: int = 192, input_len: LengthSpec = (208, 256),
                           output_len: LengthSpec = (4, 16), seed: int = 1) -> Workload:
    base = Workload.poisson(num_requests, rate=rate, input_len=input_len, output_len=output_len,
                            num_prefix_groups=num_groups, prefix_len=prefix_len, text=False, clock="wall", seed=seed)
    order = np.random.default_rng(seed).permutation(len(base))
    requests = [dataclasses.replace(base[int(j)], request_id=f"r{i:0{len(str(len(base) - 1))}d}",
                                    arrival_time=base[i].arrival_time, arrival_step=base[i].arrival_step)
                for i, j in enumerate(order)]
    info = {**base.info, "generator": "shared_prefix", "num_groups": num_groups}
    return Workload(requests, info, clock="wall")
