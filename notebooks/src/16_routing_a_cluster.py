# %% [markdown]
# # Routing a cluster: round robin, cache-aware and precise prefix routing
#
# One engine has one prefix cache. Behind a router, N engines have N of them, and which
# engine a request lands on decides whether its prompt's prefix is already cached there.
# Production routers differ exactly here: round robin ignores the caches, SGLang's
# cache-aware router guesses them from what it sent where (an approximate radix tree),
# llm-d's precise prefix scorer reads them from the engines' KV events. You will:
#
# - build a workload whose requests share a few long prefixes, in random order;
# - route it over four simulated engines behind each router and compare prefix hit rate and
#   time to first token, as ratios against round robin;
# - draw each run as a cluster timeline (one lane per replica) and read one routing decision
#   with every candidate's scores;
# - write a router of your own, as you would subclass a scheduling policy;
# - measure the *outcome regret* of decisions: replay the run with the request sent elsewhere
#   and see the latency that choice would have made;
# - read a real engine's KV events as vLLM publishes them (ZMQ, msgpack), with a subscriber.
#
# The replicas are simulated: the real scheduler and KV cache of each engine, with step times
# from the shipped cost model, each replica on its own clock. So every number below is the
# same on every machine.

# %%
import pandas as pd

from workbench.cluster import Cluster, Router, Routing
from workbench.cluster.shared_prefix import shared_prefix_workload
from workbench.viz import plot_cluster_timeline

workload = shared_prefix_workload(600, rate=200.0, num_groups=12, prefix_len=192)
print(workload)
print(workload[0].prompt[:8], "...", len(workload[0].prompt), "tokens")

# %% [markdown]
# Twelve system prompts of 192 tokens, each request one of them plus 16 to 64 tokens of its
# own, 200 arrivals a second. Each replica has 64 KV blocks of 16 tokens: room for about five
# prefixes, not twelve, so where a request goes matters.

# %%
config = {"block_size": 16, "num_kv_blocks": 64}
results = {router: Cluster.simulated(4, config, router=router).run(workload)
           for router in ("round_robin", "cache_aware", "precise_prefix")}
for name, result in results.items():
    print(result)

# %% [markdown]
# ## The headline, as ratios against round robin
#
# `summary()` gives the cluster's numbers: prefix hit rate (hit over looked-up prompt tokens,
# all replicas), TTFT and TPOT percentiles in (simulated) seconds, each replica's load and the
# imbalance (the busiest replica's requests over the mean).

# %%
rows = []
for name, result in results.items():
    s = result.summary()
    rows.append({"router": name, "hit_rate": s["prefix_hit_rate"], "ttft_p50_ms": 1e3 * s["ttft_s_p50"],
                 "ttft_p99_ms": 1e3 * s["ttft_s_p99"], "imbalance": s["imbalance"]})
table = pd.DataFrame(rows).set_index("router")
table["hit_rate_x_rr"] = table["hit_rate"] / table.loc["round_robin", "hit_rate"]
table["ttft_p50_x_rr"] = table["ttft_p50_ms"] / table.loc["round_robin", "ttft_p50_ms"]
table.round(3)

# %% [markdown]
# Both prefix-aware routers find the shared prefix several times as often as round robin and
# halve the median time to first token: a cached prefix is 192 tokens the engine does not
# prefill. (SGLang reports a 3.8x hit rate for its router; llm-d large gains for precise
# prefix routing; the effect here is the same mechanism at toy scale.)
#
# ## One lane per replica
#
# The cluster timeline draws every request on the replica that served it: grey while it
# waited, its colour until its first token, paler while it decoded. The first tenth of a
# second of each run:

# %%
from IPython.display import Image

from workbench.viz.figures import figure_png, new_figure

figure = new_figure(10, 6)
axes = figure.subplots(2, 1, sharex=True)
for ax, name in zip(axes, ("round_robin", "cache_aware")):
    plot_cluster_timeline(results[name], ax)
    ax.set_xlim(0, 0.1)
Image(figure_png(figure))

# %% [markdown]
# ## Every decision, with every candidate's scores
#
# `result.decisions` keeps one row per arrival: when it came, what the router chose, and each
# score it compared, per replica (`match_2` is the fraction of the prompt replica 2's tree
# holds). Cache-aware routing goes by the longest match above SGLang's `cache_threshold=0.3`,
# unless the loads are unbalanced (`balance_abs_threshold=64` and `balance_rel_threshold=1.5`),
# and otherwise to the replica with the smallest tree:

# %%
decisions = results["cache_aware"].decisions
decisions.iloc[20:24].filter(regex="arrival|request_id|replica|router_choice|match_").round(3)

# %% [markdown]
# ## A router of your own
#
# A router is a class with one method, `route(request, replicas)`, returning the chosen
# replica (and, optionally, the scores it compared). Each `ReplicaView` carries the replica's
# queues and KV usage, and `request.prompt_token_ids` the prompt. This one sends a request to
# the replica that served its first 64 tokens before, unless that replica is three requests
# busier than the least busy one:

# %%
class StickyPrefix(Router):
    name = "sticky_prefix"

    def __init__(self):
        self.home = {}

    def route(self, request, replicas):
        load = [r.num_requests for r in replicas]
        key = request.prompt_token_ids[:64]
        home = self.home.get(key)
        if home is None or load[home] > min(load) + 3:
            home = self.home[key] = load.index(min(load))
        return Routing(home, {"requests": load})


mine = Cluster.simulated(4, config, router=StickyPrefix()).run(workload)
print(mine)

# %% [markdown]
# ## Outcome regret: the latency the other choice would have made
#
# A router's scores say which replica looked best; they do not say what the other choice
# would have cost. `result.fork(request_id, replica)` runs the cluster again with that one
# request sent elsewhere (every other arrival still asks the router), and `regret(sample=K)`
# does so for K sampled decisions and every alternative: the request's own TTFT and
# end-to-end difference (positive: the alternative was worse) and the mean end-to-end
# difference over all requests. On a smaller workload, to keep the replays quick:

# %%
small = shared_prefix_workload(150, rate=200.0, num_groups=12, prefix_len=192)
run = Cluster.simulated(4, config, router="cache_aware").run(small)
regret = run.regret(sample=5, seed=0)
(1e3 * regret.set_index(["request_id", "alternative"])[["ttft_delta", "e2e_delta", "mean_e2e_delta"]]).round(3)

# %%
figure = new_figure(8, 3)
ax = figure.add_subplot()
labels = [f"{r.request_id}->{r.alternative}" for r in regret.itertuples()]
ax.bar(labels, 1e3 * regret["e2e_delta"], color=["#c62828" if v < 0 else "#2e7d32" for v in regret["e2e_delta"]])
ax.axhline(0, color="0.3", linewidth=0.8)
ax.set_ylabel("e2e difference (ms)")
ax.set_title("each sampled decision, sent elsewhere (red: the alternative was better)")
ax.tick_params(axis="x", labelrotation=90, labelsize=7)
Image(figure_png(figure))

# %% [markdown]
# ## The router player: every candidate at every decision
#
# `RouterPlayer(result)` steps through the decisions. At each one it shows every replica as the
# router saw it at that arrival -- its queue (waiting over running), its KV use, how much of the
# prompt its prefix cache really held (`prefix held`, read from the replica's own cache, whatever
# the router guessed), and the router's scores -- with the chosen replica outlined. "regret of
# this choice" forks the run once per alternative and shows what the request (and the cluster)
# would have got there. `ClusterDashboard(result)` puts the replicas' table, the timeline and
# this player in tabs.

# %%
from workbench.viz import ClusterDashboard, RouterPlayer

player = RouterPlayer(run)
player.show(40)
player.ask_regret()
player

# %%
ClusterDashboard(run)

# %% [markdown]
# ## KV events, as vLLM publishes them
#
# `precise_prefix` reads the replicas' KV events: after each step that changed its prefix
# cache, an engine publishes a `KVEventBatch(ts, events, data_parallel_rank)` of
# `BlockStored` / `BlockRemoved` / `AllBlocksCleared`, msgpack-encoded as vLLM's msgspec
# structs, on a ZMQ PUB socket (`(topic, sequence, payload)`), with a replay socket for
# what a subscriber missed. `workbench serve --kv-events-config JSON` publishes a server's.
# Here a real engine publishes, and a subscriber that joined late catches up by replay:

# %%
import tempfile

from workbench import EngineArgs, LLMEngine, SamplingParams
from workbench.metrics.kv_events_publisher import KVEventsConfig, attach
from workbench.metrics.kv_events_subscriber import KVEventSubscriber

where = tempfile.mkdtemp()
events = KVEventsConfig(enable_kv_cache_events=True, endpoint=f"ipc://{where}/kv",
                        replay_endpoint=f"ipc://{where}/kv-replay", topic="kv-events")
engine = LLMEngine.from_engine_args(EngineArgs(block_size=4, num_kv_blocks=32))
publisher = attach(engine, events)
engine.add_request("a", "ROMEO: good morrow, sweet friend", SamplingParams(temperature=0, max_tokens=4))
while engine.has_unfinished_requests():
    engine.step()
publisher.flush()

subscriber = KVEventSubscriber(events.endpoint, events.replay_endpoint, topic="kv-events", start_seq=0)
import time; time.sleep(0.3)  # the subscription reaches the publisher
engine.add_request("b", "ROMEO: good morrow, sweet lady", SamplingParams(temperature=0, max_tokens=2))
while engine.has_unfinished_requests():
    engine.step()
publisher.flush()
received = []
while len(received) < 2:
    received += subscriber.receive(timeout_ms=200)
for seq, batch in received:
    print(seq, [f"{type(e).__name__}({len(e.block_hashes)} blocks)" for e in batch.events])
subscriber.close()
publisher.shutdown()

# %% [markdown]
# Sequence 0 came by replay (the subscriber joined after it was published), sequence 1 live.
# Request `b` shares `a`'s first blocks, so it stored only its own.
#
# ## Exercises
#
# 1. Raise `num_kv_blocks` to 256 (every replica can hold every prefix): what happens to the
#    gap between round robin and the prefix-aware routers? Lower it to 32.
# 2. `CacheAware(balance_abs_threshold=4, balance_rel_threshold=1.1)` balances load much
#    earlier. Compare its hit rate, TTFT p99 and imbalance with the defaults at `rate=400`.
# 3. Route with `llm_d` (`WeightedScorers`) and change its weights: `{"prefix": 1}` alone, then
#    `{"queue": 1}` alone. Which scorer carries the hit rate, which the tail latency?
# 4. Take the decision with the largest negative `mean_e2e_delta` in a `regret(sample=20)`:
#    read its row in `decisions`. Which score misled the router?
# 5. `workbench bench cluster routers --real --requests 120 --rate 20` runs the comparison on
#    real engines (slow on a CPU): do the ratios hold?
