# %% [markdown]
# # Prefill and decode on different engines: the KV connector, and when it pays
#
# DistServe, Splitwise, llm-d and vLLM's disaggregated prefill all run a request's prompt on
# one engine (the *prefill* engine, a KV *producer*) and its generation on another (the
# *decode* engine, a KV *consumer*), moving the prompt's KV blocks between them. Prefill
# steps are long and compute-bound, decode steps short and memory-bound; apart, neither slows
# the other. The price: a second hop and a KV transfer. You will:
#
# - run one request through a producer and a consumer by hand, as vLLM's proxy does
#   (`max_tokens=1` with `do_remote_decode`, then the returned `kv_transfer_params`), and
#   watch the consumer's `WAITING_FOR_REMOTE_KVS` and the producer's held blocks;
# - check that the copied blocks are the producer's, tensor for tensor, and that the tokens
#   equal a colocated engine's;
# - time a transfer on a modelled link, by hand;
# - build xPyD clusters behind the `pd_proxy` router, with llm-d's P/D decider;
# - ask DistServe's question of simulated replicas: goodput under TTFT and TPOT SLOs,
#   colocated vs 2P1D vs 1P2D, over workload mixes and link speeds.

# %%
import torch
from IPython.display import Image

from workbench import LLMEngine, SamplingParams
from workbench.cluster import Cluster
from workbench.cluster.pd import PDProxy
from workbench.cluster.pd_study import crossover, sweep
from workbench.lab.workload import Workload, WorkloadRequest
from workbench.viz.figures import figure_png, new_figure

TEACHING = dict(dtype="float32", device="cpu", block_size=4, num_kv_blocks=48, max_num_seqs=4,
                max_num_batched_tokens=64)
LINK = {"link_bandwidth_gbps": 8.0, "link_latency_s": 0.002, "link_per_block_s": 0.0005}

producer = LLMEngine(**TEACHING, kv_transfer_config={"kv_role": "kv_producer", "engine_id": "prefill-0",
                                                     "kv_connector_extra_config": LINK})
consumer = LLMEngine(**TEACHING, kv_transfer_config={"kv_role": "kv_consumer", "engine_id": "decode-0",
                                                     "kv_connector_extra_config": LINK})
print(producer.config.kv_transfer_config)
print(consumer.config.kv_transfer_config)

# %% [markdown]
# ## The prefill leg
#
# The proxy sends the request to the producer with `max_tokens=1` and
# `kv_transfer_params={"do_remote_decode": True}` (offline: in `SamplingParams.extra_args`;
# over HTTP: the request's `kv_transfer_params` field). The producer computes the prompt,
# samples one token and finishes -- but its connector's `request_finished` keeps the blocks
# and returns where they are.

# %%
prompt = "ROMEO:\nBut soft, what light through yonder window breaks?"
producer.add_request("romeo", prompt, SamplingParams(
    temperature=0, max_tokens=1, extra_args={"kv_transfer_params": {"do_remote_decode": True}}))
(first,) = producer.step()
params = first.kv_transfer_params
print(first.finished, first.outputs[0].finish_reason, len(first.prompt_token_ids), "prompt tokens")
print(params)
print("held:", list(producer.scheduler.held_for_transfer),
      "free blocks", producer.kv_cache.num_free_blocks, "/", producer.kv_cache.num_blocks)

# %% [markdown]
# ## The decode leg
#
# The consumer gets the same prompt with the returned params. Its scheduler asks the
# connector (`get_num_new_matched_tokens`): every prompt token but the last is remote. It
# allocates blocks for them, tells the connector (`update_state_after_alloc`) and parks the
# request in `WAITING_FOR_REMOTE_KVS`; the worker side copies the producer's blocks, layer by
# layer, when the step starts (`start_load_kv`), and reports them in (`get_finished`) when the
# consumer's clock passes the link's modelled end.

# %%
consumer.add_request("romeo", prompt, SamplingParams(
    temperature=0, max_tokens=12, extra_args={"kv_transfer_params": params}))
consumer.runner._wait_until = lambda when: None  # hold the wall clock: see the state in flight
consumer.step()
request = consumer.scheduler.requests["romeo"]
print(request.status.name, "blocks", consumer.kv_cache.block_table("romeo"))
(transfer,) = consumer.history[-1].kv_connector_output.transfers
print(transfer.num_blocks, "blocks,", transfer.num_bytes, "bytes from", transfer.remote_engine_id)

# %% [markdown]
# The copied blocks are the producer's, tensor for tensor (every layer, keys and values):

# %%
local, remote = consumer.kv_cache.block_table("romeo"), params["remote_block_ids"][:transfer.num_blocks]
same = all(torch.equal(k[local], pk[remote]) and torch.equal(v[local], pv[remote])
           for (k, v), (pk, pv) in zip(consumer.runner.kv_caches, producer.runner.kv_caches))
print("identical:", same)

# %% [markdown]
# ## The link, by hand
#
# The embedded model keeps 4 layers x 3 KV heads x 32 dims in fp32: 384 bytes per head-row,
# twice (keys and values) per layer, 3072 bytes per token, 12288 per block of 4. On an
# 8 Gb/s link (one byte per nanosecond) with 2 ms latency and 0.5 ms per block:

# %%
n = transfer.num_blocks
by_hand = 0.002 + n * 0.0005 + n * 12288 * 8 / 8e9
print(f"{n} blocks: {1e3 * by_hand:.4f} ms by hand, {1e3 * transfer.seconds:.4f} ms modelled")

# %% [markdown]
# Now let the transfer land and the request run. The consumer computes only the last prompt
# token (to sample from it) and then decodes; once its read is reported, the producer's next
# step frees the held blocks. The tokens equal a colocated engine's.

# %%
del consumer.runner._wait_until  # back to waiting for the modelled end when nothing else runs
out = None
while consumer.has_unfinished_requests():
    out = consumer.step() or out
producer.step()
print("decode computed", out[0].num_cached_tokens, "of", len(out[0].prompt_token_ids), "prompt tokens remotely")
print("producer held:", list(producer.scheduler.held_for_transfer), "free", producer.kv_cache.num_free_blocks)

colocated, twin = LLMEngine(**TEACHING), None
colocated.add_request("romeo", prompt, SamplingParams(temperature=0, max_tokens=12))
while colocated.has_unfinished_requests():
    twin = colocated.step() or twin
print(out[0].outputs[0].text == twin[0].outputs[0].text, repr(out[0].outputs[0].text))

# %% [markdown]
# ## A P/D cluster behind vLLM's proxy flow
#
# `Cluster(prefill=[...], decode=[...], router="pd_proxy")` makes the first replicas
# producers and the rest consumers over one link; the `pd_proxy` router sends each arrival to
# the least loaded prefill replica, then its decode leg to the least loaded decode replica.
# The request's row is its decode leg, with its original arrival: its TTFT counts both queues,
# the prefill and the transfer. Here simulated replicas (the shipped cost model):

# %%
config = {"block_size": 16, "num_kv_blocks": 512, "max_num_seqs": 16, "max_num_batched_tokens": 512}
wl = Workload.poisson(24, rate=40.0, input_len=(200, 400), output_len=(8, 32), seed=0, clock="wall")
pd_run = Cluster.simulated(config=config, prefill=2, decode=1, router="pd_proxy",
                           link={"link_bandwidth_gbps": 10.0}).run(wl)
print(pd_run)
print(pd_run.decisions[["request_id", "replica", "decode_replica"]].head(6).to_string(index=False))

# %% [markdown]
# ## llm-d's P/D decider
#
# Disaggregating a request whose prompt is mostly cached on the decode replica buys little:
# llm-d sends it to the prefill pool only when the *uncached* part of the prompt is longer
# than a threshold. Three requests: the second shares 40 of its 43 tokens with the first,
# whose decode leg cached them on the decode replica.

# %%
shared = list(range(100, 140))
greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
small = {"block_size": 4, "num_kv_blocks": 64, "max_num_seqs": 4, "max_num_batched_tokens": 32}
three = Workload([WorkloadRequest("a", tuple(shared + [7, 8, 9]), greedy, arrival_time=0.0),
                  WorkloadRequest("b", tuple(shared + [11, 12, 13]), greedy, arrival_time=1.0),
                  WorkloadRequest("c", tuple(range(300, 343)), greedy, arrival_time=2.0)], clock="wall")
decided = Cluster.simulated(config=small, prefill=1, decode=1, router=PDProxy(threshold=8)).run(three)
print(decided.decisions[["request_id", "replica", "decode_replica", "uncached_1"]].to_string(index=False))

# %% [markdown]
# ## When does disaggregation pay?
#
# DistServe's measure is *goodput*: requests per second that meet both a TTFT and a TPOT SLO.
# Below, three simulated replicas in every layout -- colocated (least requests), 2P1D, 1P2D --
# on two synthetic extremes (prefill-heavy: 600-900-token prompts, 8-24 tokens out;
# decode-heavy: 32-96 in, 96-160 out) and three link speeds, with TTFT <= 200 ms and
# TPOT <= 3 ms. (The full table, with the Azure conversation trace and a 100 Gb/s link:
# `python -m workbench.benchmarks.pd`.)

# %%
table = sweep(["prefill-heavy", "decode-heavy"], 3, [0.1, 1.0, 10.0], num_requests=40,
              ttft_slo=0.2, tpot_slo=0.003)
print(table.round(3).to_string(index=False))

# %% [markdown]
# The crossover: per mix and layout, the slowest link at which it beats colocated (NaN: none).

# %%
print(crossover(table).round(3).to_string(index=False))

# %%
fig = new_figure(9, 3.2)
for ax, (mix, group) in zip(fig.subplots(1, 2), table.groupby("mix", sort=False)):
    base = group.loc[group["layout"] == "colocated", "goodput"].iloc[0]
    ax.axhline(base, color="gray", linestyle="--", label="colocated")
    for layout, runs in group[group["layout"] != "colocated"].groupby("layout", sort=False):
        ax.plot(runs["link_gbps"], runs["goodput"], marker="o", label=layout)
    ax.set_xscale("log")
    ax.set_title(mix)
    ax.set_xlabel("link (Gb/s)")
    ax.set_ylabel("goodput (req/s)")
    ax.legend()
Image(figure_png(fig))

# %% [markdown]
# What the table says on this cost model (the embedded model on this CPU). Prefill-heavy
# traffic: colocated replicas keep TTFT low but their long prefill chunks stretch the decode
# steps they share, and TPOT's p99 misses 3 ms; 2P1D keeps decode steps clean and wins on
# goodput -- once the link is fast enough (1 Gb/s here) that the transfer does not eat the TTFT
# budget; at 0.1 Gb/s every TTFT pays tens of milliseconds of transfer and it loses. 1P2D
# starves its one prefill replica. Decode-heavy traffic: short prompts barely disturb decoding,
# so colocated wins, and 2P1D's single decode replica is the bottleneck. Disaggregation pays
# when interference is what breaks the SLO, the link is fast, and the pools match the mix.
# Fit the cost model to your GPU (tutorial 09) and ask again.
#
# ## Exercises
#
# 1. Sweep the `threshold` of `PDProxy` on a shared-prefix workload
#    (`workbench.cluster.shared_prefix`): how much traffic stays on the decode pool, and what
#    happens to TTFT?
# 2. Raise the prefill-heavy rate until colocated misses its TTFT SLO: does 2P1D hold it longer?
# 3. Preempt on the decode side (a tight `num_kv_blocks` there): the request recomputes its
#    prompt locally, once -- find the step in `consumer.history` where it does.
